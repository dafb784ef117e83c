"""OpenAI Chat Completions and text Completions: request mapping and responses.

Chat messages carry ``reasoning_content`` next to ``content`` and OpenAI-style
``tool_calls``; streamed chunks carry the same fields as deltas (a call's first
delta has its id, type and name; later ones argument fragments). A failure
before the response starts is an HTTP error with the OpenAI envelope; after SSE
headers, an error event ends the stream without ``[DONE]``.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import msgspec

from flare.core.errors import FlareError, FrontendError
from flare.runtime.request import FinishReason
from flare.server import params as P
from flare.server import pipeline
from flare.server import protocol as W
from flare.server import tools as T
from flare.server.handler import Endpoint, Presenter
from flare.server.http import json_encoder
from flare.server.output import OutputStream
from flare.server.parsers import Assembled, Content, Reasoning, ToolArgs, ToolStart
from flare.server.pipeline import ChatSpec, Finish, Generation, Update
from flare.server.protocol import ChatCompletionRequest, CompletionRequest, ImagePart, check_unsupported
from flare.server.served_model import ServedModel
from flare.server.text import CONTEXT_TOKENS, TextCodec

log = logging.getLogger("flare.server")


# ---------------------------------------------------------------------------
# request mapping


def _message_dicts(req: ChatCompletionRequest) -> list[dict]:
    out = []
    for i, m in enumerate(req.messages):
        d = msgspec.to_builtins(m)
        if isinstance(m.content, list):
            if any(isinstance(p, ImagePart) for p in m.content):
                raise FrontendError("image inputs are not supported by this model's core", param=f"messages[{i}]",
                                    code="unsupported")
            d["content"] = "\n".join(p.text for p in m.content)
        if m.role == "assistant" and m.tool_calls and m.content is None:
            d["content"] = ""  # a turn that only called tools has no text (templates concatenate content)
        out.append(d)
    return out


def chat_spec(body: ChatCompletionRequest) -> ChatSpec:
    check_unsupported(body)
    tools = T.declare(body.tools)
    return ChatSpec(
        messages=_message_dicts(body), sampling=W.sampling(body),
        max_tokens=body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens,
        seed=body.seed, stop=W.stop_list(body.stop), stop_token_ids=body.stop_token_ids, ignore_eos=body.ignore_eos,
        n=body.n, tools=tuple(tools), tool_choice=T.tool_choice(tools, body.tool_choice),
        parallel_tool_calls=body.parallel_tool_calls is not False,
        answer=W.answer_format(body.response_format, "response_format"),
        template_kwargs={**W.thinking_kwargs(body.reasoning_effort), **(body.chat_template_kwargs or {})},
        add_generation_prompt=body.add_generation_prompt, logprobs=body.logprobs, top_logprobs=body.top_logprobs,
    )


def _is_ids(x) -> bool:
    # One C-level pass over the element types (type(True) is bool, so bools are refused).
    return isinstance(x, list) and set(map(type, x)) <= {int}


def _prompts(prompt, codec: TextCodec) -> list[list[int]]:
    if isinstance(prompt, str):
        prompts = [codec.encode(prompt, add_special_tokens=True)]
    elif prompt and _is_ids(prompt):
        prompts = [list(prompt)]
    elif prompt and all(isinstance(p, str) for p in prompt):
        prompts = [codec.encode(p, add_special_tokens=True) for p in prompt]
    elif prompt and all(_is_ids(p) for p in prompt):
        prompts = [list(p) for p in prompt]
    else:
        raise FrontendError("prompt must be a non-empty string, token list, or list of them", param="prompt",
                            code="empty_prompt")
    if any(not p for p in prompts):
        raise FrontendError("prompt must not be empty", param="prompt", code="empty_prompt")
    return prompts


# ---------------------------------------------------------------------------
# responses


def finish_reason(r: FinishReason | None, tool_calls: bool = False) -> str | None:
    if r is None:
        return None
    if r == FinishReason.length:
        return "length"
    return "tool_calls" if tool_calls else "stop"


def usage(gen: Generation) -> dict:
    return {"prompt_tokens": gen.prompt_tokens, "completion_tokens": gen.completion_tokens,
            "total_tokens": gen.prompt_tokens + gen.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": gen.cached_tokens}}


def _message(o: Assembled, reasoning: bool) -> dict:
    msg: dict[str, Any] = {"role": "assistant", "content": o.content if (o.content or not o.tool_calls) else None}
    if reasoning:
        msg["reasoning_content"] = o.reasoning or None
    if o.tool_calls:
        msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                             for c in o.tool_calls]
    return msg


_DONE = object()  # the stream's last event, ``data: [DONE]``
FLOOR_LOGPROB = -9999.0  # what a non-finite log-probability reads as (JSON has no -inf; vLLM's value)


def _lp(value: float) -> float:
    return value if math.isfinite(value) else FLOOR_LOGPROB


class Logprobs:
    """One choice's log-probabilities in OpenAI's shapes: Chat Completions'
    ``{"content": [{token, logprob, bytes, top_logprobs}]}`` and the legacy Completions'
    ``{tokens, token_logprobs, top_logprobs, text_offset}`` (top_logprobs there maps the
    alternatives' text, the sampled token's included, to their values)."""

    def __init__(self, codec: TextCodec, top: int, chat: bool, prompt: list[int] = ()):
        self.codec, self.top, self.chat = codec, top, chat
        # Legacy text_offset: where each token's text starts in the choice's text, the
        # decoded text grown token by token (the last few ids as context: the prompt's at
        # first, so that a leading-space rule sees what the detokenizer saw).
        self.offset, self.context = 0, list(prompt)[-(CONTEXT_TOKENS - 1):] if prompt else []

    def _token(self, token_id: int, logprob: float) -> dict:
        b = self.codec.token_bytes(token_id)
        return {"token": b.decode("utf-8", errors="replace"), "logprob": _lp(logprob), "bytes": list(b)}

    def render(self, pairs: list) -> dict:
        top = self.top
        if self.chat:
            return {"content": [{**self._token(t, lp.logprob),
                                 "top_logprobs": [self._token(i, v) for i, v in
                                                  zip(lp.top_ids[:top], lp.top_logprobs[:top])]}
                                for t, lp in pairs], "refusal": None}
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t, lp in pairs:
            text = self.codec.token_text(t)
            out["tokens"].append(text)
            out["text_offset"].append(self.offset)
            self.offset += self.codec.text_growth(self.context, t)
            self.context = [*self.context[-(CONTEXT_TOKENS - 1):], t]
            if lp is None:  # a prompt's first token: nothing predicts it
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(_lp(lp.logprob))
            alts = {self.codec.token_text(i): _lp(v) for i, v in zip(lp.top_ids[:top], lp.top_logprobs[:top])}
            alts.setdefault(text, _lp(lp.logprob))
            out["top_logprobs"].append(alts)
        return out

    def echo(self, prompt: list, text: str, offsets: list[int] | None) -> dict:
        """The prompt's entries (at ``offsets`` in ``text`` when the prompt was that text);
        the output's offsets then continue after the echoed text."""
        out = self.render(prompt)
        if offsets is not None:
            out["text_offset"] = offsets[: len(prompt)]
        self.offset = len(text)
        return out


