"""Per-request output delivery from the engine loop to an HTTP handler.

The engine calls ``on_tokens`` / ``on_finish`` synchronously; they only append
to this stream's buffer and set an event, so a slow or absent consumer never
blocks the engine or other requests. The buffer is bounded by the request's
``max_tokens``: the handler drains everything pending at once.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from flare.runtime.request import FinishReason, Request
from flare.server.text import IncrementalDetokenizer, StopMatcher, TextCodec


@dataclass
class Chunk:
    text: str
    finish_reason: FinishReason | None
    error: Exception | None = None
    stop: str | None = None  # the stop string that ended the output (finish_reason stop)
    logprobs: list = field(default_factory=list)  # (token id, interface.TokenLogprobs), requests that asked
    prompt_logprobs: list | None = None  # echo: (token id, TokenLogprobs | None) per prompt token, once


class OutputStream:
    def __init__(self, codec: TextCodec, prompt_ids: list[int], stops: list[str]):
        self.detok = IncrementalDetokenizer(codec, prompt_ids)
        self.stops = StopMatcher(stops)
        self._pieces: list[str] = []
        self._logprobs: list = []
        self._prompt_logprobs: list | None = None
        self._finish: FinishReason | None = None
        self._error: Exception | None = None
        self._event = asyncio.Event()
        self.request: Request | None = None

    # -- RequestSink (engine side) -------------------------------------------

    def on_tokens(self, request: Request, ids: list[int], logprobs: list | None = None) -> bool:
        text, matched = self.stops.feed(self.detok.push(ids))
        if text:
            self._pieces.append(text)
            self._event.set()
        if logprobs:  # delivered as they come, also while their text is held back
            self._logprobs.extend(zip(ids, logprobs))
            self._event.set()
        return matched

    def on_prompt_logprobs(self, request: Request, entries: list) -> None:
        self._prompt_logprobs = entries
        self._event.set()

    def on_finish(self, request: Request) -> None:
        reason = request.finish_reason
        if reason != FinishReason.stop or not self.stops.matched:
            text, matched = self.stops.feed(self.detok.flush())
            tail = text + ("" if matched else self.stops.flush())
            if tail:
                self._pieces.append(tail)
        self._finish = reason
        self._error = request.error
        self._event.set()

    # -- consumer side ---------------------------------------------------------

    async def next(self) -> Chunk:
        """Everything produced since the last call; waits while there is nothing."""
        while not self._pieces and not self._logprobs and self._prompt_logprobs is None and self._finish is None:
            self._event.clear()
            await self._event.wait()
        text = "".join(self._pieces)
        self._pieces.clear()
        logprobs, self._logprobs = self._logprobs, []
        prompt, self._prompt_logprobs = self._prompt_logprobs, None
        return Chunk(text, self._finish, self._error, self.stops.matched_stop if self._finish is not None else None,
                     logprobs, prompt)

    async def collect(self) -> Chunk:
        parts, logprobs, prompt = [], [], None
        while True:
            c = await self.next()
            parts.append(c.text)
            logprobs += c.logprobs
            prompt = c.prompt_logprobs if c.prompt_logprobs is not None else prompt
            if c.finish_reason is not None:
                return Chunk("".join(parts), c.finish_reason, c.error, c.stop, logprobs, prompt)
