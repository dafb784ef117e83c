"""OpenAI-compatible request bodies (msgspec).

Unknown fields are rejected: a field the server would silently ignore is a
bug report waiting to happen. Known fields that this server does not
implement are accepted only at their neutral value (``check_unsupported``).
"""

from __future__ import annotations

from typing import Any, Literal, Union

import msgspec

from flare.core.errors import FrontendError


class _Body(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    pass


class TextPart(_Body, tag="text", tag_field="type"):
    text: str


class ImagePart(_Body, tag="image_url", tag_field="type"):
    image_url: Any


ContentPart = Union[TextPart, ImagePart]


class FunctionCall(_Body):
    name: str
    arguments: str


class ToolCall(_Body):
    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(_Body):
    """Fields shared by chat and text completions. Extensions beyond OpenAI's
    (top_k, min_p, repetition_penalty, stop_token_ids, ignore_eos) follow vLLM."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    user: str | None = None  # end-user id: logged with the request, never interpreted
    logprobs: Any = None
    top_logprobs: int | None = None
    logit_bias: dict[str, float] | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[Message] = msgspec.field(default_factory=list)
    max_completion_tokens: int | None = None
    tools: list[dict] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict | None = None
    reasoning_effort: str | None = None  # none/minimal -> enable_thinking=False for templates that read it
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True


class CompletionRequest(_Sampling):
    # One of: a string, a token list, a list of strings, a list of token lists. msgspec
    # cannot decode a union of several list types, so the element union is decoded
    # here and the homogeneous shapes are checked in the server (``_prompts``).
    prompt: str | list[int | str | list[int]] = ""
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


def check_unsupported(req: _Sampling) -> None:
    """Fields we know but do not implement yet: accepted only at their neutral value."""
    if req.logprobs not in (None, False) or req.top_logprobs not in (None, 0):
        raise FrontendError("logprobs are not supported by this server", param="logprobs", code="unsupported")
    if req.logit_bias:
        raise FrontendError("logit_bias is not supported by this server", param="logit_bias", code="unsupported")
    if isinstance(req, CompletionRequest):
        if req.echo:
            raise FrontendError("echo is not supported", param="echo", code="unsupported")
        if req.suffix:
            raise FrontendError("suffix is not supported", param="suffix", code="unsupported")
        if req.best_of not in (None, 1):
            raise FrontendError("best_of is not supported", param="best_of", code="unsupported")
