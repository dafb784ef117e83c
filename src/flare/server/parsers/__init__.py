"""Output parsers, selected by the core's manifest enums (never by model identity).

``OutputParser`` chains a reasoning parser and a tool-call parser: reasoning is
split off first, and only answer text reaches the tool-call parser, so tool
markup inside reasoning stays reasoning.
"""

from __future__ import annotations

from flare.core.manifest import ReasoningParser, ToolParser
from flare.server.parsers.base import (Assembled, CallAssembler, Content, Event, IdFactory, Reasoning, ToolArgs,
                                       ToolCall, ToolEnd, ToolStart)
from flare.server.parsers.hermes import HermesParser
from flare.server.parsers.json_array import JsonArrayParser
from flare.server.parsers.think import ThinkParser, ThinkStart, start_for

__all__ = ["Assembled", "CallAssembler", "Content", "Event", "OutputParser", "Reasoning", "ThinkStart", "ToolArgs",
           "ToolCall", "ToolEnd", "ToolStart", "start_for"]


class OutputParser:
    def __init__(self, reasoning: ReasoningParser, tools: ToolParser | None, *, think_start: ThinkStart,
                 new_id: IdFactory):
        """``tools`` is None when the request declared no callable tools: the answer
        is then passed through untouched."""
        self._think = ThinkParser(think_start) if reasoning == ReasoningParser.think else None
        self._tools = None
        if tools == ToolParser.hermes:
            self._tools = HermesParser(new_id)
        elif tools == ToolParser.json_array:
            self._tools = JsonArrayParser(new_id)

    def feed(self, text: str) -> list[Event]:
        events = self._think.feed(text) if self._think else [Content(text)]
        return self._route(events)

    def finish(self) -> list[Event]:
        out = self._route(self._think.finish()) if self._think else []
        if self._tools is not None:
            out += self._tools.finish()
        return out

    def _route(self, events: list[Event]) -> list[Event]:
        if self._tools is None:
            return [e for e in events if not (isinstance(e, Content) and not e.text)]
        out: list[Event] = []
        for e in events:
            out += self._tools.feed(e.text) if isinstance(e, Content) else [e]
        return out
