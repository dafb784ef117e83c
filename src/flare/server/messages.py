"""Anthropic Messages (``POST /v1/messages``).

``system`` becomes the leading system message; ``tool_use`` blocks the
assistant's tool calls (``input`` serialised as the arguments' JSON);
``tool_result`` blocks tool messages, placed before the user's text of the same
turn; ``thinking`` blocks the assistant's reasoning. ``thinking: {"type":
"enabled" | "disabled"}`` sets the template's ``enable_thinking`` switch
(``budget_tokens`` is accepted for compatibility but not enforced: ``max_tokens``
bounds the whole output). ``tool_choice`` ``any`` is OpenAI's ``required``.
``output_config.format`` (a JSON schema) is structured output, as ``response_format``.

Output blocks are built from parsed events in arrival order (thinking, text,
tool_use), identically for streaming and non-streaming responses. Errors use
Anthropic's envelope, ``{"type": "error", "error": {"type", "message"}}``, over
HTTP and as the stream's ``error`` event.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import AsyncIterator

from starlette.requests import Request as HTTPRequest
from starlette.responses import Response, StreamingResponse

from flare.core.errors import FlareError, FrontendError
from flare.runtime.request import FinishReason
from flare.server import pipeline
from flare.server import protocol as W
from flare.server import tools as T
from flare.server.decode import decode_body
from flare.server.http import Context, event_frame, fail, json_response, stage_of, unless_disconnected
from flare.server.parsers import Content, Event, Reasoning, ToolArgs, ToolEnd, ToolStart
from flare.server.pipeline import ChatSpec, Finish, Generation
from flare.server.protocol_messages import (ImageBlock, MessagesRequest, MessagesToolChoice, RedactedThinkingBlock,
                                           TextBlock, ThinkingBlock, ToolResultBlock, ToolUseBlock)

log = logging.getLogger("flare.server")

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 422: "invalid_request_error", 429: "rate_limit_error",
                503: "overloaded_error"}


def anthropic_error(err: FlareError) -> dict:
    kind = _ERROR_TYPES.get(err.status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


# ---------------------------------------------------------------------------
# request mapping


def _texts(blocks: list[TextBlock | ImageBlock], param: str) -> list[str]:
    for j, b in enumerate(blocks):
        if not isinstance(b, TextBlock):
            raise FrontendError("image blocks are not supported by this model's core", param=f"{param}[{j}]",
                                code="unsupported")
    return [b.text for b in blocks]


def chat_messages(body: MessagesRequest) -> list[dict]:
    out: list[dict] = []
    if body.system:
        system = body.system if isinstance(body.system, str) else "\n".join(b.text for b in body.system)
        out.append({"role": "system", "content": system})
    for i, m in enumerate(body.messages):
        param = f"messages[{i}]"
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        texts, calls, results, thinking = [], [], [], None
        for j, b in enumerate(m.content):
            bp = f"{param}.content[{j}]"
            assistant = m.role == "assistant"
            if isinstance(b, TextBlock):
                texts.append(b.text)
            elif isinstance(b, ToolUseBlock) and assistant:
                calls.append({"id": b.id, "type": "function", "function": {
                    "name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}})
            elif isinstance(b, ToolResultBlock) and not assistant:
                content = b.content if isinstance(b.content, str) else \
                    "\n".join(_texts(b.content or [], f"{bp}.content"))
                results.append({"role": "tool", "tool_call_id": b.tool_use_id,
                                "content": f"Error: {content}" if b.is_error else content})
            elif isinstance(b, ThinkingBlock) and assistant:
                thinking = b.thinking
            else:
                kind = b.__struct_config__.tag
                why = "its text is encrypted" if isinstance(b, RedactedThinkingBlock) else f"in a {m.role} message"
                raise FrontendError(f"content block {kind!r} is not supported ({why})", param=bp, code="unsupported")
        out += results
        if m.role == "assistant":
            msg: dict = {"role": "assistant", "content": "".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            if thinking is not None:
                msg["reasoning_content"] = thinking
            out.append(msg)
        elif texts or not results:
            out.append({"role": "user", "content": "\n".join(texts)})
    return out


def message_tool_choice(choice: MessagesToolChoice | None, tools: list[T.Tool]) -> tuple[T.ToolChoice, bool]:
    """(choice, parallel tool calls allowed); ``any`` is OpenAI's ``required``."""
    if choice is None:
        return T.tool_choice(tools, None), True
    parallel = not choice.disable_parallel_tool_use
    if choice.type == "tool":
        return T.choose(tools, "named", choice.name, "tool_choice.name"), parallel
    return T.choose(tools, "required" if choice.type == "any" else choice.type, None, "tool_choice"), parallel


def spec(body: MessagesRequest) -> ChatSpec:
    tools = T.declare(body.tools)
    choice, parallel = message_tool_choice(body.tool_choice, tools)
    return ChatSpec(
        messages=chat_messages(body), sampling=W.sampling(body), max_tokens=body.max_tokens, seed=body.seed,
        stop=W.stop_list(body.stop_sequences), tools=tuple(tools), tool_choice=choice, parallel_tool_calls=parallel,
        template_kwargs={} if body.thinking is None else {"enable_thinking": body.thinking.type == "enabled"},
        answer=W.answer_format(body.output_config and body.output_config.format, "output_config.format"),
    )


