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

from flare.core.errors import FrontendError
from flare.runtime.request import FinishReason
from flare.server import protocol as W
from flare.server import tools as T
from flare.server.chat import Logprobs
from flare.server.handler import Endpoint, OutputParts, Presenter
from flare.server.parsers import ToolStart
from flare.server.pipeline import ChatSpec, Finish, Generation, Update
from flare.server.protocol_responses import (FunctionCallItem, FunctionCallOutputItem, InputFile, InputImage,
                                             ItemContent, MessageItem, ReasoningItem, ResponsesReasoning,
                                             ResponsesRequest)
from flare.server.served_model import ServedModel

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
    unknown = [x for x in body.include or () if x != LOGPROBS_INCLUDE]
    if unknown:
        raise FrontendError(f"include supports only {LOGPROBS_INCLUDE!r}, not {unknown[0]!r}", param="include",
                            code="unsupported")
    logprobs = LOGPROBS_INCLUDE in (body.include or ())
    if body.top_logprobs and not logprobs:
        raise FrontendError(f"top_logprobs needs include {LOGPROBS_INCLUDE!r}", param="top_logprobs")
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
        logprobs=logprobs or None, top_logprobs=body.top_logprobs,
    )


LOGPROBS_INCLUDE = "message.output_text.logprobs"


# ---------------------------------------------------------------------------
# output items


def _text_part(item_type: str, text: str) -> dict:
    if item_type == "message":
        return {"type": "output_text", "text": text, "annotations": []}
    return {"type": "reasoning_text", "text": text}


class _Items(OutputParts):
    """Output items (reasoning, message, function_call) and their stream events, which
    carry sequence numbers."""

    def __init__(self, rid: str):
        super().__init__()
        self.rid = rid
        self.sequence = 0
        self.logprobs: dict[str, list] | None = None  # message item id -> its tokens' entries, when asked

    def event(self, kind: str, **fields) -> dict:
        e = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return e

    def new_part(self, kind: str, start: ToolStart | None) -> dict:
        base = f"{self.rid[5:]}{len(self.parts):03d}"
        if kind == "call":
            return {"type": "function_call", "id": f"fc_{base}", "call_id": start.id, "name": start.name,
                    "arguments": "", "status": "in_progress"}
        if kind == "text":
            return {"type": "message", "id": f"msg_{base}", "role": "assistant", "status": "in_progress",
                    "content": []}
        return {"type": "reasoning", "id": f"rs_{base}", "summary": [], "content": [], "status": "in_progress"}

    def opened(self, index: int, item: dict) -> list[dict]:
        out = [self.event("response.output_item.added", output_index=index, item=dict(item))]
        if item["type"] != "function_call":
            out.append(self.event("response.content_part.added", item_id=item["id"], output_index=index,
                                  content_index=0, part=_text_part(item["type"], "")))
        return out

    def delta(self, index: int, item: dict, text: str) -> list[dict]:
        if item["type"] == "function_call":
            item["arguments"] += text
            return [self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                               delta=text)]
        if item["type"] == "message":
            return [self.event("response.output_text.delta", item_id=item["id"], output_index=index,
                               content_index=0, delta=text, logprobs=[])]
        return [self.event("response.reasoning_text.delta", item_id=item["id"], output_index=index,
                           content_index=0, delta=text)]

    def closed(self, index: int, item: dict, text: str) -> list[dict]:
        item["status"] = "completed"
        if item["type"] == "function_call":
            out = [self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                              name=item["name"], arguments=item["arguments"])]
        else:
            part = _text_part(item["type"], text)
            entries = (self.logprobs or {}).get(item["id"], [])
            if item["type"] == "message" and self.logprobs is not None:
                part["logprobs"] = entries
            item["content"] = [part]
            done = {"logprobs": entries} if item["type"] == "message" else {}
            out = [self.event(f"response.{part['type']}.done", item_id=item["id"], output_index=index,
                              content_index=0, text=text, **done),
                   self.event("response.content_part.done", item_id=item["id"], output_index=index,
                              content_index=0, part=part)]
        return out + [self.event("response.output_item.done", output_index=index, item=dict(item))]


class _Response(Presenter):
    def __init__(self, model: ServedModel, body: ResponsesRequest, gen: Generation, created: int):
        super().__init__(model, body, gen, created)
        self.items = _Items(gen.id)
        self.finish: Finish | None = None
        self.final: dict | None = None
        top = gen.choices[0].request.params.logprobs  # resolved by params.logprobs_count (-1: not asked)
        wanted = top >= 0
        self.logprobs = Logprobs(model.codec, top, chat=True) if wanted else None
        self.items.logprobs = {} if wanted else None
        self.pending: list = []  # tokens whose answer text has not come out yet

    def _object(self, output: list[dict], finish: Finish | None) -> dict:
        body, gen = self.request, self.gen
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
        reasoning_tokens = sum(len(self.model.codec.encode(p["text"], add_special_tokens=False))
                               for it in output if it["type"] == "reasoning" for p in it.get("content", []))
        out_tokens = gen.completion_tokens
        return {
            "id": gen.id, "object": "response", "created_at": self.created, "status": status, "error": error,
            "incomplete_details": incomplete, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens, "model": self.model.served_name,
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

    def opening(self) -> list:
        snapshot = self._object([], None)
        return [self.items.event("response.created", response=snapshot),
                self.items.event("response.in_progress", response=snapshot)]

    def update(self, u: Update) -> list:
        self.finish = u.finish or self.finish
        out = self.items.feed(u.events)
        if self.logprobs is not None:
            self._attach(out, u.logprobs)
        return out

    def _attach(self, events: list[dict], logprobs: list) -> None:
        """Tokens go with the answer text they produced: held until an answer delta comes
        (a token's text may be held back: a split character, a possible stop string or
        parser tag), dropped when reasoning or tool-call text comes first (output_text is
        what carries logprobs). An update mixing both gives its tokens to the answer."""
        self.pending += logprobs
        delta = next((e for e in events if e["type"] == "response.output_text.delta"), None)
        if delta is not None and self.pending:
            entries = self.logprobs.render(self.pending)["content"]
            delta["logprobs"] = entries
            self.items.logprobs.setdefault(delta["item_id"], []).extend(entries)
            self.pending = []
        elif any(e["type"] in ("response.reasoning_text.delta", "response.function_call_arguments.delta")
                 for e in events):
            self.pending = []

    def closing(self) -> list:
        out = self.items.close()
        self.final = self._object(self.items.parts, self.finish)
        kind = "response.incomplete" if self.final["status"] == "incomplete" else "response.completed"
        return out + [self.items.event(kind, response=self.final)]

    def failure(self, finish: Finish) -> list:
        return [self.items.event("response.failed", response=self._object(self.items.parts, finish))]

    def body(self) -> dict:
        return self.final


class Responses(Endpoint):
    body_type, id_prefix, presenter = ResponsesRequest, "resp_", _Response
    # The chat pipeline names the conversation "messages": Responses calls it "input".
    request_fields = {"prompt": "input", "messages": "input", "max_tokens": "max_output_tokens"}
    spec = staticmethod(spec)
