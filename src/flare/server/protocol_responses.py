"""OpenAI Responses request bodies (msgspec): ``POST /v1/responses`` and its input items.

Conventions as in ``protocol.py``. Items stay JSON objects until ``items()``: one
without "type" is a message (OpenAI's EasyInputMessage), and msgspec's tagged unions
have no default tag.
"""

from __future__ import annotations

from typing import Any, Literal, Union

from flare.server.decode import convert
from flare.server.protocol import (Body, ReasoningEffort, ResponsesFormat, ResponsesTool, SamplingFields, TextPart,
                                   ToolMode)


class InputText(Body, tag="input_text", tag_field="type"):
    text: str


class OutputText(Body, tag="output_text", tag_field="type"):
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class InputImage(Body, tag="input_image", tag_field="type"):
    image_url: str | None = None
    file_id: str | None = None
    detail: str | None = None


class InputFile(Body, tag="input_file", tag_field="type"):
    file_id: str | None = None
    file_data: str | None = None
    file_url: str | None = None
    filename: str | None = None


ItemContent = Union[InputText, OutputText, TextPart, InputImage, InputFile]


class _Item(Body, kw_only=True, tag_field="type"):
    """What an item may carry from an earlier response; not read (nothing is stored)."""

    id: str | None = None
    status: str | None = None


class MessageItem(_Item, tag="message"):
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ItemContent]


class FunctionCallItem(_Item, tag="function_call"):
    call_id: str
    name: str
    arguments: str = "{}"


class FunctionCallOutputItem(_Item, tag="function_call_output"):
    call_id: str
    output: str | list[ItemContent] = ""


class SummaryText(Body, tag="summary_text", tag_field="type"):
    text: str


class ReasoningText(Body, tag="reasoning_text", tag_field="type"):
    text: str


class ReasoningItem(_Item, tag="reasoning"):
    summary: list[SummaryText] = []
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None


class ItemReference(Body, tag="item_reference", tag_field="type"):
    id: str


InputItem = Union[MessageItem, FunctionCallItem, FunctionCallOutputItem, ReasoningItem, ItemReference]


class ResponsesNamedChoice(Body, tag="function", tag_field="type"):
    name: str


class ResponsesText(Body):
    format: ResponsesFormat | None = None


class ResponsesReasoning(Body):
    effort: ReasoningEffort | None = None
    summary: str | None = None  # only null: reasoning is returned as reasoning items, without summaries


class ResponsesRequest(SamplingFields, kw_only=True):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: ToolMode | ResponsesNamedChoice | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    stream: bool = False
    text: ResponsesText | None = None
    reasoning: ResponsesReasoning | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    truncation: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None  # end-user id: logged, never interpreted
    # Flare extensions (as on chat completions; the sampling fields besides OpenAI's
    # temperature and top_p come from SamplingFields)
    seed: int | None = None
    stop: str | list[str] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def items(self) -> list[InputItem]:
        """``input`` as typed items (errors name ``input[i]``'s field); a string is one user message."""
        if isinstance(self.input, str):
            return [MessageItem("user", self.input)]
        return [convert(item if "type" in item else {"type": "message", **item}, InputItem, f"input[{i}]")
                for i, item in enumerate(self.input)]
