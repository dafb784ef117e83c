"""The request pipeline that Chat Completions, Responses and Messages share.

A protocol mapper turns its request body into a ``ChatSpec`` (or, for text
completions, token prompts); ``start`` renders it through the chat template,
tokenizes, compiles the output grammar off the event loop, resolves sampling
and submits one engine request per choice. The returned ``Generation`` yields
``Update``s: parsed events (answer text, reasoning, tool-call deltas) and, last,
a ``Finish`` per choice. Tool-choice rules are enforced here, once, so every
protocol fails the same way (``ModelOutputError``).
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from flare.core.errors import CapacityError, FlareError, FrontendError, ModelOutputError, UnprocessableError
from flare.core.manifest import ReasoningParser, ToolParser
from flare.runtime.engine import Engine
from flare.runtime.request import FinishReason, Request
from flare.server import params as P
from flare.server import tools as T
from flare.server.grammar import AnswerFormat, CompiledGrammar, ToolSpec, compose
from flare.server.message_ends import message_marks, token_endpoints
from flare.server.output import OutputStream
from flare.server.parsers import Content, Event, OutputParser, ThinkStart, ToolEnd, ToolStart
from flare.server.parsers import start_for
from flare.server.served_model import ServedModel


@dataclass(frozen=True)
class ChatSpec:
    """A chat request, protocol-neutral. ``messages`` are OpenAI chat message dicts
    (tool calls with string arguments, tool results as role ``tool``)."""

    messages: list[dict]
    sampling: dict  # temperature, top_k, top_p, min_p, repetition/presence/frequency penalties (None = default)
    max_tokens: int | None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = 1
    tools: tuple[T.Tool, ...] = ()
    tool_choice: T.ToolChoice = T.AUTO
    parallel_tool_calls: bool = True
    answer: AnswerFormat | None = None
    template_kwargs: dict = field(default_factory=dict)
    add_generation_prompt: bool = True
    logprobs: Any = None  # Chat Completions' logprobs (a boolean) and top_logprobs, as sent
    top_logprobs: Any = None


@dataclass
class Finish:
    reason: FinishReason
    stop: str | None = None  # the stop string that matched
    error: FlareError | None = None


@dataclass
class Update:
    index: int
    events: list[Event]
    finish: Finish | None = None
    logprobs: list = field(default_factory=list)  # (token id, TokenLogprobs) of the tokens since the last update
    prompt_logprobs: list | None = None  # echo with log-probabilities: every prompt token's, once


class _Policy:
    """Tool-choice rules applied to one choice's parsed events."""

    def __init__(self, choice: T.ToolChoice, callable_names: set[str], parallel: bool):
        self.choice = choice
        self.names = callable_names
        self.parallel = parallel
        self.completed = 0

    def filter(self, events: list[Event]) -> list[Event]:
        out = []
        for e in events:
            if isinstance(e, ToolStart):
                if e.name not in self.names:
                    raise ModelOutputError(f"the model called {e.name!r}, which is not a declared tool",
                                           code="unknown_tool")
                if e.index > 0 and not self.parallel:
                    raise ModelOutputError("the model made more than one tool call with parallel_tool_calls "
                                           "false", code="too_many_tool_calls")
            elif isinstance(e, ToolEnd):
                self.completed += 1
            elif isinstance(e, Content) and self.choice.mode == T.ChoiceMode.named:
                continue  # a named tool choice presents the call, not answer text
            out.append(e)
        return out

    def check_finish(self) -> None:
        if self.choice.mode in (T.ChoiceMode.required, T.ChoiceMode.named) and not self.completed:
            want = f"a call to {self.choice.name!r}" if self.choice.name else "a tool call"
            raise ModelOutputError(f"tool_choice requires {want}, and the model made none",
                                   code="tool_call_required")


