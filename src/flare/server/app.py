"""The OpenAI-compatible HTTP frontend (Starlette).

Request path: read the body (size-limited), decode it with msgspec, render the
conversation and tokenize it, resolve sampling parameters, submit one engine
request per choice, then stream SSE chunks or return one JSON body. Every
failure before the response starts is an HTTP error with the OpenAI envelope;
a failure after SSE headers ends the stream with an error event and no
``[DONE]``. Client disconnects cancel the engine requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator

import msgspec
from starlette.applications import Starlette
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from flare.core.errors import (AuthenticationError, CapacityError, ExecutionError, FlareError, FrontendError,
                               NotFoundError, PayloadTooLargeError, UnprocessableError)
from flare.runtime.engine import Engine
from flare.runtime.request import FinishReason, Request
from flare.server import params as P
from flare.server.output import OutputStream
from flare.server.protocol import ChatCompletionRequest, CompletionRequest, ImagePart, check_unsupported
from flare.server.template import ChatTemplate
from flare.server.text import TextCodec

log = logging.getLogger("flare.server")
_json = msgspec.json.Encoder()


@dataclass(frozen=True)
class ServerConfig:
    max_body_bytes: int = 16 << 20
    limits: P.Limits = P.Limits()
    api_key: str | None = None  # when set, /v1/* requires it (Bearer or x-api-key)


class Frontend:
    """What the server needs from a core besides the engine: tokenizer, template, names."""

    def __init__(self, core_dir: str, engine: Engine, served_name: str | None = None):
        m = engine.manifest
        self.manifest = m
        self.served_name = served_name or m.frontend.served_name
        self.codec = TextCodec(f"{core_dir}/{m.frontend.tokenizer}")
        self.template = None
        if m.frontend.chat_template is not None:
            with open(f"{core_dir}/{m.frontend.chat_template}") as f:
                self.template = ChatTemplate(f.read(), dict(m.frontend.special_tokens))


def log_failure(rid: str | None, stage: str, err: FlareError) -> None:
    """One line per failed request: GMT time, request id, stage, typed code."""
    level = logging.ERROR if err.status >= 500 else logging.WARNING
    log.log(level, "%s request=%s stage=%s code=%s status=%d: %s", _gmt(), rid or "-", stage, err.code, err.status,
            err.message)


def error_response(err: FlareError, request_id: str | None = None) -> JSONResponse:
    headers = {"x-request-id": request_id} if request_id else None
    return JSONResponse(err.envelope(), status_code=err.status, headers=headers)


def _decode(body: bytes, kind: type):
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        path = str(e).rpartition("at `$.")[2].rstrip("`") if "at `$." in str(e) else None
        raise FrontendError(f"invalid request: {e}", param=path, code="invalid_request") from None
    except msgspec.DecodeError as e:
        raise FrontendError(f"request body is not valid JSON: {e}", code="invalid_json") from None


def _message_dicts(req: ChatCompletionRequest) -> list[dict]:
    out = []
    for m in req.messages:
        d = msgspec.to_builtins(m)
        if isinstance(m.content, list):
            if any(isinstance(p, ImagePart) for p in m.content):
                raise FrontendError("image inputs are not supported by this model's core", param="messages",
                                    code="unsupported")
            d["content"] = "\n".join(p.text for p in m.content)
        out.append(d)
    return out


class _Choice:
    def __init__(self, index: int, request: Request, stream: OutputStream):
        self.index = index
        self.request = request
        self.stream = stream


class _Generation:
    """The engine requests behind one HTTP response (one per choice)."""

    def __init__(self, engine: Engine, request_id: str):
        self.engine = engine
        self.id = request_id
        self.choices: list[_Choice] = []

    def submit(self, index: int, prompt: list[int], params, stream: OutputStream) -> None:
        req = Request(prompt, params, stream, request_id=f"{self.id}-{index}")
        stream.request = req
        self.engine.submit(req)
        self.choices.append(_Choice(index, req, stream))

    def cancel(self) -> None:
        for c in self.choices:
            self.engine.cancel(c.request)

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.request.output) for c in self.choices)


async def _until_disconnect(http: HTTPRequest) -> None:
    while True:
        msg = await http.receive()
        if msg["type"] == "http.disconnect":
            return


def create_app(engine: Engine, frontend: Frontend, config: ServerConfig = ServerConfig()) -> Starlette:
    m = engine.manifest

    async def read_body(http: HTTPRequest) -> bytes:
        declared = http.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > config.max_body_bytes:
            raise PayloadTooLargeError(f"request body exceeds {config.max_body_bytes} bytes")
        chunks, size = [], 0
        async for chunk in http.stream():
            size += len(chunk)
            if size > config.max_body_bytes:
                raise PayloadTooLargeError(f"request body exceeds {config.max_body_bytes} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    def check_model(name: str) -> None:
        if name != frontend.served_name:
            raise NotFoundError(f"model {name!r} is not served here (available: {frontend.served_name!r})",
                                param="model", code="model_not_found")

    def sampling(body, prompt_len: int, index: int):
        fields = {k: getattr(body, k) for k in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                                                 "presence_penalty", "frequency_penalty")}
        max_tokens = body.max_tokens
        if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
            max_tokens = body.max_completion_tokens
        seed = None if body.seed is None else body.seed + index
        return P.resolve_sampling(m, prompt_len=prompt_len, fields=fields, max_tokens=max_tokens, seed=seed,
                                  stop_token_ids=body.stop_token_ids, ignore_eos=body.ignore_eos,
                                  limits=config.limits)

    def check_n(body) -> None:
        if isinstance(body.n, bool) or not 1 <= body.n <= config.limits.max_n:
            raise FrontendError(f"n must lie in [1, {config.limits.max_n}]", param="n")

    def fail(rid: str | None, stage: str, err: FlareError) -> JSONResponse:
        log_failure(rid, stage, err)
        engine.metrics.on_error(err.code)
        return error_response(err, rid)

    def outcome_error(r) -> FlareError | None:
        """The typed error for a choice that did not finish normally."""
        if r.finish_reason == FinishReason.error:
            return r.error if isinstance(r.error, FlareError) else ExecutionError(str(r.error))
        if r.finish_reason == FinishReason.cancelled:  # not the client: it is still here
            return CapacityError("the server is shutting down; the request was cancelled", code="server_shutdown")
        return None

    async def run(http: HTTPRequest, rid: str, body, prompts: list[list[int]], chat: bool) -> Response:
        stops = P.stop_strings(body.stop, config.limits)
        choices = [(p_i * body.n + j, prompt, sampling(body, len(prompt), p_i * body.n + j))
                   for p_i, prompt in enumerate(prompts) for j in range(body.n)]
        gen = _Generation(engine, rid)
        try:
            for index, prompt, params in choices:
                gen.submit(index, prompt, params, OutputStream(frontend.codec, prompt, stops))
        except FlareError as e:
            gen.cancel()
            return fail(rid, "admission", e)
        prompt_tokens = sum(len(p) for p in prompts)
        created = int(time.time())
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                _sse(gen, chat, rid, created, prompt_tokens, include_usage, http),
                media_type="text/event-stream",
                headers={"x-request-id": rid, "cache-control": "no-cache"},
            )
        watcher = asyncio.ensure_future(_until_disconnect(http))
        try:
            collect = asyncio.ensure_future(asyncio.gather(*(c.stream.collect() for c in gen.choices)))
            done, _ = await asyncio.wait({collect, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if collect not in done:  # the client left: cancel its work
                gen.cancel()
                collect.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await collect
                return Response(status_code=499)
            results = collect.result()
        finally:
            watcher.cancel()
        for r in results:
            err = outcome_error(r)
            if err is not None:
                return fail(rid, "execution", err)
        choices = []
        for c, r in zip(gen.choices, results):
            if chat:
                choices.append({"index": c.index, "message": {"role": "assistant", "content": r.text},
                                "logprobs": None, "finish_reason": _finish(r.finish_reason)})
            else:
                choices.append({"index": c.index, "text": r.text, "logprobs": None,
                                "finish_reason": _finish(r.finish_reason)})
        completion_tokens = gen.completion_tokens
        payload = {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": frontend.served_name,
            "choices": choices,
            "usage": _usage(prompt_tokens, completion_tokens),
        }
        return Response(_json.encode(payload), media_type="application/json", headers={"x-request-id": rid})

    async def _sse(gen: _Generation, chat: bool, rid: str, created: int, prompt_tokens: int,
                   include_usage: bool, http: HTTPRequest) -> AsyncIterator[bytes]:
        obj = "chat.completion.chunk" if chat else "text_completion"

        def frame(choices: list, usage=None) -> bytes:
            payload = {"id": rid, "object": obj, "created": created, "model": frontend.served_name,
                       "choices": choices}
            if include_usage:
                payload["usage"] = usage
            return b"data: " + _json.encode(payload) + b"\n\n"

        def choice(index: int, text: str | None, finish: str | None, first: bool = False) -> dict:
            if chat:
                delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
                return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
            return {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish}

        completed = False
        try:
            if chat:
                yield frame([choice(c.index, None, None, first=True) for c in gen.choices])
            pending = {c.index: asyncio.ensure_future(c.stream.next()) for c in gen.choices}
            by_index = {c.index: c for c in gen.choices}
            while pending:
                done, _ = await asyncio.wait(pending.values(), return_when=asyncio.FIRST_COMPLETED)
                for fut in done:
                    index = next(i for i, f in pending.items() if f is fut)
                    chunk = fut.result()
                    del pending[index]
                    err = outcome_error(chunk)
                    if err is not None:  # after the headers: an error event, and no [DONE]
                        log_failure(rid, "streaming", err)
                        engine.metrics.on_error(err.code)
                        gen.cancel()
                        for f in pending.values():
                            f.cancel()
                        yield b"data: " + _json.encode(err.envelope()) + b"\n\n"
                        return
                    if chunk.text:
                        yield frame([choice(index, chunk.text, None)])
                    if chunk.finish_reason is not None:
                        yield frame([choice(index, None, _finish(chunk.finish_reason))])
                    else:
                        pending[index] = asyncio.ensure_future(by_index[index].stream.next())
            if include_usage:
                yield frame([], _usage(prompt_tokens, gen.completion_tokens))
            yield b"data: [DONE]\n\n"
            completed = True
        finally:
            if not completed:  # client disconnected (generator closed) or error: free the work
                gen.cancel()

    async def chat_completions(http: HTTPRequest) -> Response:
        rid = new_request_id("chatcmpl-")
        try:
            body = _decode(await read_body(http), ChatCompletionRequest)
            check_model(body.model)
            check_unsupported(body)
            check_n(body)
            if not body.messages:
                raise FrontendError("messages must not be empty", param="messages", code="empty_messages")
            if frontend.template is None:
                raise UnprocessableError("this core has no chat template; use /v1/completions", param="messages")
            kwargs = dict(body.chat_template_kwargs or {})
            text = frontend.template.render(_message_dicts(body), add_generation_prompt=body.add_generation_prompt,
                                            **kwargs)
            prompt = frontend.codec.encode(text, add_special_tokens=False)
            return await run(http, rid, body, [prompt], chat=True)
        except FlareError as e:
            return fail(rid, "frontend", e)

    async def completions(http: HTTPRequest) -> Response:
        rid = new_request_id("cmpl-")
        try:
            body = _decode(await read_body(http), CompletionRequest)
            check_model(body.model)
            check_unsupported(body)
            check_n(body)
            prompts = _prompts(body.prompt, frontend.codec)
            return await run(http, rid, body, prompts, chat=False)
        except FlareError as e:
            return fail(rid, "frontend", e)

    async def models(http: HTTPRequest) -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": frontend.served_name, "object": "model", "created": int(engine.started_wall), "owned_by": "flare",
            "max_model_len": m.capacities.context_limit,
        }]})

    async def health(http: HTTPRequest) -> Response:
        """Worker readiness, not just process liveness: 503 while starting, draining
        or after the engine failed."""
        if engine.ready:
            return JSONResponse({"status": "ok"})
        detail = {"status": engine.state.value}
        if engine.failure is not None:
            detail["error"] = str(engine.failure)
        return JSONResponse(detail, status_code=503)

    async def metrics(http: HTTPRequest) -> Response:
        return Response(engine.metrics.render(engine.gauges()), media_type="text/plain; version=0.0.4")

    def guarded(handler):
        """API key (when configured) and a typed 500 for anything unexpected."""

        async def wrapped(http: HTTPRequest) -> Response:
            if config.api_key is not None and _presented_key(http) != config.api_key:
                return fail(None, "auth", AuthenticationError("missing or invalid API key", param="authorization"))
            try:
                return await handler(http)
            except Exception as e:  # a bug, not a client error: typed 500, logged with its stack
                log.exception("unhandled error in %s", http.url.path)
                return fail(None, "internal", FlareError(f"internal error: {type(e).__name__}"))

        return wrapped

    routes = [
        Route("/metrics", metrics, methods=["GET"]),
        Route("/v1/chat/completions", guarded(chat_completions), methods=["POST"]),
        Route("/v1/completions", guarded(completions), methods=["POST"]),
        Route("/v1/models", guarded(models), methods=["GET"]),
        Route("/health", health, methods=["GET"]),
    ]

    async def not_found(http: HTTPRequest, exc) -> Response:
        return error_response(NotFoundError(f"no route {http.method} {http.url.path}", code="route_not_found"))

    async def method_not_allowed(http: HTTPRequest, exc) -> Response:
        err = FrontendError(f"method {http.method} is not allowed on {http.url.path}", code="method_not_allowed")
        err.status = 405
        return error_response(err)

    return Starlette(routes=routes, exception_handlers={404: not_found, 405: method_not_allowed})


def _is_ids(x) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def _prompts(prompt, codec: TextCodec) -> list[list[int]]:
    if isinstance(prompt, str):
        prompts = [codec.encode(prompt, add_special_tokens=True)]
    elif prompt and _is_ids(prompt):
        prompts = [list(prompt)]
    elif prompt and all(isinstance(p, str) for p in prompt):
        prompts = [codec.encode(p, add_special_tokens=True) for p in prompt]
    elif prompt and all(_is_ids(p) for p in prompt):
        prompts = [list(p) for p in prompt]
    else:
        raise FrontendError("prompt must be a non-empty string, token list, or list of them", param="prompt",
                            code="empty_prompt")
    if any(not p for p in prompts):
        raise FrontendError("prompt must not be empty", param="prompt", code="empty_prompt")
    return prompts


def _finish(reason: FinishReason | None) -> str | None:
    if reason is None:
        return None
    return "length" if reason == FinishReason.length else "stop"


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def new_request_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


def _presented_key(http: HTTPRequest) -> str | None:
    auth = http.headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return http.headers.get("x-api-key")


def _gmt() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())

