"""Turning request fields into resolved sampling parameters (the rules below; DESIGN.md,
"Sampling", for the sampler they feed).

* Missing values take the core's declared defaults.
* Values outside the core's declared range clamp to the nearest endpoint; a
  parameter without a declared range stays at its default.
* Temperature must be positive: zero would collapse the distribution
  (greedy decoding is not a sampling mode here).
* Non-finite numbers, non-positive ``max_tokens`` and malformed stops are
  errors naming the field.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

from flare.core.errors import FrontendError
from flare.core.manifest import Manifest
from flare.core.sampling_params import SAMPLING_PARAMS
from flare.runtime.request import SamplingParams

MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
MAX_N = 8


@dataclass(frozen=True)
class Limits:
    max_n: int = MAX_N
    max_stop_strings: int = MAX_STOP_STRINGS
    max_tokens_cap: int | None = None  # server-wide ceiling on max_tokens


def _number(name: str, value, *, integer: bool = False):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise FrontendError(f"{name} must be a number", param=name)
    if isinstance(value, float) and not math.isfinite(value):
        raise FrontendError(f"{name} must be finite", param=name)
    if integer and int(value) != value:
        raise FrontendError(f"{name} must be an integer", param=name)
    return value


def resolve_sampling(
    manifest: Manifest,
    *,
    prompt_len: int,
    fields: dict,
    max_tokens: int | None,
    seed: int | None,
    stop_token_ids: list[int] | None,
    ignore_eos: bool,
    limits: Limits = Limits(),
    logprobs: int = -1,
    allow_zero_tokens: bool = False,
) -> SamplingParams:
    d = manifest.sampling
    values: dict[str, float] = {}
    for param in SAMPLING_PARAMS:
        name = param.name
        default = getattr(d, name)
        v = fields.get(name)
        if v is None:
            values[name] = default
            continue
        v = _number(name, v, integer=param.type is int)
        if name == "temperature" and v <= 0:
            raise FrontendError("temperature must be positive (greedy decoding is not supported)",
                                param="temperature", code="invalid_temperature")
        if name == "top_k" and v < 0:
            v = 0  # vLLM's -1: disabled
        r = d.ranges.get(name)
        values[name] = default if r is None else min(max(v, r.lo), r.hi)

    limit = manifest.capacities.context_limit - prompt_len
    if max_tokens is None:
        max_tokens = max(limit, 1)
        if limits.max_tokens_cap is not None:
            max_tokens = min(max_tokens, limits.max_tokens_cap)
    else:
        max_tokens = _number("max_tokens", max_tokens, integer=True)
        if max_tokens < 0 or (max_tokens == 0 and not allow_zero_tokens):
            raise FrontendError("max_tokens must be at least 1 (0 only with echo)" if not allow_zero_tokens
                                else "max_tokens must not be negative", param="max_tokens")
        if limits.max_tokens_cap is not None and max_tokens > limits.max_tokens_cap:
            raise FrontendError(f"max_tokens is limited to {limits.max_tokens_cap} on this server",
                                param="max_tokens")
    if seed is None:
        seed = secrets.randbits(63)
    else:
        seed = _number("seed", seed, integer=True)
        if not -(1 << 63) <= seed < 1 << 63:
            raise FrontendError("seed must fit in 64 bits", param="seed")
    stop_ids = tuple(stop_token_ids or ())
    vocab = manifest.capacities.vocab_size
    if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in stop_ids):
        raise FrontendError("stop_token_ids must be token ids inside the vocabulary", param="stop_token_ids")
    return SamplingParams(
        **{p.name: p.type(values[p.name]) for p in SAMPLING_PARAMS},
        seed=int(seed),
        max_tokens=int(max_tokens),
        stop_token_ids=stop_ids,
        ignore_eos=bool(ignore_eos),
        logprobs=logprobs,
    )


def logprobs_count(manifest: Manifest, *, logprobs, top_logprobs, chat: bool) -> int:
    """How many alternatives each generated token reports: -1 for no log-probabilities.
    Chat: ``logprobs`` true asks for them, ``top_logprobs`` (which needs it) for that many
    alternatives. Text completions: ``logprobs`` is the count itself. A count beyond what
    the core's sampling programs were prepared with (``max_logprobs``, 0 when prepared
    without) is refused, naming the field."""
    if chat:
        if logprobs is not None and not isinstance(logprobs, bool):
            raise FrontendError("logprobs must be a boolean", param="logprobs")
        if top_logprobs is not None:
            top_logprobs = _number("top_logprobs", top_logprobs, integer=True)
            if top_logprobs < 0:
                raise FrontendError("top_logprobs must not be negative", param="top_logprobs")
            if top_logprobs and not logprobs:
                raise FrontendError("top_logprobs requires logprobs to be true", param="top_logprobs")
        count = int(top_logprobs or 0) if logprobs else -1
        param = "top_logprobs" if top_logprobs else "logprobs"
    else:
        if top_logprobs not in (None, 0):
            raise FrontendError("top_logprobs is a Chat Completions field; text completions take logprobs=N",
                                param="top_logprobs")
        param = "logprobs"
        count = -1 if logprobs is None or logprobs is False else int(_number("logprobs", logprobs, integer=True))
        if count < 0 and logprobs is not None and logprobs is not False:
            raise FrontendError("logprobs must not be negative", param="logprobs")
    if count < 0:
        return -1
    cap = manifest.capacities.max_logprobs
    if cap == 0:
        raise FrontendError("this model's core was prepared without log-probabilities (flare-prepare "
                            "--max-logprobs)", param=param, code="logprobs_unavailable")
    if count > cap:
        raise FrontendError(f"{param} must lie in [0, {cap}] (the core's --max-logprobs)", param=param)
    return count


def stop_strings(stop, limits: Limits = Limits()) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    if len(stops) > limits.max_stop_strings:
        raise FrontendError(f"at most {limits.max_stop_strings} stop sequences", param="stop")
    for s in stops:
        if not isinstance(s, str) or not s:
            raise FrontendError("stop sequences must be non-empty strings", param="stop")
        if len(s) > MAX_STOP_LENGTH:
            raise FrontendError(f"stop sequences are limited to {MAX_STOP_LENGTH} characters", param="stop")
    return stops