class _Choice:
    def __init__(self, index: int, request: Request, stream: OutputStream, parser: OutputParser | None,
                 policy: _Policy | None):
        self.index = index
        self.request = request
        self.stream = stream
        self.parser = parser
        self.policy = policy

    async def next(self) -> Update:
        chunk = await self.stream.next()
        update = self._update(chunk)
        update.logprobs, update.prompt_logprobs = chunk.logprobs, chunk.prompt_logprobs
        return update

    def _update(self, chunk) -> Update:
        try:
            events = self._parse(chunk.text)
            if chunk.finish_reason is None:
                return Update(self.index, events)
            if chunk.finish_reason == FinishReason.error:
                err = chunk.error if isinstance(chunk.error, FlareError) else FlareError(str(chunk.error))
                return Update(self.index, events, Finish(FinishReason.error, error=err))
            if chunk.finish_reason == FinishReason.cancelled:
                # Not the client's doing (its own departure is never read): the server
                # cancelled the request while draining for shutdown.
                err = CapacityError("the server is shutting down; the request was cancelled",
                                    code="server_shutdown")
                return Update(self.index, events, Finish(FinishReason.error, error=err))
            if self.parser is not None:
                events += self._filter(self.parser.finish())
            if self.policy is not None and chunk.finish_reason != FinishReason.cancelled:
                self.policy.check_finish()
            return Update(self.index, events, Finish(chunk.finish_reason, chunk.stop))
        except ModelOutputError as e:
            return Update(self.index, [], Finish(FinishReason.error, error=e))

    def _parse(self, text: str) -> list[Event]:
        if not text:
            return []
        if self.parser is None:
            return [Content(text)]
        return self._filter(self.parser.feed(text))

    def _filter(self, events: list[Event]) -> list[Event]:
        return self.policy.filter(events) if self.policy is not None else events


class Generation:
    """The engine requests behind one response (one per choice)."""

    def __init__(self, engine: Engine, request_id: str, prompt_tokens: int, n: int = 1):
        self.engine = engine
        self.id = request_id
        self.prompt_tokens = prompt_tokens
        self.n = n  # choices per prompt: choice i continues prompt i // n
        self.choices: list[_Choice] = []

    def cancel(self) -> None:
        for c in self.choices:
            self.engine.cancel(c.request)

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.request.output) for c in self.choices)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache, counted once per prompt like
        ``prompt_tokens``: the least any of the prompt's choices reused."""
        per_prompt: dict[int, int] = {}
        for c in self.choices:
            p = c.index // self.n
            per_prompt[p] = min(per_prompt.get(p, 1 << 62), c.request.cached_tokens)
        return sum(per_prompt.values())

    async def updates(self) -> AsyncIterator[Update]:
        """Updates of every choice as they come; a choice's last update carries its
        finish. A failed choice cancels its own engine request."""
        pending = {asyncio.ensure_future(c.next()): c for c in self.choices}
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for fut in sorted(done, key=lambda f: pending[f].index):
                    c = pending.pop(fut)
                    u = fut.result()
                    if u.finish is None:
                        pending[asyncio.ensure_future(c.next())] = c
                    elif u.finish.error is not None:
                        self.engine.cancel(c.request)
                    yield u
        finally:
            for fut in pending:
                fut.cancel()


def _ids(prefix: str):
    base = uuid.uuid4().hex[:16]
    counter = itertools.count()
    return lambda: f"{prefix}{base}{next(counter):04d}"


# Variables the server passes to every chat template itself.
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})


def _render(model: ServedModel, spec: ChatSpec, messages: list[dict], tools: list[dict] | None,
            bare: bool) -> tuple[str, list[int], tuple[int, ...], str]:
    """The prompt text and tokens, the checkpoint endpoints (token counts where complete
    messages end in this rendering), and, when ``bare``, the rendering without the
    generation prompt."""
    kw = spec.template_kwargs
    text = model.template.render(messages, tools=tools, add_generation_prompt=spec.add_generation_prompt, **kw)
    prompt, offsets = model.codec.encode_with_offsets(text, add_special_tokens=False)
    endpoints = token_endpoints(offsets, message_marks(model.template, messages, text, tools=tools, **kw))
    without = text
    if bare and spec.add_generation_prompt:
        without = model.template.render(messages, tools=tools, add_generation_prompt=False, **kw)
    return text, prompt, endpoints, without


