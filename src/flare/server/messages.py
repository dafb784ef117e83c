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

from flare.core.errors import FlareError, FrontendError
from flare.runtime.request import FinishReason
from flare.server import protocol as W
from flare.server import tools as T
from flare.server.handler import Endpoint, OutputParts, Presenter
from flare.server.parsers import ToolStart
from flare.server.pipeline import ChatSpec, Finish, Generation, Update
from flare.server.protocol_messages import (ImageBlock, MessagesRequest, MessagesToolChoice, RedactedThinkingBlock,
                                           TextBlock, ThinkingBlock, ToolResultBlock, ToolUseBlock)
from flare.server.served_model import ServedModel

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


class _Blocks(OutputParts):
    """Content blocks (thinking, text, tool_use) and their stream events."""

    def new_part(self, kind: str, start: ToolStart | None) -> dict:
        if kind == "call":
            return {"type": "tool_use", "id": start.id, "name": start.name, "input": {}}
        return {"type": "text", "text": ""} if kind == "text" else {"type": "thinking", "thinking": "", "signature": ""}

    def opened(self, index: int, block: dict) -> list[dict]:
        return [{"type": "content_block_start", "index": index, "content_block": dict(block)}]

    def delta(self, index: int, block: dict, text: str) -> list[dict]:
        kind = block["type"]
        if kind == "tool_use":
            delta = {"type": "input_json_delta", "partial_json": text}
        else:
            block[kind] += text
            delta = {"type": f"{kind}_delta", kind: text}
        return [{"type": "content_block_delta", "index": index, "delta": delta}]

    def closed(self, index: int, block: dict, text: str) -> list[dict]:
        if block["type"] == "tool_use":
            block["input"] = json.loads(text)  # the parser validated it as an object
        return [{"type": "content_block_stop", "index": index}]


def stop_reason(finish: Finish, blocks: list[dict]) -> str:
    if finish.reason == FinishReason.length:
        return "max_tokens"
    if any(b["type"] == "tool_use" for b in blocks):
        return "tool_use"
    return "stop_sequence" if finish.stop is not None else "end_turn"


class _Message(Presenter):
    opens_after_admission = True  # message_start's usage splits cached from uncached input

    def __init__(self, model: ServedModel, body: MessagesRequest, gen: Generation, created: int):
        super().__init__(model, body, gen, created)
        self.blocks = _Blocks()
        self.finish: Finish | None = None

    def _message(self, finish: Finish | None) -> dict:
        blocks = self.blocks.parts
        return {"id": self.gen.id, "type": "message", "role": "assistant", "model": self.model.served_name,
                "content": blocks, "stop_reason": None if finish is None else stop_reason(finish, blocks),
                "stop_sequence": None if finish is None else finish.stop}

    def _usage(self) -> dict:
        # Anthropic's accounting: input_tokens excludes what was read from the cache.
        cached = self.gen.cached_tokens
        return {"input_tokens": self.gen.prompt_tokens - cached, "cache_read_input_tokens": cached,
                "output_tokens": self.gen.completion_tokens}

    def opening(self) -> list:
        start = {**self._message(None), "usage": {**self._usage(), "output_tokens": 0}}
        return [{"type": "message_start", "message": start}]

    def update(self, u: Update) -> list:
        self.finish = u.finish or self.finish
        return self.blocks.feed(u.events)

    def closing(self) -> list:
        return self.blocks.close() + [
            {"type": "message_delta", "delta": {"stop_reason": stop_reason(self.finish, self.blocks.parts),
                                                "stop_sequence": self.finish.stop}, "usage": self._usage()},
            {"type": "message_stop"}]

    def failure(self, finish: Finish) -> list:
        return [anthropic_error(finish.error)]

    def body(self) -> dict:
        return {**self._message(self.finish), "usage": self._usage()}


class Messages(Endpoint):
    body_type, id_prefix, presenter, call_prefix = MessagesRequest, "msg_", _Message, "toolu_"
    request_fields = {"prompt": "messages"}
    spec = staticmethod(spec)

    def envelope(self, err: FlareError) -> dict:
        return anthropic_error(err)
