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

from flare.core.errors import FlareError, FrontendError, NotFoundError, PayloadTooLargeError, UnprocessableError
from flare.runtime.engine import Engine
from flare.runtime.request import FinishReason, Request
from flare.server import params as P
from flare.server.endpoints import message_marks, token_endpoints
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

    def __init__(self, engine: Engine, request_id: str, n: int):
        self.engine = engine
        self.id = request_id
        self.n = n  # choices per prompt
        self.choices: list[_Choice] = []

    def submit(self, index: int, prompt: list[int], params, stream: OutputStream,
               endpoints: tuple[int, ...] = ()) -> None:
        req = Request(prompt, params, stream, request_id=f"{self.id}-{index}", endpoints=endpoints)
        stream.request = req
        self.engine.submit(req)
        self.choices.append(_Choice(index, req, stream))

    def cancel(self) -> None:
        for c in self.choices:
            self.engine.cancel(c.request)

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.request.output) for c in self.choices)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache, counted once per prompt like
        ``prompt_tokens``: the least any of the prompt's choices reused."""
        per_prompt: dict[int, int] = {}
        for c in self.choices:
            p = c.index // self.n
            per_prompt[p] = min(per_prompt.get(p, 1 << 62), c.request.cached_tokens)
        return sum(per_prompt.values())


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

    async def run(http: HTTPRequest, body, prompts: list[list[int]], chat: bool,
                  endpoints: tuple[int, ...] = ()) -> Response:
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        stops = P.stop_strings(body.stop, config.limits)
        gen = _Generation(engine, rid, body.n)
        try:
            for p_i, prompt in enumerate(prompts):
                for j in range(body.n):
                    index = p_i * body.n + j
                    params = sampling(body, len(prompt), index)
                    gen.submit(index, prompt, params, OutputStream(frontend.codec, prompt, stops), endpoints)
        except FlareError as e:
            gen.cancel()
            log.warning("%s request %s failed at admission: %s %s", _gmt(), rid, e.code, e.message)
            return error_response(e, rid)
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
                return Response(status_code=499)
            results = collect.result()
        finally:
            watcher.cancel()
        for r in results:
            if r.finish_reason == FinishReason.error:
                err = r.error if isinstance(r.error, FlareError) else FlareError(str(r.error))
                log.error("%s request %s failed during execution: %s", _gmt(), rid, err.code)
                return error_response(err, rid)
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
            "usage": _usage(prompt_tokens, completion_tokens, gen.cached_tokens),
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
                    if chunk.finish_reason == FinishReason.error:
                        err = chunk.error if isinstance(chunk.error, FlareError) else FlareError(str(chunk.error))
                        log.error("%s request %s failed during streaming: %s", _gmt(), rid, err.code)
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
                yield frame([], _usage(prompt_tokens, gen.completion_tokens, gen.cached_tokens))
            yield b"data: [DONE]\n\n"
            completed = True
        finally:
            if not completed:  # client disconnected (generator closed) or error: free the work
                gen.cancel()

    async def chat_completions(http: HTTPRequest) -> Response:
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
            messages = _message_dicts(body)
            text = frontend.template.render(messages, add_generation_prompt=body.add_generation_prompt, **kwargs)
            prompt, offsets = frontend.codec.encode_with_offsets(text, add_special_tokens=False)
            endpoints = token_endpoints(offsets, message_marks(frontend.template, messages, text, **kwargs))
            return await run(http, body, [prompt], chat=True, endpoints=endpoints)
        except FlareError as e:
            return error_response(e)

    async def completions(http: HTTPRequest) -> Response:
        try:
            body = _decode(await read_body(http), CompletionRequest)
            check_model(body.model)
            check_unsupported(body)
            check_n(body)
            prompts = _prompts(body.prompt, frontend.codec)
            return await run(http, body, prompts, chat=False)
        except FlareError as e:
            return error_response(e)

    async def models(http: HTTPRequest) -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": frontend.served_name, "object": "model", "created": int(engine.started_wall), "owned_by": "flare",
            "max_model_len": m.capacities.context_limit,
        }]})

    async def health(http: HTTPRequest) -> Response:
        if engine.ready:
            return JSONResponse({"status": "ok"})
        detail = {"status": engine.state.value}
        if engine.failure is not None:
            detail["error"] = str(engine.failure)
        return JSONResponse(detail, status_code=503)

    async def metrics(http: HTTPRequest) -> Response:
        lines = []
        sched = engine.scheduler
        free, used, cached = sched.page_usage()
        ck = sched.checkpoints
        cache = ck.cache
        gauges = {
            "flare_requests_running": len(sched.running),
            "flare_requests_waiting": len(sched.waiting),
            "flare_kv_pages_total": sched.pages.total,
            "flare_kv_pages_free": free,
            "flare_kv_pages_used": used,  # held by requests
            "flare_kv_pages_cached": cached,  # held only by prefix-cache checkpoints
            "flare_engine_steps_total": engine.steps,
            "flare_prefill_tokens_total": sched.prefill_tokens_total,
            "flare_preemptions_total": sched.preemptions_total,
            "flare_prefix_cache_enabled": int(ck.enabled),
            "flare_prefix_cache_hit_tokens_total": ck.hit_tokens_total,
            "flare_prefix_cache_checkpoints": len(cache) if cache else 0,
            "flare_prefix_cache_published_total": cache.published if cache else 0,
            "flare_prefix_cache_duplicates_total": cache.duplicates if cache else 0,
            # Page pressure and snapshot pressure, separately.
            "flare_prefix_cache_page_evictions_total": cache.evicted_for_pages if cache else 0,
            "flare_prefix_cache_snapshot_rows_total": cache.rows.total if cache else 0,
            "flare_prefix_cache_snapshot_rows_free": cache.rows.free if cache else 0,
            "flare_prefix_cache_snapshot_evictions_total": cache.evicted_for_rows if cache else 0,
            "flare_prefix_cache_thinned_total": cache.thinned if cache else 0,
            "flare_prefix_cache_captures_skipped_total": ck.skipped_total,
        }
        for name, value in gauges.items():
            lines.append(f"{name} {value}")
        for key, value in engine.executor.stats().items():
            lines.append(f"flare_executor_{key} {value}")
        return Response("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    routes = [
        Route("/metrics", metrics, methods=["GET"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
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


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _gmt() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())