class _Choices(Presenter):
    """A chat or text completion's choices: chunks as they come, the whole at the end."""

    chat = True

    def __init__(self, model: ServedModel, body: ChatCompletionRequest | CompletionRequest, gen: Generation,
                 created: int):
        super().__init__(model, body, gen, created)
        self.reasoning = self.chat and model.manifest.frontend.reasoning_parser.value != "none"
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        self.outputs = {c.index: Assembled() for c in gen.choices}
        self.finishes: dict[int, Finish] = {}
        self.called: set[int] = set()
        # Text completions with echo: the prompt's text (and entries) lead each choice.
        self.echo = {} if self.chat or not body.echo else {
            c.index: _echo_text(body, model.codec, c.index) for c in gen.choices}  # (text, offsets or None)
        # Without echo the offsets grow from the prompt's last tokens (with echo, from its start).
        self.contexts = {c.index: [] if self.echo else c.request.prompt for c in gen.choices}
        # Alternatives per token: each request's resolved count (params.logprobs_count; -1: none).
        self.logprobs = {c.index: Logprobs(model.codec, c.request.params.logprobs, self.chat, self.contexts[c.index])
                         for c in gen.choices if c.request.params.logprobs >= 0} or None
        self.logprob_pairs: dict[int, list] = {c.index: [] for c in gen.choices}
        self.prompt_pairs: dict[int, list] = {}

    def _chunk(self, choices: list, usage_=None) -> dict:
        payload = {"id": self.gen.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                   "created": self.created, "model": self.model.served_name, "choices": choices}
        if self.include_usage:
            payload["usage"] = usage_
        return payload

    def _choice(self, index: int, delta: dict | None = None, text: str = "", finish: str | None = None) -> dict:
        if self.chat:
            return {"index": index, "delta": delta or {}, "logprobs": None, "finish_reason": finish}
        return {"index": index, "text": text, "logprobs": None, "finish_reason": finish}

    def opening(self) -> list:
        if not self.chat:
            return []
        return [self._chunk([self._choice(c.index, {"role": "assistant", "content": ""}) for c in self.gen.choices])]

    def update(self, u: Update) -> list:
        self.outputs[u.index].add(u.events)
        out = self._events(u)
        lead = self._echo(u)
        if self.logprobs is not None and u.logprobs:
            self.logprob_pairs[u.index] += u.logprobs
            rendered = self.logprobs[u.index].render(u.logprobs)
            # On the first chunk of this update, or on one of their own before the finish.
            if out and not out[0]["choices"][0]["finish_reason"]:
                out[0]["choices"][0]["logprobs"] = rendered
            else:
                lone = self._chunk([self._choice(u.index)])
                lone["choices"][0]["logprobs"] = rendered
                out.insert(0, lone)
        return lead + out

    def _echo(self, u: Update) -> list:
        """The echoed prompt, once per choice, before its first output: with its entries
        when log-probabilities were asked (they come with the update that ends scoring)."""
        if u.index not in self.echo or u.index in self.prompt_pairs:
            return []
        if self.logprobs is not None and u.prompt_logprobs is None and u.finish is None:
            return []  # still scoring
        self.prompt_pairs[u.index] = u.prompt_logprobs or []
        chunk = self._chunk([self._choice(u.index, text=self.echo[u.index][0])])
        if self.logprobs is not None:
            chunk["choices"][0]["logprobs"] = self.logprobs[u.index].echo(self.prompt_pairs[u.index],
                                                                          *self.echo[u.index])
        return [chunk]

    def _events(self, u: Update) -> list:
        out = []
        for e in u.events:
            if isinstance(e, Content) and e.text:
                out.append(self._chunk([self._choice(u.index, {"content": e.text}, e.text)]))
            elif isinstance(e, Reasoning) and e.text and self.chat:
                out.append(self._chunk([self._choice(u.index, {"reasoning_content": e.text})]))
            elif isinstance(e, ToolStart):
                self.called.add(u.index)
                out.append(self._chunk([self._choice(u.index, {"tool_calls": [{
                    "index": e.index, "id": e.id, "type": "function",
                    "function": {"name": e.name, "arguments": ""}}]})]))
            elif isinstance(e, ToolArgs) and e.text:
                out.append(self._chunk([self._choice(u.index, {"tool_calls": [{
                    "index": e.index, "function": {"arguments": e.text}}]})]))
        if u.finish is not None:
            self.finishes[u.index] = u.finish
            out.append(self._chunk([self._choice(u.index, finish=finish_reason(u.finish.reason,
                                                                              u.index in self.called))]))
        return out

    def closing(self) -> list:
        return ([self._chunk([], usage(self.gen))] if self.include_usage else []) + [_DONE]

    def failure(self, finish: Finish) -> list:
        return [finish.error.envelope()]

    def body(self) -> dict:
        choices = []
        for i in sorted(self.outputs):
            o, reason = self.outputs[i], self.finishes[i].reason
            logprobs = None
            if self.logprobs is not None:
                lp = Logprobs(self.model.codec, self.logprobs[i].top, self.chat, self.contexts[i])
                if i in self.echo:
                    head = lp.echo(self.prompt_pairs.get(i, []), *self.echo[i])
                    logprobs = {k: head[k] + v for k, v in lp.render(self.logprob_pairs[i]).items()}
                else:
                    logprobs = lp.render(self.logprob_pairs[i])
            if self.chat:
                choices.append({"index": i, "message": _message(o, self.reasoning), "logprobs": logprobs,
                                "finish_reason": finish_reason(reason, bool(o.tool_calls))})
            else:
                choices.append({"index": i, "text": self.echo[i][0] + o.content if i in self.echo else o.content,
                                "logprobs": logprobs,
                                "finish_reason": finish_reason(reason)})
        return {"id": self.gen.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model.served_name, "choices": choices, "usage": usage(self.gen)}

    def frame(self, event) -> bytes:
        return b"data: [DONE]\n\n" if event is _DONE else b"data: " + json_encoder.encode(event) + b"\n\n"


