"""A request as the runtime sees it: token ids in, token ids out.

Token accounting (docs/prefix-cache.md): *consumed* tokens are in every model state (KV, and
for recurrent models the recurrence); the *pending* token was sampled but not
yet consumed; *visible* output is what presentation shows. Only consumed
history can define a checkpoint.
"""

from __future__ import annotations

import enum
import itertools
import time
from typing import Protocol

import msgspec
import numpy as np

from flare.core.sampling_params import SAMPLING_PARAMS, penalizes
from flare.runtime.pages import PageId, SlotId


class FinishReason(str, enum.Enum):
    stop = "stop"  # EOS, a stop token id, or a stop string
    length = "length"  # max_tokens, or the context / pool limit
    cancelled = "cancelled"  # client went away or shutdown
    error = "error"


class Status(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"


def _penalizes(self) -> bool:
    """Whether any penalty reads the slot's token histogram (repetition, presence,
    frequency): at their neutral values the sampler's penalty step leaves every logit
    unchanged."""
    return penalizes(self)


# Resolved parameters: defaults applied, ranges clamped, seed chosen. One field per
# sampling parameter (``flare.core.sampling_params``), then the request's own.
SamplingParams = msgspec.defstruct(
    "SamplingParams",
    [*((p.name, p.type) for p in SAMPLING_PARAMS),
     ("seed", int), ("max_tokens", int), ("stop_token_ids", tuple[int, ...], ()), ("ignore_eos", bool, False),
     # -1: no log-probabilities; n >= 0: each token's, with its n most likely alternatives
     ("logprobs", int, -1)],
    kw_only=True,
    frozen=True,
    module=__name__,
    namespace={"penalizes": property(_penalizes)},
)


class RequestSink(Protocol):
    """Receives a request's output. Called from the engine loop: must not block."""

    def on_tokens(self, request: "Request", ids: list[int], logprobs: list | None = None) -> bool:
        """New visible tokens. Return True when a stop sequence matched: the request
        then finishes with reason ``stop`` at this submission boundary. A request with
        ``params.logprobs >= 0`` is also given ``logprobs=``, one
        ``interface.TokenLogprobs`` per id."""

    def on_finish(self, request: "Request") -> None: ...

    # Optional (requests with ``score_prompt``): ``on_prompt_logprobs(request, entries)``,
    # one ``(token id, interface.TokenLogprobs | None)`` per prompt token, once scored.


class Grammar(Protocol):
    """A request's output constraint, opaque to the runtime (the server builds it).

    The scheduler calls ``fill_mask`` before every step that samples for the request
    (its final prefill chunk and each decode step) and ``accept`` with each token the
    step sampled, before the next ``fill_mask``. Both run on the engine loop and must
    be bounded in time."""

    def fill_mask(self, out: np.ndarray) -> None:
        """Write the allowed-token bitmask for the next sample into ``out`` (int32
        words, bit j of word w = token 32 * w + j)."""

    def accept(self, token: int) -> bool:
        """Advance on a sampled token; False when the grammar rejects it."""

    def error(self) -> str:
        """Why the grammar failed (after ``accept`` returned False or a mask failed)."""


class NullSink:
    def on_tokens(self, request: "Request", ids: list[int], logprobs: list | None = None) -> bool:
        return False

    def on_finish(self, request: "Request") -> None:
        pass


_ids = itertools.count(1)


class Request:
    def __init__(self, prompt: list[int], params: SamplingParams, sink: RequestSink | None = None,
                 request_id: str | None = None, grammar: Grammar | None = None,
                 endpoints: tuple[int, ...] = (), score_prompt: bool = False):
        self.id = request_id or f"req-{next(_ids)}"
        self.prompt = list(prompt)
        # Token counts at which a complete rendered message ends (checkpoint candidates),
        # ascending and strictly inside the prompt; the prompt boundary is implied.
        self.endpoints = tuple(endpoints)
        self.params = params
        self.sink: RequestSink = sink or NullSink()
        self.grammar = grammar
        self.status = Status.WAITING
        self.slot: SlotId | None = None
        self.pages: list[PageId] = []
        self.output: list[int] = []  # every sampled token, stop token included
        self.consumed = 0  # tokens in model state
        self.target: list[int] = self.prompt  # tokens to prefill before decoding
        self.finish_reason: FinishReason | None = None
        self.error: Exception | None = None
        self.cancel_requested = False
        self.admission_seq = -1  # admission order, for preemption
        self.preemptions = 0
        self.cached_tokens = 0  # prompt tokens restored from the prefix cache at first admission
        self.arrival = time.monotonic()
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        # Prompt scoring (echo with log-probabilities): the prompt runs through the score
        # programs, never restored from the cache, and each token's block is kept here
        # (None for the first, which has no prefix); the sink gets them all at once.
        self.score_prompt = score_prompt
        self.prompt_logprobs: list = []

    @property
    def finished(self) -> bool:
        return self.status == Status.FINISHED

    @property
    def scoring(self) -> bool:
        """Its prompt is still to be scored (a preemption before the end starts it over)."""
        return self.score_prompt and len(self.prompt_logprobs) < len(self.prompt)

    @property
    def max_len(self) -> int:
        """Longest history this request can ever hold in KV."""
        return len(self.prompt) + self.params.max_tokens

    def __repr__(self) -> str:
        return f"Request({self.id}, {self.status.value}, slot={self.slot}, consumed={self.consumed}, out={len(self.output)})"
