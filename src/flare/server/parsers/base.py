"""What the output parsers produce, and the tool-call assembler they share.

Parsers are incremental: ``feed`` takes the next piece of decoded output text and
returns events; ``finish`` flushes what is held back and raises
``ModelOutputError`` for a call that is malformed or unfinished. Events are
deltas: the concatenation of a run of ``Content`` (or ``Reasoning``, or one
call's ``ToolArgs``) texts is the whole field, however the text was split.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Callable, Union

from flare.core.errors import ModelOutputError


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class Reasoning:
    text: str


@dataclass(frozen=True)
class ToolStart:
    index: int  # position of the call in this output
    id: str
    name: str


@dataclass(frozen=True)
class ToolArgs:
    index: int
    text: str  # a fragment of the arguments' JSON text


@dataclass(frozen=True)
class ToolEnd:
    index: int  # the call is complete; its arguments parsed as a JSON object


Event = Union[Content, Reasoning, ToolStart, ToolArgs, ToolEnd]


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object


@dataclass
class Assembled:
    """A whole output folded from its events (what non-streaming responses carry)."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def add(self, events: list[Event]) -> None:
        for e in events:
            if isinstance(e, Content):
                self.content += e.text
            elif isinstance(e, Reasoning):
                self.reasoning += e.text
            elif isinstance(e, ToolStart):
                self.tool_calls.append(ToolCall(e.id, e.name, ""))
            elif isinstance(e, ToolArgs):
                self.tool_calls[e.index].arguments += e.text


def malformed(message: str) -> ModelOutputError:
    return ModelOutputError(message, code="malformed_tool_call")


def held_prefix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``:
    text that must be held back because the marker may be completing."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


# A call object whose first key is "name" and second "arguments": the name is known as
# soon as this prefix is complete, and the arguments can stream from its end.
_NAME_FIRST = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\S)')


class CallAssembler:
    """One ``{"name": ..., "arguments": {...}}`` object, fed as it is generated.

    While the object is open, argument text streams up to the last character that
    cannot belong to the object's close (trailing whitespace and a final ``}`` are
    held back); at ``close`` the whole object is parsed and validated, and the rest
    of the arguments is emitted. The streamed arguments are the model's own text
    of the ``arguments`` value, so streamed and non-streamed calls are identical.
    A call whose keys come in another order streams whole at ``close``."""

    def __init__(self, index: int, call_id: str):
        self.index = index
        self.id = call_id
        self.raw = ""
        self.name: str | None = None
        self._args_at = -1
        self._sent = 0  # argument characters emitted

    def feed(self, text: str) -> list[Event]:
        self.raw += text
        out: list[Event] = []
        if self.name is None:
            m = _NAME_FIRST.match(self.raw)
            if m is None:
                return out
            try:
                self.name = json.loads(f'"{m.group(1)}"')
            except json.JSONDecodeError as e:
                raise malformed(f"tool call name is not a valid JSON string: {e}") from None
            self._args_at = m.end()
            out.append(ToolStart(self.index, self.id, self.name))
        end = len(self.raw.rstrip())
        if end > self._args_at and self.raw[end - 1] == "}":
            end = len(self.raw[: end - 1].rstrip())
        end = max(end, self._args_at + self._sent)
        if end > self._args_at + self._sent:
            out.append(ToolArgs(self.index, self.raw[self._args_at + self._sent : end]))
            self._sent = end - self._args_at
        return out

    def close(self) -> list[Event]:
        payload = self.raw.strip()
        try:
            obj = json.loads(payload)
        except json.JSONDecodeError as e:
            raise malformed(f"tool call {self.index} is not valid JSON ({e}): {payload[:200]!r}") from None
        if not isinstance(obj, dict) or set(obj) != {"name", "arguments"}:
            raise malformed(f"tool call {self.index} must be an object with exactly the keys \"name\" and "
                            f"\"arguments\": {payload[:200]!r}")
        name, args = obj["name"], obj["arguments"]
        if not isinstance(name, str) or not name:
            raise malformed(f"tool call {self.index} has no function name")
        if not isinstance(args, dict):
            raise malformed(f"tool call {self.index} ({name}): arguments must be a JSON object")
        out: list[Event] = []
        if self.name is None:
            self.name = name
            out.append(ToolStart(self.index, self.id, name))
            text = json.dumps(args, ensure_ascii=False)
        else:
            body = self.raw[self._args_at :].rstrip()
            text = body[:-1].rstrip()  # json.loads succeeded: the object ends with "}"
            # Duplicate keys parse (the last wins) but leave a streamed name or argument
            # text that is not the object's: report them instead of emitting a wrong call.
            try:
                same = name == self.name and json.loads(text) == args
            except json.JSONDecodeError:
                same = False
            if not same:
                raise malformed(f"tool call {self.index} ({name}): repeated keys")
        if self._sent < len(text):
            out.append(ToolArgs(self.index, text[self._sent :]))
            self._sent = len(text)
        out.append(ToolEnd(self.index))
        return out


IdFactory = Callable[[], str]
