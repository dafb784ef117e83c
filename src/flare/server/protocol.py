"""Request bodies (msgspec), typed down to what the server reads: what the three chat
protocols share, and OpenAI Chat Completions and Completions (Responses:
``protocol_responses.py``, Anthropic Messages: ``protocol_messages.py``).

Unknown fields are rejected: a field the server would silently ignore is a
bug report waiting to happen. Known fields that this server does not
implement are accepted only at their neutral value (``check_unsupported`` and
the mappers' checks). Documented fields that mean nothing to a local, stateless
server are accepted and not read: input items' ``id`` and ``status``,
``cache_control`` (the prefix cache needs no hints), thinking ``signature``s.

A field holding a JSON schema is typed ``JsonSchema``: a body nested too deep is
refused naming it (``flare.server.decode``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

import msgspec

from flare.core.errors import FrontendError
from flare.core.sampling_params import SAMPLING_NAMES, SAMPLING_PARAMS
from flare.server import tools as T
from flare.server.grammar import AnswerFormat


class Body(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """A request body or part of one: unknown fields are refused."""


# ---------------------------------------------------------------------------
# shared by Chat Completions, Responses and Messages

JsonSchema = Annotated[dict[str, Any], msgspec.Meta(extra={"json_schema": True})]
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high"]
ToolMode = Literal["none", "auto", "required"]
SAMPLING_FIELDS = SAMPLING_NAMES
# The optional sampling fields every generation body accepts, one per sampling parameter
# (flare.core.sampling_params): None takes the core's default. Bodies subclass it with
# kw_only=True, so their own required fields may follow these optional ones.
SamplingFields = msgspec.defstruct("SamplingFields", [(p.name, p.type | None, None) for p in SAMPLING_PARAMS],
                                   bases=(Body,), module=__name__)


class FunctionDefinition(Body):
    """A function tool: chat's ``tools[i].function``; Responses' ``tools[i]`` itself."""

    name: str
    description: str | None = None
    parameters: JsonSchema | None = None
    strict: bool | None = None

    def tool(self, param: str) -> T.Tool:
        return T.make_tool(self.name, self.description, self.parameters, self.strict, param)


class ChatTool(Body, tag="function", tag_field="type"):
    function: FunctionDefinition

    def tool(self, param: str) -> T.Tool:
        return self.function.tool(f"{param}.function")


class ResponsesTool(FunctionDefinition, tag="function", tag_field="type"):
    """Responses' function tool: the definition's fields beside ``type``."""


class CacheControl(Body):
    type: Literal["ephemeral"]
    ttl: str | None = None


class MessagesTool(Body):
    """Anthropic's client tool (``type`` omitted or ``custom``)."""

    name: str
    input_schema: JsonSchema | None = None
    description: str | None = None
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None
    strict: bool | None = None

    def tool(self, param: str) -> T.Tool:
        return T.make_tool(self.name, self.description, self.input_schema, self.strict, param)


class TextFormat(Body, tag="text", tag_field="type"):
    def answer(self, param: str) -> AnswerFormat | None:
        return None


class JsonObjectFormat(Body, tag="json_object", tag_field="type"):
    def answer(self, param: str) -> AnswerFormat | None:
        return AnswerFormat("json_object", param=param)


class JsonSchemaSpec(Body):
    """A JSON schema answer: chat's ``response_format.json_schema``; beside ``type``, the
    format itself in Responses' ``text.format`` and Messages' ``output_config.format``."""

    schema: JsonSchema
    name: str | None = None
    description: str | None = None
    strict: bool | None = None

    def answer(self, param: str) -> AnswerFormat | None:
        return AnswerFormat("json_schema", self.schema, param=f"{param}.schema")


class JsonSchemaFormat(Body, tag="json_schema", tag_field="type"):
    json_schema: JsonSchemaSpec

    def answer(self, param: str) -> AnswerFormat | None:
        return self.json_schema.answer(f"{param}.json_schema")


class FlatJsonSchemaFormat(JsonSchemaSpec, tag="json_schema", tag_field="type"):
    pass


class RegexFormat(Body, tag="regex", tag_field="type"):  # Flare extension
    regex: str

    def answer(self, param: str) -> AnswerFormat | None:
        return AnswerFormat("regex", self.regex, param=f"{param}.regex")


class GrammarFormat(Body, tag="grammar", tag_field="type"):  # Flare extension: Lark, llguidance dialect
    grammar: str

    def answer(self, param: str) -> AnswerFormat | None:
        return AnswerFormat("grammar", self.grammar, param=f"{param}.grammar")


ResponseFormat = Union[TextFormat, JsonObjectFormat, JsonSchemaFormat, RegexFormat, GrammarFormat]
ResponsesFormat = Union[TextFormat, JsonObjectFormat, FlatJsonSchemaFormat, RegexFormat, GrammarFormat]


def answer_format(fmt: ResponseFormat | ResponsesFormat | None, param: str) -> AnswerFormat | None:
    return None if fmt is None else fmt.answer(param)


def sampling(body) -> dict:
    """The sampling fields a body sets (None: the core's default)."""
    return {k: getattr(body, k) for k in SAMPLING_FIELDS}


def stop_list(stop: str | list[str] | None) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop or [])


def thinking_kwargs(effort: ReasoningEffort | None) -> dict:
    """Reasoning effort -> the ``enable_thinking`` template switch (templates that do not
    read it ignore it)."""
    return {} if effort is None else {"enable_thinking": effort not in ("none", "minimal")}


# ---------------------------------------------------------------------------
# OpenAI Chat Completions and Completions


class TextPart(Body, tag="text", tag_field="type"):
    text: str


class ImagePart(Body, tag="image_url", tag_field="type"):
    image_url: Any


ContentPart = Union[TextPart, ImagePart]


class FunctionCall(Body):
    name: str
    arguments: str


class ToolCall(Body):
    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class Message(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class FunctionName(Body):
    name: str


class ChatNamedChoice(Body, tag="function", tag_field="type"):
    function: FunctionName

    @property
    def name(self) -> str:
        return self.function.name


class StreamOptions(Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(SamplingFields, kw_only=True):
    """Fields shared by chat and text completions. Extensions beyond OpenAI's
    (top_k, min_p, repetition_penalty, stop_token_ids, ignore_eos) follow vLLM."""

    model: str
    max_tokens: int | None = None
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
    tools: list[ChatTool] | None = None
    tool_choice: ToolMode | ChatNamedChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    reasoning_effort: ReasoningEffort | None = None  # none/minimal -> enable_thinking=False for templates that read it
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
    if req.logit_bias:
        raise FrontendError("logit_bias is not supported by this server", param="logit_bias", code="unsupported")
    if isinstance(req, CompletionRequest):
        if req.suffix:
            raise FrontendError("suffix is not supported", param="suffix", code="unsupported")
        if req.best_of not in (None, 1):
            raise FrontendError("best_of is not supported", param="best_of", code="unsupported")