async def start(model: ServedModel, engine: Engine, spec: ChatSpec, request_id: str, *, limits: P.Limits,
                call_prefix: str = "call_") -> Generation:
    """Render, tokenize, compile and submit. Raises FlareError before anything runs."""
    m = model.manifest
    if model.template is None:
        raise UnprocessableError("this core has no chat template; use /v1/completions", param="messages")
    if not spec.messages:
        raise FrontendError("messages must not be empty", param="messages", code="empty_messages")
    if not 1 <= spec.n <= limits.max_n:
        raise FrontendError(f"n must lie in [1, {limits.max_n}]", param="n")
    tools = T.offered(list(spec.tools), spec.tool_choice)
    tool_format = m.frontend.tool_parser
    if tools and (tool_format == ToolParser.none or not model.template.accepts_tools):
        raise FrontendError("this model's core does not support tools (its chat template does not render them "
                            "or it declares no tool-call parser)", param="tools", code="unsupported")
    messages = spec.messages
    if spec.tool_choice.mode == T.ChoiceMode.required:
        messages = T.with_instruction(messages)
    reserved = RESERVED_TEMPLATE_VARIABLES.intersection(spec.template_kwargs)
    if reserved:
        raise FrontendError(f"chat_template_kwargs may not set {sorted(reserved)} (the server sets them)",
                            param="chat_template_kwargs")
    rendered_tools = [t.template_entry() for t in tools] or None
    think = m.frontend.reasoning_parser == ReasoningParser.think
    # Rendering, tokenizing and finding message ends grow with the conversation: off the loop.
    text, prompt, endpoints, bare = await asyncio.to_thread(_render, model, spec, messages, rendered_tools, think)
    think_start = None
    if think:
        think_start = ThinkStart.closed
        if spec.add_generation_prompt:
            think_start = start_for(text[len(bare):] if text.startswith(bare) else text)
    stops = P.stop_strings(spec.stop, limits)
    gen = Generation(engine, request_id, len(prompt), spec.n)
    new_id = _ids(call_prefix)
    # Everything cheap is checked before the grammar compiles: sampling values, and what
    # the scheduler would refuse (context length, stop ids).
    requests = []
    logprobs = P.logprobs_count(m, logprobs=spec.logprobs, top_logprobs=spec.top_logprobs, chat=True)
    for index in range(spec.n):
        seed = None if spec.seed is None else spec.seed + index
        params = P.resolve_sampling(m, prompt_len=len(prompt), fields=spec.sampling, max_tokens=spec.max_tokens,
                                    seed=seed, stop_token_ids=spec.stop_token_ids, ignore_eos=spec.ignore_eos,
                                    limits=limits, logprobs=logprobs)
        stream = OutputStream(model.codec, prompt, stops)
        req = Request(prompt, params, stream, request_id=f"{request_id}-{index}", endpoints=endpoints)
        engine.scheduler.validate(req)
        requests.append(req)
    compiled: CompiledGrammar | None = None
    if spec.answer is not None:
        if spec.ignore_eos:
            raise FrontendError("ignore_eos cannot be combined with an output grammar (the grammar ends the "
                                "output with EOS)", param="ignore_eos")
        # Composing walks and serialises every schema: off the event loop as well.
        grammar = await asyncio.to_thread(compose, spec.answer, think_start=think_start,
                                          tools=[ToolSpec(t.name, t.parameters) for t in tools] or None,
                                          tool_format=tool_format, parallel=spec.parallel_tool_calls,
                                          marker=model.marker)
        compiled = await model.grammars.compile(grammar, param=spec.answer.param)
    try:
        for index, req in enumerate(requests):
            parser = None
            if tools or think_start is not None:
                parser = OutputParser(m.frontend.reasoning_parser, tool_format if tools else None,
                                      think_start=think_start or ThinkStart.closed, new_id=new_id)
            policy = _Policy(spec.tool_choice, {t.name for t in tools}, spec.parallel_tool_calls) if tools else None
            req.grammar = compiled.new() if compiled else None
            _submit(gen, index, req, parser, policy)
    except FlareError:
        gen.cancel()
        raise
    return gen


def submit(gen: Generation, index: int, prompt: list[int], params, stream: OutputStream, *,
           score_prompt: bool = False) -> None:
    """A plain text choice (text completions): no template, parser or grammar."""
    _submit(gen, index, Request(prompt, params, stream, request_id=f"{gen.id}-{index}", score_prompt=score_prompt))


def _submit(gen: Generation, index: int, req: Request, parser: OutputParser | None = None,
            policy: _Policy | None = None) -> None:
    req.sink.request = req
    gen.engine.submit(req)
    gen.choices.append(_Choice(index, req, req.sink, parser, policy))
