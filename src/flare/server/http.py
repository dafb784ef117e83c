"""HTTP plumbing shared by the protocol mappers: bounded bodies, typed decoding,
error envelopes, disconnect watching, and the context every handler receives."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

import msgspec
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response

from flare.core.errors import FlareError, FrontendError, NotFoundError, PayloadTooLargeError
from flare.runtime.engine import Engine
from flare.server import params as P
from flare.server.pipeline import Frontend

json_encoder = msgspec.json.Encoder()


@dataclass(frozen=True)
class ServerConfig:
    max_body_bytes: int = 16 << 20
    limits: P.Limits = P.Limits()


@dataclass(frozen=True)
class Context:
    engine: Engine
    frontend: Frontend
    config: ServerConfig

    def check_model(self, name: str) -> None:
        if name != self.frontend.served_name:
            raise NotFoundError(f"model {name!r} is not served here (available: {self.frontend.served_name!r})",
                                param="model", code="model_not_found")

    async def read_body(self, http: HTTPRequest) -> bytes:
        limit = self.config.max_body_bytes
        declared = http.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise PayloadTooLargeError(f"request body exceeds {limit} bytes")
        chunks, size = [], 0
        async for chunk in http.stream():
            size += len(chunk)
            if size > limit:
                raise PayloadTooLargeError(f"request body exceeds {limit} bytes")
            chunks.append(chunk)
        return b"".join(chunks)


def decode_body(body: bytes, kind: type):
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        path = str(e).rpartition("at `$.")[2].rstrip("`") if "at `$." in str(e) else None
        raise FrontendError(f"invalid request: {e}", param=path, code="invalid_request") from None
    except msgspec.DecodeError as e:
        raise FrontendError(f"request body is not valid JSON: {e}", code="invalid_json") from None


def error_response(err: FlareError, request_id: str | None = None) -> JSONResponse:
    headers = {"x-request-id": request_id} if request_id else None
    return JSONResponse(err.envelope(), status_code=err.status, headers=headers)


def as_flare_error(err: BaseException | None) -> FlareError:
    return err if isinstance(err, FlareError) else FlareError(str(err))


def json_response(payload: dict, request_id: str) -> Response:
    return Response(json_encoder.encode(payload), media_type="application/json", headers={"x-request-id": request_id})


async def until_disconnect(http: HTTPRequest) -> None:
    while True:
        msg = await http.receive()
        if msg["type"] == "http.disconnect":
            return


async def unless_disconnected(http: HTTPRequest, work: Awaitable, on_leave: Callable[[], None]):
    """Await ``work``; if the client leaves first, call ``on_leave`` and return None."""
    watcher = asyncio.ensure_future(until_disconnect(http))
    task = asyncio.ensure_future(work)
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task not in done:
            on_leave()
            task.cancel()
            return None
        return task.result()
    finally:
        watcher.cancel()


def gmt() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
