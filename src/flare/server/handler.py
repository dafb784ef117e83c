"""The handler every generation endpoint shares; each protocol plugs in its body type
and its ``Presenter``.

    read the body (bounded) -> decode (typed) -> check the model -> start the generation
      stream:     opening events, each update's events, closing events
                  (a choice that fails: its failure events end the stream)
      not stream: the same updates collected, then the protocol's response body

A failure before the response starts is an HTTP error in the protocol's envelope,
one after SSE headers the protocol's error event. Whenever a response ends early
(the client left, a choice failed) the generation is cancelled.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from contextlib import aclosing
from typing import Any, AsyncIterator

from starlette.requests import Request as HTTPRequest
from starlette.responses import Response, StreamingResponse

from flare.core.errors import FlareError
from flare.server import pipeline
from flare.server.decode import decode_body
from flare.server.http import Context, event_frame, fail, json_response, new_request_id, stage_of, unless_disconnected
from flare.server.parsers import Content, Event, Reasoning, ToolArgs, ToolEnd, ToolStart
from flare.server.pipeline import ChatSpec, Finish, Generation, Update
from flare.server.served_model import ServedModel


class Presenter(ABC):
    """One response in its protocol's shape, fed every update of its generation.
    Events are what ``frame`` turns into SSE bytes (the stream only)."""

    # The opening events report what admission decided (cached tokens): the stream sends
    # them with the first update instead of at once.
    opens_after_admission = False

    def __init__(self, model: ServedModel, body, gen: Generation, created: int):
        self.model, self.request, self.gen, self.created = model, body, gen, created

    def opening(self) -> list[Any]:
        return []

    @abstractmethod
    def update(self, u: Update) -> list[Any]:
        """Events for an update (streaming or not: this is how the body is assembled too)."""

    @abstractmethod
    def closing(self) -> list[Any]:
        """Events after the last update, streaming or not."""

    @abstractmethod
    def failure(self, finish: Finish) -> list[Any]:
        """The events that end a stream whose choice failed (``finish.error``)."""

    @abstractmethod
    def body(self) -> dict:
        """The response of a request that did not stream, after ``closing``."""

    def frame(self, event: Any) -> bytes:
        return event_frame(event)


class OutputParts(ABC):
    """An output as a list of parts (Responses' output items, Messages' content blocks)
    folded from parsed events in arrival order, the same for streaming and not. One part
    is open at a time: answer text and reasoning extend an open part of their kind, a
    tool call opens its own, any other event closes it. The hooks return the stream
    events each step causes; ``index`` is the part's position in ``parts``."""

    def __init__(self):
        self.parts: list[dict] = []
        self._open: dict | None = None
        self._kind = ""
        self._text = ""  # the open part's text or call arguments so far

    @abstractmethod
    def new_part(self, kind: str, start: ToolStart | None) -> dict:
        """A part of ``kind`` "text", "reasoning" or "call" (then ``start`` announces it)."""

    @abstractmethod
    def opened(self, index: int, part: dict) -> list[Any]: ...

    @abstractmethod
    def delta(self, index: int, part: dict, text: str) -> list[Any]: ...

    @abstractmethod
    def closed(self, index: int, part: dict, text: str) -> list[Any]: ...

    def feed(self, events: list[Event]) -> list[Any]:
        out: list[Any] = []
        for e in events:
            if isinstance(e, (Content, Reasoning)):
                if not e.text:
                    continue
                kind = "text" if isinstance(e, Content) else "reasoning"
                if self._open is None or self._kind != kind:
                    out += self.close()
                    out += self._begin(kind, None)
                out += self._extend(e.text)
            elif isinstance(e, ToolStart):
                out += self.close()
                out += self._begin("call", e)
            elif isinstance(e, ToolArgs) and e.text:
                out += self._extend(e.text)
            elif isinstance(e, ToolEnd):  # a call ends here: the parser fails an unfinished one
                out += self.close()
        return out

    def close(self) -> list[Any]:
        part, self._open = self._open, None
        return [] if part is None else self.closed(len(self.parts) - 1, part, self._text)

    def _begin(self, kind: str, start: ToolStart | None) -> list[Any]:
        part = self.new_part(kind, start)
        self.parts.append(part)
        self._open, self._kind, self._text = part, kind, ""
        return self.opened(len(self.parts) - 1, part)

    def _extend(self, text: str) -> list[Any]:
        self._text += text
        return self.delta(len(self.parts) - 1, self._open, text)


