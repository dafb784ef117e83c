"""``<tool_call>{json}</tool_call>`` tool calls (manifest enum ``tool_parser = "hermes"``),
as written by Hermes and Qwen templates: one JSON object ``{"name", "arguments"}``
per block, blocks separated by whitespace, optional answer text before them.

Whitespace that only separates text from a call, or calls from each other, is
not content. Anything inside a block that is not one complete call is reported
(``ModelOutputError``), never passed on as content.
"""

from __future__ import annotations

from flare.server.parsers.base import CallAssembler, Content, Event, IdFactory, held_prefix, malformed

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


class HermesParser:
    def __init__(self, new_id: IdFactory):
        self._new_id = new_id
        self._buf = ""
        self._call: CallAssembler | None = None
        self._calls = 0
        self._after_call = False

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        out: list[Event] = []
        while True:
            buf = self._buf
            if self._call is not None:
                i = buf.find(CLOSE)
                if i < 0:
                    keep = held_prefix(buf, CLOSE)
                    out += self._call.feed(buf[: len(buf) - keep])
                    self._buf = buf[len(buf) - keep :]
                    return out
                out += self._call.feed(buf[:i])
                out += self._call.close()
                self._call, self._after_call = None, True
                self._buf = buf[i + len(CLOSE) :]
                continue
            if self._after_call:
                buf = self._buf = buf.lstrip()
            i = buf.find(OPEN)
            if i >= 0:
                text_before = buf[:i].rstrip()
                if text_before:
                    out.append(Content(text_before))
                self._call = CallAssembler(self._calls, self._new_id())
                self._calls += 1
                self._buf = buf[i + len(OPEN) :]
                continue
            # Hold back a possible start of <tool_call> and the whitespace before it.
            keep = held_prefix(buf, OPEN)
            cut = len(buf[: len(buf) - keep].rstrip())
            if cut:
                out.append(Content(buf[:cut]))
                self._after_call = False
            self._buf = buf[cut:]
            return out

    def finish(self) -> list[Event]:
        if self._call is not None:
            raise malformed(f"tool call {self._call.index} was not finished (no {CLOSE})")
        buf, self._buf = self._buf, ""
        if self._after_call:
            buf = buf.strip()
        return [Content(buf)] if buf else []
