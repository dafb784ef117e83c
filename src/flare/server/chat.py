"""OpenAI Chat Completions and text Completions: request mapping and responses.

Chat messages carry ``reasoning_content`` next to ``content`` and OpenAI-style
``tool_calls``; streamed chunks carry the same fields as deltas (a call's first
delta has its id, type and name; later ones argument fragments). A failure
before the response starts is an HTTP error with the OpenAI envelope; after SSE
headers, an error event ends the stream without ``[DONE]``.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any, AsyncIterator

import msgspec
from starlette.requests import Request as HTTPRequest
from starlette.responses import Response, StreamingResponse

from flare.core.errors import FlareError, FrontendError
from flare.runtime.request import FinishReason
from flare.server import params as P
from flare.server import pipeline
from flare.server import protocol as W
from flare.server import tools as T
from flare.server.decode import decode_body
from flare.server.http import (Context, as_flare_error, fail, json_encoder, json_response, stage_of,
                               unless_disconnected)
from flare.server.output import OutputStream
from flare.server.parsers import Content, Reasoning, ToolArgs, ToolStart
from flare.server.pipeline import ChatSpec, ChoiceResult, Generation
from flare.server.protocol import ChatCompletionRequest, CompletionRequest, ImagePart, check_unsupported
from flare.server.text import TextCodec

log = logging.getLogger("flare.server")


# ---------------------------------------------------------------------------
# request mapping


def _message_dicts(req: ChatCompletionRequest) -> list[dict]:
    out = []
    for i, m in enumerate(req.messages):
        d = msgspec.to_builtins(m)
        if isinstance(m.content, list):
            if any(isinstance(p, ImagePart) for p in m.content):
                raise FrontendError("image inputs are not supported by this model's core", param=f"messages[{i}]",
                                    code="unsupported")
            d["content"] = "\n".join(p.text for p in m.content)
        if m.role == "assistant" and m.tool_calls and m.content is None:
            d["content"] = ""  # a turn that only called tools has no text (templates concatenate content)
        out.append(d)
    return out


def chat_spec(body: ChatCompletionRequest) -> ChatSpec:
    check_unsupported(body)
    tools = T.declare(body.tools)
    return ChatSpec(
        messages=_message_dicts(body), sampling=W.sampling(body),
        max_tokens=body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens,
        seed=body.seed, stop=W.stop_list(body.stop), stop_token_ids=body.stop_token_ids, ignore_eos=body.ignore_eos,
        n=body.n, tools=tuple(tools), tool_choice=T.tool_choice(tools, body.tool_choice),
        parallel_tool_calls=body.parallel_tool_calls is not False,
        answer=W.answer_format(body.response_format, "response_format"),
        template_kwargs={**W.thinking_kwargs(body.reasoning_effort), **(body.chat_template_kwargs or {})},
        add_generation_prompt=body.add_generation_prompt,
    )


# ---------------------------------------------------------------------------
# responses


def finish_reason(r: FinishReason | None, tool_calls: bool = False) -> str | None:
    if r is None:
        return None
    if r == FinishReason.length:
        return "length"
    return "tool_calls" if tool_calls else "stop"


def usage(gen: Generation) -> dict:
    return {"prompt_tokens": gen.prompt_tokens, "completion_tokens": gen.completion_tokens,
            "total_tokens": gen.prompt_tokens + gen.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": gen.cached_tokens}}


def _message(r: ChoiceResult, reasoning: bool) -> dict:
    o = r.output
    msg: dict[str, Any] = {"role": "assistant", "content": o.content if (o.content or not o.tool_calls) else None}
    if reasoning:
        msg["reasoning_content"] = o.reasoning or None
    if o.tool_calls:
        msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                             for c in o.tool_calls]
    return msg


class ChatApi:
    def __init__(self, ctx: Context):
        self.ctx = ctx

    async def chat_completions(self, http: HTTPRequest) -> Response:
        ctx = self.ctx
        rid = "chatcmpl-" + uuid.uuid4().hex[:24]
        try:
            body = decode_body(await ctx.read_body(http), ChatCompletionRequest)
            ctx.check_model(body.model)
            gen = await pipeline.start(ctx.model, ctx.engine, chat_spec(body), rid, limits=ctx.config.limits)
        except FlareError as e:
            return fail(self.ctx, rid, stage_of(e), e)
        reasoning = ctx.model.manifest.frontend.reasoning_parser.value != "none"
        return await self._respond(http, body, gen, chat=True, reasoning=reasoning)

    async def completions(self, http: HTTPRequest) -> Response:
        ctx = self.ctx
        rid = "cmpl-" + uuid.uuid4().hex[:24]
        try:
            body = decode_body(await ctx.read_body(http), CompletionRequest)
            ctx.check_model(body.model)
            check_unsupported(body)
            if isinstance(body.n, bool) or not 1 <= body.n <= ctx.config.limits.max_n:
                raise FrontendError(f"n must lie in [1, {ctx.config.limits.max_n}]", param="n")
            prompts = _prompts(body.prompt, ctx.model.codec)
            stops = P.stop_strings(body.stop, ctx.config.limits)
            gen = Generation(ctx.engine, rid, sum(len(p) for p in prompts), body.n)
            try:
                for p_i, prompt in enumerate(prompts):
                    for j in range(body.n):
                        index = p_i * body.n + j
                        seed = None if body.seed is None else body.seed + index
                        params = P.resolve_sampling(
                            ctx.model.manifest, prompt_len=len(prompt),
                            fields=W.sampling(body), max_tokens=body.max_tokens,
                            seed=seed, stop_token_ids=body.stop_token_ids, ignore_eos=body.ignore_eos,
                            limits=ctx.config.limits)
                        pipeline.submit(gen, index, prompt, params, OutputStream(ctx.model.codec, prompt, stops))
            except FlareError:
                gen.cancel()
                raise
        except FlareError as e:
            return fail(self.ctx, rid, stage_of(e), e)
        return await self._respond(http, body, gen, chat=False, reasoning=False)

    async def _respond(self, http: HTTPRequest, body, gen: Generation, *, chat: bool, reasoning: bool) -> Response:
        created = int(time.time())
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(self._sse(gen, chat, reasoning, created, include_usage),
                                     media_type="text/event-stream",
                                     headers={"x-request-id": gen.id, "cache-control": "no-cache"})
        results = await unless_disconnected(http, gen.results(), gen.cancel)
        if results is None:
            return Response(status_code=499)
        err = pipeline.first_error(results)
        if err is not None:
            return fail(self.ctx, gen.id, "execution", err)
        if chat:
            choices = [{"index": r.index, "message": _message(r, reasoning), "logprobs": None,
                        "finish_reason": finish_reason(r.finish.reason, bool(r.output.tool_calls))} for r in results]
        else:
            choices = [{"index": r.index, "text": r.output.content, "logprobs": None,
                        "finish_reason": finish_reason(r.finish.reason)} for r in results]
        return json_response({
            "id": gen.id, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": self.ctx.model.served_name, "choices": choices,
            "usage": usage(gen),
        }, gen.id)

    async def _sse(self, gen: Generation, chat: bool, reasoning: bool, created: int,
                   include_usage: bool) -> AsyncIterator[bytes]:
        obj = "chat.completion.chunk" if chat else "text_completion"
        model = self.ctx.model.served_name

        def frame(choices: list, usage_=None) -> bytes:
            payload = {"id": gen.id, "object": obj, "created": created, "model": model, "choices": choices}
            if include_usage:
                payload["usage"] = usage_
            return b"data: " + json_encoder.encode(payload) + b"\n\n"

        def choice(index: int, delta: dict | None = None, text: str = "", finish: str | None = None) -> dict:
            if chat:
                return {"index": index, "delta": delta or {}, "logprobs": None, "finish_reason": finish}
            return {"index": index, "text": text, "logprobs": None, "finish_reason": finish}

        completed = False
        called: set[int] = set()
        try:
            if chat:
                yield frame([choice(c.index, {"role": "assistant", "content": ""}) for c in gen.choices])
            async for u in gen.updates():
                if u.finish is not None and u.finish.error is not None:
                    err = as_flare_error(u.finish.error)
                    self.ctx.report_failure(gen.id, "streaming", err)
                    yield b"data: " + json_encoder.encode(err.envelope()) + b"\n\n"
                    return
                for e in u.events:
                    if isinstance(e, Content) and e.text:
                        yield frame([choice(u.index, {"content": e.text}, e.text)])
                    elif isinstance(e, Reasoning) and e.text and chat:
                        yield frame([choice(u.index, {"reasoning_content": e.text})])
                    elif isinstance(e, ToolStart):
                        called.add(u.index)
                        yield frame([choice(u.index, {"tool_calls": [{
                            "index": e.index, "id": e.id, "type": "function",
                            "function": {"name": e.name, "arguments": ""}}]})])
                    elif isinstance(e, ToolArgs) and e.text:
                        yield frame([choice(u.index, {"tool_calls": [{
                            "index": e.index, "function": {"arguments": e.text}}]})])
                if u.finish is not None:
                    yield frame([choice(u.index, finish=finish_reason(u.finish.reason, u.index in called))])
            if include_usage:
                yield frame([], usage(gen))
            yield b"data: [DONE]\n\n"
            completed = True
        finally:
            if not completed:  # client disconnected (generator closed) or error: free the work
                gen.cancel()


def _is_ids(x) -> bool:
    # One C-level pass over the element types (type(True) is bool, so bools are refused).
    return isinstance(x, list) and set(map(type, x)) <= {int}


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
