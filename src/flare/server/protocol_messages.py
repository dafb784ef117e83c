"""Anthropic Messages request bodies (msgspec): ``POST /v1/messages`` and its content
blocks. Conventions as in ``protocol.py``."""

from __future__ import annotations

from typing import Any, Literal, Union

import msgspec

from flare.server.protocol import Body, CacheControl, FlatJsonSchemaFormat, MessagesTool, SamplingFields


class _Block(Body, kw_only=True, tag_field="type"):
    cache_control: CacheControl | None = None  # accepted, not read: the prefix cache needs no hints


class TextBlock(_Block, tag="text"):
    text: str
    citations: list[dict[str, Any]] | None = None


class ImageBlock(_Block, tag="image"):
    source: dict[str, Any]


class ToolUseBlock(_Block, tag="tool_use"):
    id: str
    name: str
    input: Any = msgspec.field(default_factory=dict)


class ToolResultBlock(_Block, tag="tool_result"):
    tool_use_id: str
    content: str | list[Union[TextBlock, ImageBlock]] | None = None
    is_error: bool | None = None


class ThinkingBlock(Body, tag="thinking", tag_field="type"):
    thinking: str = ""
    signature: str | None = None


class RedactedThinkingBlock(Body, tag="redacted_thinking", tag_field="type"):
    data: str


ContentBlock = Union[TextBlock, ImageBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock, RedactedThinkingBlock]


class MessageParam(Body):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class MessagesToolChoice(Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(Body):
    type: Literal["enabled", "disabled"]
    budget_tokens: int | None = None  # accepted, not enforced: max_tokens bounds the whole output


class OutputConfig(Body):
    format: FlatJsonSchemaFormat | None = None


class MessagesRequest(SamplingFields, kw_only=True):
    model: str
    max_tokens: int
    messages: list[MessageParam]
    system: str | list[TextBlock] | None = None
    tools: list[MessagesTool] | None = None
    tool_choice: MessagesToolChoice | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    metadata: dict | None = None  # {"user_id": ...}: logged, never interpreted
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    # Flare extensions (the sampling fields besides Anthropic's temperature, top_p and
    # top_k come from SamplingFields)
    seed: int | None = None
