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
from typing import Any, AsyncIterator

import msgspec
from starlette.requests import Request as HTTPRequest
from starlette.responses import Response, StreamingResponse

from flare.core.errors import FlareError, FrontendError
from flare.runtime.request import FinishReason
from flare.server import pipeline
from flare.server import tools as T
from flare.server.grammar import AnswerFormat
from flare.server.http import (Context, decode_body, event_frame, fail, json_response, stage_of,
                               unless_disconnected)
from flare.server.parsers import Content, Event, Reasoning, ToolArgs, ToolEnd, ToolStart
from flare.server.pipeline import ChatSpec, Finish, Generation

log = logging.getLogger("flare.server")

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 422: "invalid_request_error", 429: "rate_limit_error",
                503: "overloaded_error"}


class MessagesRequest(msgspec.Struct, forbid_unknown_fields=True):
    model: str
    max_tokens: int
    messages: list[dict]
    system: str | list[dict] | None = None
    tools: list[dict] | None = None
    tool_choice: dict | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    metadata: dict | None = None  # {"user_id": ...}: logged, never interpreted
    thinking: dict | None = None
    output_config: dict | None = None  # {"format": {"type": "json_schema", "schema": {...}}}
    # Flare extensions
    seed: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None


def anthropic_error(err: FlareError) -> dict:
    kind = _ERROR_TYPES.get(err.status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


# ---------------------------------------------------------------------------
# request mapping


def _block_text(block: Any, param: str) -> str:
    if isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("text"), str):
        return block["text"]
    kind = block.get("type") if isinstance(block, dict) else type(block).__name__
    raise FrontendError(f"content block {kind!r} is not supported here", param=param, code="unsupported")


def _result_text(content: Any, param: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(_block_text(b, f"{param}[{j}]") for j, b in enumerate(content))
    raise FrontendError("tool_result content must be a string or text blocks", param=param)


def chat_messages(body: MessagesRequest) -> list[dict]:
    out: list[dict] = []
    if body.system:
        system = body.system if isinstance(body.system, str) else \
            "\n".join(_block_text(b, f"system[{j}]") for j, b in enumerate(body.system))
        out.append({"role": "system", "content": system})
    for i, m in enumerate(body.messages):
        param = f"messages[{i}]"
        role, content = m.get("role"), m.get("content")
        if role not in ("user", "assistant"):
            raise FrontendError(f"message role must be user or assistant, not {role!r}", param=f"{param}.role")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise FrontendError("content must be a string or a list of blocks", param=f"{param}.content")
        texts, calls, results, thinking = [], [], [], None
        for j, b in enumerate(content):
            bp = f"{param}.content[{j}]"
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text":
                texts.append(_block_text(b, bp))
            elif kind == "tool_use" and role == "assistant":
                if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str):
                    raise FrontendError("tool_use blocks need an id and a name", param=bp)
                calls.append({"id": b["id"], "type": "function", "function": {
                    "name": b["name"], "arguments": json.dumps(b.get("input", {}), ensure_ascii=False)}})
            elif kind == "tool_result" and role == "user":
                if not isinstance(b.get("tool_use_id"), str):
                    raise FrontendError("tool_result blocks need a tool_use_id", param=bp)
                text = _result_text(b.get("content"), f"{bp}.content")
                results.append({"role": "tool", "tool_call_id": b["tool_use_id"],
                                "content": f"Error: {text}" if b.get("is_error") else text})
            elif kind == "thinking" and role == "assistant":
                thinking = b.get("thinking", "")
            else:
                raise FrontendError(f"content block {kind!r} is not supported in a {role} message", param=bp,
                                    code="unsupported")
        out += results
        if role == "assistant":
            msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            if thinking is not None:
                msg["reasoning_content"] = thinking
            out.append(msg)
        elif texts or not results:
            out.append({"role": "user", "content": "\n".join(texts)})
    return out


def message_tools(tools: list[dict] | None) -> list[T.Tool]:
    out = []
    for i, t in enumerate(tools or []):
        param = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type", "custom") != "custom":
            raise FrontendError("only client tools (name, description, input_schema) are supported", param=param,
                                code="unsupported")
        unknown = set(t) - {"type", "name", "description", "input_schema", "cache_control", "strict"}
        if unknown:
            raise FrontendError(f"unknown tool fields {sorted(unknown)}", param=param)
        out.append(T.make_tool(t.get("name"), t.get("description"), t.get("input_schema"), t.get("strict"), param))
    T.check_unique(out, "tools")
    return out


def message_tool_choice(value: dict | None, tools: list[T.Tool]) -> tuple[T.ToolChoice, bool]:
    """(choice, parallel tool calls allowed)"""
    if value is None:
        return (T.AUTO if tools else T.NONE), True
    kind = value.get("type")
    parallel = not value.get("disable_parallel_tool_use", False)
    if kind in ("auto", "none"):
        return T.choose(tools, kind, None, "tool_choice"), parallel
    if kind == "any":
        return T.choose(tools, "required", None, "tool_choice"), parallel
    if kind == "tool":
        return T.choose(tools, "named", value.get("name"), "tool_choice.name"), parallel
    raise FrontendError("tool_choice type must be auto, any, tool or none", param="tool_choice.type")


def spec(body: MessagesRequest) -> ChatSpec:
    tools = message_tools(body.tools)
    choice, parallel = message_tool_choice(body.tool_choice, tools)
    kwargs = {}
    if body.thinking is not None:
        kind = body.thinking.get("type")
        if kind not in ("enabled", "disabled"):
            raise FrontendError("thinking type must be enabled or disabled", param="thinking.type")
        kwargs["enable_thinking"] = kind == "enabled"
    answer = None
    if body.output_config is not None:
        if set(body.output_config) - {"format"}:
            raise FrontendError(f"unsupported output_config options {sorted(set(body.output_config) - {'format'})}",
                                param="output_config", code="unsupported")
        fmt = body.output_config.get("format")
        if fmt is not None:
            if fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
                raise FrontendError('output_config.format must be {"type": "json_schema", "schema": {...}}',
                                    param="output_config.format")
            answer = AnswerFormat("json_schema", fmt["schema"], param="output_config.format.schema")
    return ChatSpec(
        messages=chat_messages(body),
        sampling={"temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k, "min_p": body.min_p,
                  "repetition_penalty": body.repetition_penalty, "presence_penalty": body.presence_penalty,
                  "frequency_penalty": body.frequency_penalty},
        max_tokens=body.max_tokens, seed=body.seed, stop=list(body.stop_sequences or []),
        tools=tuple(tools), tool_choice=choice, parallel_tool_calls=parallel, template_kwargs=kwargs, answer=answer,
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
