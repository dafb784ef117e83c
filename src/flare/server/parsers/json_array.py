"""Tool calls as one JSON array of ``{"name", "arguments"}`` objects (manifest enum
``tool_parser = "json_array"``): an output whose first non-blank character is
``[`` is a list of calls and nothing else; any other output is answer text.

The array is scanned character by character (strings and escapes tracked) so
each element streams as it is generated and is validated when it closes.
"""

from __future__ import annotations

import enum

from flare.server.parsers.base import CallAssembler, Content, Event, IdFactory, malformed


class _S(enum.Enum):
    START = 0  # nothing but whitespace yet
    TEXT = 1  # an answer: everything is content
    ARRAY = 2  # inside [ ], between elements
    ELEMENT = 3  # inside one element object
    DONE = 4  # after ]


class JsonArrayParser:
    def __init__(self, new_id: IdFactory):
        self._new_id = new_id
        self._s = _S.START
        self._lead = ""  # leading whitespace while undecided
        self._calls = 0
        self._expect_element = True  # ARRAY: an element (or ]) may come next, not a comma
        self._call: CallAssembler | None = None
        self._depth = 0
        self._in_string = False
        self._escape = False

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        i = 0
        while i < len(text):
            if self._s == _S.TEXT:
                out.append(Content(text[i:]))
                return out
            if self._s == _S.START:
                lead = text[i:]
                stripped = lead.lstrip()
                if not stripped:
                    self._lead += lead
                    return out
                if stripped[0] == "[":
                    self._s, i = _S.ARRAY, i + len(lead) - len(stripped) + 1
                else:
                    self._s = _S.TEXT
                    text, i, self._lead = self._lead + lead, 0, ""
                continue
            if self._s == _S.ELEMENT:
                i = self._scan_element(text, i, out)
                continue
            c = text[i]
            i += 1
            if c.isspace():
                continue
            if self._s == _S.DONE:
                raise malformed("text after the tool call array")
            if c == "]" and (self._expect_element is False or self._calls == 0):
                self._s = _S.DONE
            elif c == "," and not self._expect_element:
                self._expect_element = True
            elif c == "{" and self._expect_element:
                self._call = CallAssembler(self._calls, self._new_id())
                self._calls += 1
                self._s, self._depth, self._expect_element = _S.ELEMENT, 1, False
                out += self._call.feed("{")
            else:
                raise malformed(f"unexpected {c!r} in the tool call array")
        return out

    def _scan_element(self, text: str, i: int, out: list[Event]) -> int:
        start = i
        while i < len(text):
            c = text[i]
            i += 1
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif c == "\\":
                    self._escape = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    out += self._call.feed(text[start:i])
                    out += self._call.close()
                    self._call, self._s = None, _S.ARRAY
                    return i
        out += self._call.feed(text[start:i])
        return i

    def finish(self) -> list[Event]:
        if self._s == _S.START:
            return [Content(self._lead)] if self._lead else []
        if self._s in (_S.ARRAY, _S.ELEMENT):
            raise malformed("the tool call array was not finished")
        return []
