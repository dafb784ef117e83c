"""OpenAI Responses (``POST /v1/responses``), stateless.

Input items map onto chat messages (``instructions`` first, as a system message;
``function_call`` items become the assistant's tool calls, ``function_call_output``
items tool results, ``reasoning`` items the next assistant turn's reasoning) and
run through the shared pipeline. Output items are built from the parsed events
in arrival order (reasoning, message, function calls) by one ``_Items`` builder,
used by the streaming and the non-streaming paths alike, so both return the same
items. Nothing is stored: ``previous_response_id`` and ``store: true`` are refused.

Stream: ``response.created``, ``response.in_progress``, per item
``output_item.added`` / content or argument deltas / ``output_item.done``, then
``response.completed`` (``response.incomplete`` at max_output_tokens); a failure
after the stream started is ``response.failed`` carrying the typed error.
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
from flare.server import pipeline
from flare.server import tools as T
from flare.server.chat import SAMPLING_FIELDS, answer_format, thinking_kwargs
from flare.server.http import (Context, decode_body, event_frame, fail, json_response, stage_of,
                               unless_disconnected)
from flare.server.parsers import Content, Event, Reasoning, ToolArgs, ToolEnd, ToolStart
from flare.server.pipeline import ChatSpec, Finish, Generation

log = logging.getLogger("flare.server")


class ResponsesRequest(msgspec.Struct, forbid_unknown_fields=True):
    model: str
    input: str | list[dict]
    instructions: str | None = None
    tools: list[dict] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    text: dict | None = None
    reasoning: dict | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    include: list[str] | None = None
    truncation: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None  # end-user id: logged, never interpreted
    # Flare extensions (as on chat completions)
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stop: str | list[str] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


# ---------------------------------------------------------------------------
# request mapping


def _text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise FrontendError("content must be a string or a list of text parts", param=param)
    out = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise FrontendError(f"content part {kind!r} is not supported by this model's core",
                                param=f"{param}[{j}]", code="unsupported")
        out.append(part.get("text", ""))
    return "\n".join(out)


def input_messages(body: ResponsesRequest) -> list[dict]:
    messages: list[dict] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        return messages + [{"role": "user", "content": body.input}]
    reasoning: str | None = None

    def assistant() -> dict:
        nonlocal reasoning
        last = messages[-1] if messages else None
        if last is None or last["role"] != "assistant" or reasoning is not None:
            last = {"role": "assistant", "content": ""}
            if reasoning is not None:
                last["reasoning_content"] = reasoning
                reasoning = None
            messages.append(last)
        return last

    for i, item in enumerate(body.input):
        param = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise FrontendError(f"unknown message role {role!r}", param=f"{param}.role")
            text = _text(item.get("content"), f"{param}.content")
            if role == "assistant":
                msg = assistant()
                msg["content"] += text
            else:
                messages.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            if not isinstance(item.get("call_id"), str) or not isinstance(item.get("name"), str):
                raise FrontendError("function_call items need call_id and name", param=param)
            msg = assistant()
            msg.setdefault("tool_calls", []).append({"id": item["call_id"], "type": "function", "function": {
                "name": item["name"], "arguments": item.get("arguments", "{}")}})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise FrontendError("function_call_output items need a call_id", param=param)
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _text(item.get("output", ""), f"{param}.output")})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            reasoning = "\n".join(p.get("text", "") for p in parts if isinstance(p, dict))
        else:
            raise FrontendError(f"input item type {kind!r} is not supported", param=f"{param}.type",
                                code="unsupported")
    return messages


def response_tools(tools: list[dict] | None) -> list[T.Tool]:
    out = []
    for i, t in enumerate(tools or []):
        param = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise FrontendError(f"tool type {kind!r} is not supported (only function tools)", param=f"{param}.type",
                                code="unsupported")
        unknown = set(t) - {"type", "name", "description", "parameters", "strict"}
        if unknown:
            raise FrontendError(f"unknown tool fields {sorted(unknown)}", param=param)
        out.append(T.make_tool(t.get("name"), t.get("description"), t.get("parameters"), t.get("strict"), param))
    T.check_unique(out, "tools")
    return out


def response_tool_choice(value: Any, tools: list[T.Tool]) -> T.ToolChoice:
    if value is None:
        return T.AUTO if tools else T.NONE
    if value in ("none", "auto", "required"):
        return T.choose(tools, value, None, "tool_choice")
    if isinstance(value, dict) and value.get("type") == "function":
        return T.choose(tools, "named", value.get("name"), "tool_choice")
    raise FrontendError('tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}',
                        param="tool_choice")


def _format(body: ResponsesRequest):
    fmt = (body.text or {}).get("format")
    if fmt is None:
        return None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise FrontendError("json_schema needs a schema object", param="text.format.schema")
        return answer_format({"type": "json_schema", "json_schema": fmt}, "text.format")
    return answer_format(fmt, "text.format")


def spec(body: ResponsesRequest) -> ChatSpec:
    if body.previous_response_id is not None:
        raise FrontendError("this server is stateless: previous_response_id is not supported (send the whole "
                            "conversation as input)", param="previous_response_id", code="unsupported")
    if body.store:
        raise FrontendError("this server is stateless: store must be false or omitted", param="store",
                            code="unsupported")
    if body.include:
        raise FrontendError("include is not supported", param="include", code="unsupported")
    if body.truncation not in (None, "disabled"):
        raise FrontendError("only truncation \"disabled\" is supported", param="truncation", code="unsupported")
    if body.text and set(body.text) - {"format"}:
        raise FrontendError(f"unsupported text options {sorted(set(body.text) - {'format'})}", param="text",
                            code="unsupported")
    reasoning = body.reasoning or {}
    if set(reasoning) - {"effort", "summary"} or reasoning.get("summary") is not None:
        raise FrontendError("only reasoning.effort is supported (reasoning text is returned as reasoning items, "
                            "without summaries)", param="reasoning", code="unsupported")
    tools = response_tools(body.tools)
    return ChatSpec(
        messages=input_messages(body),
        sampling={k: getattr(body, k) for k in SAMPLING_FIELDS},
        max_tokens=body.max_output_tokens, seed=body.seed,
        stop=[body.stop] if isinstance(body.stop, str) else list(body.stop or []),
        tools=tuple(tools), tool_choice=response_tool_choice(body.tool_choice, tools),
        parallel_tool_calls=body.parallel_tool_calls is not False,
        answer=_format(body),
        template_kwargs={**thinking_kwargs(reasoning.get("effort")), **(body.chat_template_kwargs or {})},
    )


# ---------------------------------------------------------------------------
# output items


class _Items:
    """Output items from parsed events. ``feed`` returns the stream events for them;
    ``items`` is the finished list. One open item at a time: an event of another
    kind closes it."""

    def __init__(self, rid: str):
        self.rid = rid
        self.items: list[dict] = []
        self._open: dict | None = None
        self._text = ""
        self.sequence = 0

    def event(self, kind: str, **fields) -> dict:
        e = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return e

    def _new_id(self, prefix: str) -> str:
        return f"{prefix}_{self.rid[5:]}{len(self.items):03d}"

    def feed(self, events: list[Event]) -> list[dict]:
        out: list[dict] = []
        for e in events:
            if isinstance(e, (Content, Reasoning)):
                if not e.text:
                    continue
                kind = "message" if isinstance(e, Content) else "reasoning"
                if self._open is None or self._open["type"] != kind:
                    out += self._close()
                    out += self._start_text(kind)
                self._text += e.text
                idx = len(self.items) - 1
                if kind == "message":
                    out.append(self.event("response.output_text.delta", item_id=self._open["id"], output_index=idx,
                                          content_index=0, delta=e.text, logprobs=[]))
                else:
                    out.append(self.event("response.reasoning_text.delta", item_id=self._open["id"],
                                          output_index=idx, content_index=0, delta=e.text))
            elif isinstance(e, ToolStart):
                out += self._close()
                item = {"type": "function_call", "id": self._new_id("fc"), "call_id": e.id, "name": e.name,
                        "arguments": "", "status": "in_progress"}
                self._open = item
                self.items.append(item)
                out.append(self.event("response.output_item.added", output_index=len(self.items) - 1,
                                      item=dict(item)))
            elif isinstance(e, ToolArgs) and e.text:
                self._open["arguments"] += e.text
                out.append(self.event("response.function_call_arguments.delta", item_id=self._open["id"],
                                      output_index=len(self.items) - 1, delta=e.text))
            elif isinstance(e, ToolEnd):
                out += self._close()
        return out

    def _start_text(self, kind: str) -> list[dict]:
        if kind == "message":
            item = {"type": "message", "id": self._new_id("msg"), "role": "assistant", "status": "in_progress",
                    "content": []}
            part = {"type": "output_text", "text": "", "annotations": []}
        else:
            item = {"type": "reasoning", "id": self._new_id("rs"), "summary": [], "content": [],
                    "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        self._open, self._text = item, ""
        self.items.append(item)
        idx = len(self.items) - 1
        return [self.event("response.output_item.added", output_index=idx, item=dict(item, content=[])),
                self.event("response.content_part.added", item_id=item["id"], output_index=idx, content_index=0,
                           part=part)]

    def _close(self) -> list[dict]:
        item, self._open = self._open, None
        if item is None:
            return []
        idx = len(self.items) - 1
        item["status"] = "completed"
        out = []
        if item["type"] == "function_call":
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=idx,
                                  name=item["name"], arguments=item["arguments"]))
        else:
            if item["type"] == "message":
                part = {"type": "output_text", "text": self._text, "annotations": []}
                out.append(self.event("response.output_text.done", item_id=item["id"], output_index=idx,
                                      content_index=0, text=self._text, logprobs=[]))
            else:
                part = {"type": "reasoning_text", "text": self._text}
                out.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=idx,
                                      content_index=0, text=self._text))
            item["content"] = [part]
            out.append(self.event("response.content_part.done", item_id=item["id"], output_index=idx,
                                  content_index=0, part=part))
        out.append(self.event("response.output_item.done", output_index=idx, item=dict(item)))
        return out

    def finish(self) -> list[dict]:
        return self._close()


class ResponsesApi:
    def __init__(self, ctx: Context):
        self.ctx = ctx

    async def create(self, http: HTTPRequest) -> Response:
        ctx = self.ctx
        rid = "resp_" + uuid.uuid4().hex[:24]
        try:
            body = decode_body(await ctx.read_body(http), ResponsesRequest)
            ctx.check_model(body.model)
            gen = await pipeline.start(ctx.model, ctx.engine, spec(body), rid, limits=ctx.config.limits)
        except FlareError as e:
            return fail(self.ctx, rid, stage_of(e), e)
        created = int(time.time())
        if body.stream:
            return StreamingResponse(self._sse(body, gen, created), media_type="text/event-stream",
                                     headers={"x-request-id": rid, "cache-control": "no-cache"})
        items = _Items(rid)
        finish = await unless_disconnected(http, gen.assemble(items), gen.cancel)
        if finish is None:
            return Response(status_code=499)
        if finish.error is not None:
            return fail(self.ctx, rid, "execution", finish.error)
        return json_response(self._object(body, gen, created, items.items, finish), rid)

    def _object(self, body: ResponsesRequest, gen: Generation, created: int, output: list[dict],
                finish: Finish | None) -> dict:
        status, incomplete, error = "in_progress", None, None
        if finish is not None:
            if finish.error is not None:
                status = "failed"
                error = {"code": finish.error.code, "message": finish.error.message, "param": finish.error.param,
                         "type": finish.error.type}
            elif finish.reason == FinishReason.length:
                status, incomplete = "incomplete", {"reason": "max_output_tokens"}
            else:
                status = "completed"
        reasoning_tokens = sum(len(self.ctx.model.codec.encode(p["text"], add_special_tokens=False))
                               for it in output if it["type"] == "reasoning" for p in it.get("content", []))
        out_tokens = gen.completion_tokens
        return {
            "id": gen.id, "object": "response", "created_at": created, "status": status, "error": error,
            "incomplete_details": incomplete, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens, "model": self.ctx.model.served_name,
            "output": output, "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": None,
            "reasoning": {"effort": (body.reasoning or {}).get("effort"), "summary": None},
            "store": False, "temperature": body.temperature, "top_p": body.top_p,
            "text": body.text or {"format": {"type": "text"}},
            "tool_choice": body.tool_choice if body.tool_choice is not None else ("auto" if body.tools else "none"),
            "tools": body.tools or [], "truncation": "disabled", "metadata": body.metadata or {}, "user": body.user,
            "usage": None if finish is None else {
                "input_tokens": gen.prompt_tokens, "input_tokens_details": {"cached_tokens": gen.cached_tokens},
                "output_tokens": out_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                "total_tokens": gen.prompt_tokens + out_tokens},
        }

    async def _sse(self, body: ResponsesRequest, gen: Generation, created: int) -> AsyncIterator[bytes]:
        items = _Items(gen.id)

        completed = False
        try:
            snapshot = self._object(body, gen, created, [], None)
            yield event_frame(items.event("response.created", response=snapshot))
            yield event_frame(items.event("response.in_progress", response=snapshot))
            finish = None
            async for u in gen.updates():
                if u.finish is not None and u.finish.error is not None:
                    self.ctx.report_failure(gen.id, "streaming", u.finish.error)
                    failed = self._object(body, gen, created, items.items, u.finish)
                    yield event_frame(items.event("response.failed", response=failed))
                    return
                for e in items.feed(u.events):
                    yield event_frame(e)
                finish = u.finish or finish
            for e in items.finish():
                yield event_frame(e)
            final = self._object(body, gen, created, items.items, finish)
            kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
            yield event_frame(items.event(kind, response=final))
            completed = True
        finally:
            if not completed:
                gen.cancel()
