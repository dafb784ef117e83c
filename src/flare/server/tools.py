"""Tool definitions and ``tool_choice``, normalised from every protocol (docs/agent-api.md,
"Tools and tool_choice").

* ``none``: the tools are not rendered into the prompt and no output is parsed as a call.
* ``auto``: the tools are rendered; the model may answer or call.
* ``required``: the tools are rendered plus an instruction to call one; an output
  without a completed call to a declared tool fails the response.
* named: only that tool is rendered (no instruction, no decoding constraint); the
  output must call it and only it, and its answer text is not presented.

Strict function schemas are refused: Flare does not constrain tool arguments to
the schema unless the request also carries an output grammar.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Any

from flare.core.errors import FrontendError

NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
REQUIRED_INSTRUCTION = "In this reply you must call at least one of the available tools."


class ChoiceMode(str, enum.Enum):
    none = "none"
    auto = "auto"
    required = "required"
    named = "named"


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict | None

    def template_entry(self) -> dict:
        """The OpenAI chat shape that chat templates expect in ``tools``."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        if self.parameters is not None:
            fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolChoice:
    mode: ChoiceMode
    name: str | None = None


AUTO = ToolChoice(ChoiceMode.auto)
NONE = ToolChoice(ChoiceMode.none)


def make_tool(name: Any, description: Any, parameters: Any, strict: Any, param: str) -> Tool:
    if not isinstance(name, str) or not NAME.match(name):
        raise FrontendError("tool names must be 1-64 characters of letters, digits, '_', '.' or '-'",
                            param=f"{param}.name")
    if description is not None and not isinstance(description, str):
        raise FrontendError("a tool description must be a string", param=f"{param}.description")
    if parameters is not None and not isinstance(parameters, dict):
        raise FrontendError("tool parameters must be a JSON schema object", param=f"{param}.parameters")
    if strict:
        raise FrontendError("strict function schemas are not supported: Flare does not constrain tool "
                            "arguments to their schema (set strict to false, or omit it)",
                            param=f"{param}.strict", code="unsupported")
    return Tool(name, description, parameters)


def declare(definitions, param: str = "tools") -> list[Tool]:
    """The tools a request declares, from any protocol's definitions (each knows its
    ``tool(param)``); a name declared twice is refused."""
    tools = [d.tool(f"{param}[{i}]") for i, d in enumerate(definitions or ())]
    check_unique(tools, param)
    return tools


def check_unique(tools: list[Tool], param: str) -> None:
    seen = set()
    for i, t in enumerate(tools):
        if t.name in seen:
            raise FrontendError(f"tool {t.name!r} is declared twice", param=f"{param}[{i}].name")
        seen.add(t.name)


def choose(tools: list[Tool], mode: str, name: str | None, param: str) -> ToolChoice:
    if mode == "named":
        if name not in {t.name for t in tools}:
            raise FrontendError(f"tool_choice names {name!r}, which is not among the declared tools", param=param)
        return ToolChoice(ChoiceMode.named, name)
    choice = ToolChoice(ChoiceMode(mode))
    if choice.mode == ChoiceMode.required and not tools:
        raise FrontendError("tool_choice requires a tool call but no tools are declared", param=param)
    return choice


def tool_choice(tools: list[Tool], value, param: str = "tool_choice") -> ToolChoice:
    """``value``: None (auto when tools are declared, else none), a mode name, or a
    named choice (anything with ``.name``)."""
    if value is None:
        return AUTO if tools else NONE
    if isinstance(value, str):
        return choose(tools, value, None, param)
    return choose(tools, "named", value.name, param)


def offered(tools: list[Tool], choice: ToolChoice) -> list[Tool]:
    """The tools the template renders and the output may call."""
    if choice.mode == ChoiceMode.none:
        return []
    if choice.mode == ChoiceMode.named:
        return [t for t in tools if t.name == choice.name]
    return list(tools)


def with_instruction(messages: list[dict]) -> list[dict]:
    """``required``: the instruction joins the leading system message, or becomes one."""
    if messages and messages[0].get("role") in ("system", "developer") and isinstance(messages[0].get("content"),
                                                                                        str):
        first = dict(messages[0])
        first["content"] = f"{first['content']}\n\n{REQUIRED_INSTRUCTION}" if first["content"] else \
            REQUIRED_INSTRUCTION
        return [first, *messages[1:]]
    return [{"role": "system", "content": REQUIRED_INSTRUCTION}, *messages]
