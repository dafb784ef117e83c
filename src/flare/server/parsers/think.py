"""``<think>...</think>`` reasoning (manifest enum ``reasoning_parser = "think"``).

Where the output starts is read from the generation header the template appended
(the text ``add_generation_prompt`` adds): a header that leaves ``<think>`` open
starts the output inside reasoning (templates that open it for the model); one
that ends with a closed block (thinking disabled) starts in the answer; otherwise
the output may open a reasoning block at its very start. Content right after
``</think>`` loses its leading whitespace (the separator the model writes).
"""

from __future__ import annotations

import enum

from flare.server.parsers.base import Content, Event, Reasoning, held_prefix

OPEN = "<think>"
CLOSE = "</think>"


class ThinkStart(str, enum.Enum):
    optional = "optional"  # the output may begin with <think>
    inside = "inside"  # the header opened <think>: the output begins in reasoning
    closed = "closed"  # the header closed an empty block: no reasoning


def start_for(header: str) -> ThinkStart:
    if header.rfind(OPEN) > header.rfind(CLOSE):
        return ThinkStart.inside
    if header.rstrip().endswith(CLOSE):
        return ThinkStart.closed
    return ThinkStart.optional


class _S(enum.Enum):
    START = 0
    REASONING = 1
    AFTER = 2  # just closed: dropping the separator
    CONTENT = 3


class ThinkParser:
    def __init__(self, start: ThinkStart):
        self.start = start
        self._s = {ThinkStart.optional: _S.START, ThinkStart.inside: _S.REASONING,
                   ThinkStart.closed: _S.CONTENT}[start]
        self._buf = ""

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        out: list[Event] = []
        while True:
            buf = self._buf
            if self._s == _S.START:
                lead = buf.lstrip()
                if lead.startswith(OPEN):
                    self._buf, self._s = lead[len(OPEN) :], _S.REASONING
                    continue
                if OPEN.startswith(lead):  # whitespace, or a prefix of <think>: undecided
                    return out
                self._s = _S.CONTENT
                continue
            if self._s == _S.REASONING:
                i = buf.find(CLOSE)
                if i >= 0:
                    if i:
                        out.append(Reasoning(buf[:i]))
                    self._buf, self._s = buf[i + len(CLOSE) :], _S.AFTER
                    continue
                keep = held_prefix(buf, CLOSE)
                if len(buf) > keep:
                    out.append(Reasoning(buf[: len(buf) - keep]))
                self._buf = buf[len(buf) - keep :]
                return out
            if self._s == _S.AFTER:
                lead = buf.lstrip()
                if not lead:
                    self._buf = ""
                    return out
                self._buf, self._s = lead, _S.CONTENT
                continue
            if buf:
                out.append(Content(buf))
            self._buf = ""
            return out

    def finish(self) -> list[Event]:
        buf, self._buf = self._buf, ""
        if not buf or self._s == _S.AFTER:
            return []
        # Unterminated reasoning (the output ran out) stays reasoning.
        return [Reasoning(buf)] if self._s == _S.REASONING else [Content(buf)]
