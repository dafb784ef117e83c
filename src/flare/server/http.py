"""HTTP plumbing shared by the endpoints: bounded bodies, error envelopes, disconnect
watching, and the context every handler receives."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Awaitable, Callable

import msgspec
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response

from flare.core.errors import (AdmissionError, AuthenticationError, CapacityError, FlareError, NotFoundError,
                               PayloadTooLargeError)
from flare.runtime.engine import Engine
from flare.server import params as P
from flare.server.served_model import ServedModel

json_encoder = msgspec.json.Encoder()
log = logging.getLogger("flare.server")


@dataclass(frozen=True)
class ServerConfig:
    max_body_bytes: int = 16 << 20
    limits: P.Limits = P.Limits()
    api_key: str | None = None  # when set, /v1/* requires it (Bearer or x-api-key)


@dataclass(frozen=True)
class Context:
    engine: Engine
    model: ServedModel
    config: ServerConfig

    def report_failure(self, rid: str | None, stage: str, err: FlareError) -> None:
        log_failure(rid, stage, err)
        self.engine.metrics.on_error(err.code)

    def check_model(self, name: str) -> None:
        if name != self.model.served_name:
            raise NotFoundError(f"model {name!r} is not served here (available: {self.model.served_name!r})",
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


def stage_of(err: FlareError) -> str:
    return "admission" if isinstance(err, (AdmissionError, CapacityError)) else "frontend"


def log_failure(rid: str | None, stage: str, err: FlareError) -> None:
    """One line per failed request: GMT time, request id, stage, typed code."""
    level = logging.ERROR if err.status >= 500 else logging.WARNING
    log.log(level, "%s request=%s stage=%s code=%s status=%d: %s", gmt(), rid or "-", stage, err.code, err.status,
            err.message)


def fail(ctx: "Context", rid: str | None, stage: str, err: FlareError, envelope=None) -> JSONResponse:
    """Log, count and answer a failed request (``envelope`` maps the error for the
    protocol; OpenAI's by default)."""
    ctx.report_failure(rid, stage, err)
    if envelope is None:
        return error_response(err, rid)
    headers = {"x-request-id": rid} if rid else None
    return JSONResponse(envelope(err), status_code=err.status, headers=headers)


def new_request_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


def _presented_key(http: HTTPRequest) -> str | None:
    auth = http.headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return http.headers.get("x-api-key")


def guarded(ctx: "Context", handler):
    """The API key (when configured) and a typed 500 for anything unexpected."""

    async def wrapped(http: HTTPRequest) -> Response:
        if ctx.config.api_key is not None and _presented_key(http) != ctx.config.api_key:
            return fail(ctx, None, "auth", AuthenticationError("missing or invalid API key", param="authorization"))
        try:
            return await handler(http)
        except Exception as e:  # a bug, not a client error: typed 500, logged with its stack
            log.exception("unhandled error in %s", http.url.path)
            return fail(ctx, None, "internal", FlareError(f"internal error: {type(e).__name__}"))

    return wrapped


def error_response(err: FlareError, request_id: str | None = None) -> JSONResponse:
    headers = {"x-request-id": request_id} if request_id else None
    return JSONResponse(err.envelope(), status_code=err.status, headers=headers)


def json_response(payload: dict, request_id: str) -> Response:
    return Response(json_encoder.encode(payload), media_type="application/json", headers={"x-request-id": request_id})


async def until_disconnect(http: HTTPRequest) -> None:
    while True:
        msg = await http.receive()
        if msg["type"] == "http.disconnect":
            return


def event_frame(event: dict) -> bytes:
    """One SSE frame named by the event's ``type`` (the Responses and Messages streams)."""
    return b"event: " + event["type"].encode() + b"\ndata: " + json_encoder.encode(event) + b"\n\n"


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