class _TextChoices(_Choices):
    chat = False


def _echo_text(body: CompletionRequest, codec: TextCodec, index: int) -> tuple[str, list[int] | None]:
    """Choice ``index``'s prompt as text and, for a text prompt, where each of its tokens
    starts in it (the tokenizer's offsets; token prompts are decoded, their offsets
    grown token by token)."""
    prompt = body.prompt
    one = prompt if isinstance(prompt, str) or _is_ids(prompt) else prompt[index // body.n]
    if isinstance(one, str):
        ids, spans = codec.encode_with_offsets(one, add_special_tokens=True)
        return one, [start for start, _ in spans]
    return codec.decode(one), None


class ChatCompletions(Endpoint):
    body_type, id_prefix, presenter = ChatCompletionRequest, "chatcmpl-", _Choices
    request_fields = {"prompt": "messages"}
    spec = staticmethod(chat_spec)


# OpenAI's legacy Completions API generates 16 tokens when max_tokens is absent (chat
# generates until the context limit).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


class Completions(Endpoint):
    """Text completions: prompts as given (no template, parser or grammar)."""

    body_type, id_prefix, presenter = CompletionRequest, "cmpl-", _TextChoices

    async def start(self, body: CompletionRequest, rid: str) -> Generation:
        ctx = self.ctx
        check_unsupported(body)
        limits = ctx.config.limits
        if isinstance(body.n, bool) or not 1 <= body.n <= limits.max_n:
            raise FrontendError(f"n must lie in [1, {limits.max_n}]", param="n")
        prompts = _prompts(body.prompt, ctx.model.codec)
        stops = P.stop_strings(body.stop, limits)
        logprobs = P.logprobs_count(ctx.model.manifest, logprobs=body.logprobs, top_logprobs=body.top_logprobs,
                                    chat=False)
        # echo with log-probabilities scores the prompt (score programs); max_tokens 0 then
        # only scores, and samples nothing: the sampling fields are not read.
        score = body.echo and logprobs >= 0
        scoring_only = body.echo and body.max_tokens == 0
        fields = W.sampling(body)
        if score and fields.get("temperature") == 0:
            # A scoring request at temperature 0 (lm-evaluation-harness's loglikelihood body:
            # max_tokens 1, the token discarded) generates greedily: top_k 1 at the default
            # temperature. Elsewhere temperature 0 stays refused (greedy is not a mode).
            fields = {**fields, "temperature": None, "top_k": 1}
        default = min(COMPLETIONS_DEFAULT_MAX_TOKENS, limits.max_tokens_cap or COMPLETIONS_DEFAULT_MAX_TOKENS)
        context = ctx.model.manifest.capacities.context_limit
        gen = Generation(ctx.engine, rid, sum(len(p) for p in prompts), body.n)
        try:
            for p_i, prompt in enumerate(prompts):
                for j in range(body.n):
                    index = p_i * body.n + j
                    seed = None if body.seed is None else body.seed + index
                    # The default fits what the context leaves (an explicit value that does not is a 400).
                    max_tokens = body.max_tokens if body.max_tokens is not None else max(
                        1, min(default, context - len(prompt)))
                    params = P.resolve_sampling(
                        ctx.model.manifest, prompt_len=len(prompt), fields={} if scoring_only else fields,
                        max_tokens=max_tokens, seed=seed, stop_token_ids=body.stop_token_ids,
                        ignore_eos=body.ignore_eos, limits=limits, logprobs=logprobs, allow_zero_tokens=body.echo)
                    pipeline.submit(gen, index, prompt, params, OutputStream(ctx.model.codec, prompt, stops),
                                    score_prompt=score)
        except FlareError:
            gen.cancel()
            raise
        return gen