class Endpoint:
    """One generation route: its body type, response ids, error envelope, how a body
    starts a generation (``spec``, or ``start`` itself) and how the generation is
    presented (``presenter``, a ``Presenter`` class)."""

    body_type: type
    id_prefix: str
    presenter: type[Presenter]
    call_prefix = "call_"
    # The engine's validation names runtime fields (runtime/scheduler.py): the ones this
    # protocol calls otherwise, by their request field.
    request_fields: dict[str, str] = {}

    def __init__(self, ctx: Context):
        self.ctx = ctx

    def envelope(self, err: FlareError) -> dict:
        return err.envelope()

    def spec(self, body) -> ChatSpec:
        raise NotImplementedError

    async def start(self, body, rid: str) -> Generation:
        ctx = self.ctx
        return await pipeline.start(ctx.model, ctx.engine, self.spec(body), rid, limits=ctx.config.limits,
                                    call_prefix=self.call_prefix)

    async def __call__(self, http: HTTPRequest) -> Response:
        ctx = self.ctx
        rid = new_request_id(self.id_prefix)
        try:
            body = decode_body(await ctx.read_body(http), self.body_type)
            ctx.check_model(body.model)
            with ctx.engine.arriving():  # rendering and tokenizing, in threads, until the submit
                gen = await self.start(body, rid)
        except FlareError as e:
            e.param = self.request_fields.get(e.param, e.param)
            return fail(ctx, rid, stage_of(e), e, envelope=self.envelope)
        shape = self.presenter(ctx.model, body, gen, int(time.time()))
        if body.stream:
            return StreamingResponse(self._stream(gen, shape), media_type="text/event-stream",
                                     headers={"x-request-id": rid, "cache-control": "no-cache"})
        try:
            collected = await unless_disconnected(http, _collect(gen, shape), gen.cancel)
        except FlareError as e:
            return fail(ctx, rid, "execution", e, envelope=self.envelope)
        if collected is None:
            return Response(status_code=499)
        return json_response(shape.body(), rid)

    async def _stream(self, gen: Generation, shape: Presenter) -> AsyncIterator[bytes]:
        opened = not shape.opens_after_admission
        try:
            if opened:
                for e in shape.opening():
                    yield shape.frame(e)
            async with aclosing(gen.updates()) as updates:
                async for u in updates:
                    if not opened:  # the first update comes after admission (or is its failure)
                        opened = True
                        for e in shape.opening():
                            yield shape.frame(e)
                    if u.finish is not None and u.finish.error is not None:
                        self.ctx.report_failure(gen.id, "streaming", u.finish.error)
                        for e in shape.failure(u.finish):
                            yield shape.frame(e)
                        return
                    for e in shape.update(u):
                        yield shape.frame(e)
            if not opened:
                for e in shape.opening():
                    yield shape.frame(e)
            for e in shape.closing():
                yield shape.frame(e)
        finally:
            gen.cancel()  # frees the work if the client left or a choice failed; a no-op once all finished


async def _collect(gen: Generation, shape: Presenter) -> bool:
    """Feed every update to ``shape``; a choice's error is raised (the others cancelled)."""
    try:
        async with aclosing(gen.updates()) as updates:
            async for u in updates:
                if u.finish is not None and u.finish.error is not None:
                    raise u.finish.error
                shape.update(u)
        shape.closing()
        return True
    finally:
        gen.cancel()