# ---------------------------------------------------------------------------
# output blocks


class _Blocks:
    """Content blocks from parsed events; ``feed`` returns stream events."""

    def __init__(self):
        self.blocks: list[dict] = []
        self._open: dict | None = None
        self._json = ""

    def feed(self, events: list[Event]) -> list[dict]:
        out: list[dict] = []
        for e in events:
            if isinstance(e, (Content, Reasoning)):
                if not e.text:
                    continue
                kind = "text" if isinstance(e, Content) else "thinking"
                if self._open is None or self._open["type"] != kind:
                    out += self._close()
                    start = {"type": "text", "text": ""} if kind == "text" else \
                        {"type": "thinking", "thinking": "", "signature": ""}
                    out += self._start(start)
                self._open[kind] += e.text
                delta = {"type": "text_delta", "text": e.text} if kind == "text" else \
                    {"type": "thinking_delta", "thinking": e.text}
                out.append({"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta})
            elif isinstance(e, ToolStart):
                out += self._close()
                out += self._start({"type": "tool_use", "id": e.id, "name": e.name, "input": {}})
                self._json = ""
            elif isinstance(e, ToolArgs) and e.text:
                self._json += e.text
                out.append({"type": "content_block_delta", "index": len(self.blocks) - 1,
                            "delta": {"type": "input_json_delta", "partial_json": e.text}})
            elif isinstance(e, ToolEnd):
                self._open["input"] = json.loads(self._json)  # the parser validated it as an object
                out += self._close()
        return out

    def _start(self, block: dict) -> list[dict]:
        self._open = block
        self.blocks.append(block)
        return [{"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": dict(block)}]

    def _close(self) -> list[dict]:
        if self._open is None:
            return []
        self._open = None
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}]

    def finish(self) -> list[dict]:
        return self._close()


def stop_reason(finish: Finish, blocks: list[dict]) -> str:
    if finish.reason == FinishReason.length:
        return "max_tokens"
    if any(b["type"] == "tool_use" for b in blocks):
        return "tool_use"
    return "stop_sequence" if finish.stop is not None else "end_turn"


class MessagesApi:
    def __init__(self, ctx: Context):
        self.ctx = ctx

    async def create(self, http: HTTPRequest) -> Response:
        ctx = self.ctx
        rid = "msg_" + uuid.uuid4().hex[:24]
        try:
            body = decode_body(await ctx.read_body(http), MessagesRequest)
            ctx.check_model(body.model)
            gen = await pipeline.start(ctx.model, ctx.engine, spec(body), rid, limits=ctx.config.limits,
                                       call_prefix="toolu_")
        except FlareError as e:
            return fail(self.ctx, rid, stage_of(e), e, envelope=anthropic_error)
        if body.stream:
            return StreamingResponse(self._sse(gen), media_type="text/event-stream",
                                     headers={"x-request-id": rid, "cache-control": "no-cache"})
        blocks = _Blocks()
        finish = await unless_disconnected(http, gen.assemble(blocks), gen.cancel)
        if finish is None:
            return Response(status_code=499)
        if finish.error is not None:
            return fail(self.ctx, rid, "execution", finish.error, envelope=anthropic_error)
        return json_response({**self._message(gen, blocks.blocks, finish), "usage": self._usage(gen)}, rid)

    def _message(self, gen: Generation, blocks: list[dict], finish: Finish | None) -> dict:
        return {"id": gen.id, "type": "message", "role": "assistant", "model": self.ctx.model.served_name,
                "content": blocks, "stop_reason": None if finish is None else stop_reason(finish, blocks),
                "stop_sequence": None if finish is None else finish.stop}

    def _usage(self, gen: Generation) -> dict:
        # Anthropic's accounting: input_tokens excludes what was read from the cache.
        cached = gen.cached_tokens
        return {"input_tokens": gen.prompt_tokens - cached, "cache_read_input_tokens": cached,
                "output_tokens": gen.completion_tokens}

    async def _sse(self, gen: Generation) -> AsyncIterator[bytes]:
        blocks = _Blocks()

        completed = False
        try:
            start = {**self._message(gen, [], None), "usage": {"input_tokens": gen.prompt_tokens, "output_tokens": 0}}
            yield event_frame({"type": "message_start", "message": start})
            finish = None
            async for u in gen.updates():
                if u.finish is not None and u.finish.error is not None:
                    self.ctx.report_failure(gen.id, "streaming", u.finish.error)
                    yield event_frame(anthropic_error(u.finish.error))
                    return
                for e in blocks.feed(u.events):
                    yield event_frame(e)
                finish = u.finish or finish
            for e in blocks.finish():
                yield event_frame(e)
            yield event_frame({"type": "message_delta",
                       "delta": {"stop_reason": stop_reason(finish, blocks.blocks), "stop_sequence": finish.stop},
                       "usage": self._usage(gen)})
            yield event_frame({"type": "message_stop"})
            completed = True
        finally:
            if not completed:
                gen.cancel()
