"""OpenAI Responses (``POST /v1/responses``), stateless.

Input items map onto chat messages (``instructions`` first, as a system message;
``function_call`` items become the assistant's tool calls, ``function_call_output``
items tool results, ``reasoning`` items the next assistant turn's reasoning) and
run through the shared pipeline. Output items are built from the parsed events
in arrival order (reasoning, message, function calls) by one ``_Items`` builder,
used by the streaming and the non-streaming paths alike, so both return the same
items. Nothing is stored: ``previous_response_id``, ``store: true`` and
``item_reference`` items are refused.

Stream: ``response.created``, ``response.in_progress``, per item
``output_item.added`` / content or argument deltas / ``output_item.done``, then
``response.completed`` (``response.incomplete`` at max_output_tokens); a failure
after the stream started is ``response.failed`` carrying the typed error.
"""

from __future__ import annotations

import logging
import time
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
from flare.server.protocol_responses import (FunctionCallItem, FunctionCallOutputItem, InputFile, InputImage,
                                             ItemContent, MessageItem, ReasoningItem, ResponsesReasoning,
                                             ResponsesRequest)

log = logging.getLogger("flare.server")


# ---------------------------------------------------------------------------
# request mapping


def _text(content: str | list[ItemContent], param: str) -> str:
    if isinstance(content, str):
        return content
    for j, part in enumerate(content):
        if isinstance(part, (InputImage, InputFile)):
            raise FrontendError(f"content part {part.__struct_config__.tag!r} is not supported by this model's core",
                                param=f"{param}[{j}]", code="unsupported")
    return "\n".join(part.text for part in content)


def input_messages(body: ResponsesRequest) -> list[dict]:
    messages: list[dict] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
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

    for i, item in enumerate(body.items()):
        param = f"input[{i}]"
        if isinstance(item, MessageItem):
            text = _text(item.content, f"{param}.content")
            if item.role == "assistant":
                assistant()["content"] += text
            else:
                messages.append({"role": "system" if item.role == "developer" else item.role, "content": text})
        elif isinstance(item, FunctionCallItem):
            assistant().setdefault("tool_calls", []).append({"id": item.call_id, "type": "function", "function": {
                "name": item.name, "arguments": item.arguments}})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": _text(item.output, f"{param}.output")})
        elif isinstance(item, ReasoningItem):
            reasoning = "\n".join(p.text for p in item.content or item.summary)
        else:
            raise FrontendError("this server is stateless: item_reference is not supported (send the item itself)",
                                param=f"{param}.type", code="unsupported")
    return messages


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
    reasoning = body.reasoning or ResponsesReasoning()
    if reasoning.summary is not None:
        raise FrontendError("reasoning summaries are not supported (reasoning text is returned as reasoning items)",
                            param="reasoning.summary", code="unsupported")
    tools = T.declare(body.tools)
    return ChatSpec(
        messages=input_messages(body), sampling=W.sampling(body), max_tokens=body.max_output_tokens, seed=body.seed,
        stop=W.stop_list(body.stop), tools=tuple(tools), tool_choice=T.tool_choice(tools, body.tool_choice),
        parallel_tool_calls=body.parallel_tool_calls is not False,
        answer=W.answer_format(body.text and body.text.format, "text.format"),
        template_kwargs={**W.thinking_kwargs(reasoning.effort), **(body.chat_template_kwargs or {})},
    )


# ---------------------------------------------------------------------------
# output items


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
            "reasoning": {"effort": body.reasoning and body.reasoning.effort, "summary": None},
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
