"""OpenAI-protocol streaming requests, timed on arrival (asyncio + httpx, SSE).

Nothing here knows Flare: every request is a plain /v1/completions or
/v1/chat/completions stream with ``stream_options.include_usage``, so the
benchmark runs against any OpenAI-compatible server. ``top_k`` and
``ignore_eos`` are the common extensions (vLLM, SGLang, Flare).
"""

from __future__ import annotations

import json
import os
import platform
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

SAMPLING = {"temperature": 1.0, "top_p": 0.95, "top_k": 20}
# Prompt token ids are drawn from this range: inside every vocabulary the benchmark
# meets (SmolLM2's 49,152 ids are the smallest), clear of special tokens at the bottom.
TOKEN_IDS = (1000, 30000)


class Refused(RuntimeError):
    """The server answered a request with an HTTP error (kept: a 400 names the context limit)."""

    def __init__(self, status: int, body: str):
        super().__init__(f"HTTP {status}: {body}")
        self.status, self.body = status, body

    @property
    def message(self) -> str:
        try:
            return json.loads(self.body)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            return self.body


@dataclass
class Stream:
    """One streamed request: t0 is when it was sent; arrivals are perf_counter times of
    chunks that carried output text (or the finishing chunk, when no chunk carried any)."""

    t0: float
    arrivals: list[float] = field(default_factory=list)
    end: float = float("nan")
    usage: dict | None = None

    @property
    def ttft_s(self) -> float:
        return self.arrivals[0] - self.t0 if self.arrivals else float("nan")

    @property
    def tokens(self) -> int:
        return self.usage["completion_tokens"] if self.usage else len(self.arrivals)

    @property
    def cached_tokens(self) -> int | None:
        details = (self.usage or {}).get("prompt_tokens_details") or {}
        return details.get("cached_tokens")

    @property
    def gaps_s(self) -> list[float]:
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:])]

    def summary(self) -> dict:
        """The raw record kept in the JSON (every chunk gap, so percentiles can be recomputed)."""
        n = self.tokens
        mean_itl = (self.end - self.arrivals[0]) / max(n - 1, 1) if self.arrivals else float("nan")
        return {"ttft_s": self.ttft_s, "total_s": self.end - self.t0, "tokens": n, "gaps_s": self.gaps_s,
                "mean_itl_s": mean_itl, "prompt_tokens": (self.usage or {}).get("prompt_tokens"),
                "cached_tokens": self.cached_tokens}


@dataclass(frozen=True)
class Target:
    url: str
    model: str


async def stream(client: httpx.AsyncClient, target: Target, route: str, body: dict,
                 on_text: Callable[[Stream], None] | None = None) -> Stream:
    """POST a streaming request; ``on_text`` runs after each chunk that carried text."""
    body = {**body, "model": target.model, "stream": True, "stream_options": {"include_usage": True}}
    # Encoded before the clock starts: TTFT is the server's time from the request being
    # sent, not the client's JSON encoding (0.3 ms for a 4,096-token id prompt here).
    payload = json.dumps(body).encode()
    s = Stream(t0=time.perf_counter())
    async with client.stream("POST", target.url + route, content=payload,
                             headers={"content-type": "application/json"}) as r:
        if r.status_code != 200:
            raise Refused(r.status_code, (await r.aread()).decode(errors="replace"))
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("usage"):
                s.usage = ev["usage"]
            choices = ev.get("choices") or ()
            if any(c.get("text") or (c.get("delta") or {}).get("content") or (c.get("delta") or {}).get("tool_calls")
                   for c in choices):
                s.arrivals.append(time.perf_counter())
                if on_text:
                    on_text(s)
            elif not s.arrivals and any(c.get("finish_reason") for c in choices):
                # Tokens without text so far (a character's first bytes held back, a special
                # token): the finishing chunk is when the first token arrived.
                s.arrivals.append(time.perf_counter())
    s.end = time.perf_counter()
    return s


async def complete(client: httpx.AsyncClient, target: Target, prompt: str | list[int], tokens: int, seed: int,
                   on_text: Callable[[Stream], None] | None = None) -> Stream:
    body = {"prompt": prompt, "max_tokens": tokens, "ignore_eos": True, "seed": seed, **SAMPLING}
    return await stream(client, target, "/v1/completions", body, on_text)


async def chat(client: httpx.AsyncClient, target: Target, messages: list[dict], tokens: int, seed: int) -> Stream:
    body = {"messages": messages, "max_tokens": tokens, "ignore_eos": True, "seed": seed, **SAMPLING}
    return await stream(client, target, "/v1/chat/completions", body)


async def context_limit(client: httpx.AsyncClient, target: Target) -> tuple[int | None, str]:
    """The server's context limit and where it came from: /v1/models ``max_model_len``
    (vLLM, Flare) or ``context_length``; None when the server does not say (a prompt
    over the limit is then found from its 400)."""
    try:
        r = await client.get(target.url + "/v1/models")
        for m in r.json().get("data", ()):
            if m.get("id") == target.model:
                for key in ("max_model_len", "context_length"):
                    if isinstance(m.get(key), int):
                        return m[key], f"/v1/models {key}"
    except (httpx.HTTPError, ValueError, AttributeError):
        pass
    return None, "unknown"


def token_prompt(salt: str, n: int) -> list[int]:
    """n prompt token ids, a function of (salt, n) only: distinct salts never share a
    prefix, so a prompt is cold unless the same salt was sent before."""
    rng = random.Random(f"{salt}:{n}")
    return [rng.randrange(*TOKEN_IDS) for _ in range(n)]


def pct(xs, p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))] if xs else float("nan")


def spread(xs) -> dict:
    """p50 / p99 / max / count of a sample, in milliseconds."""
    xs = list(xs)
    return {"p50_ms": pct(xs, 50) * 1e3, "p99_ms": pct(xs, 99) * 1e3,
            "max_ms": max(xs) * 1e3 if xs else float("nan"), "count": len(xs)}


# Flare's counters that say what a run made the server do (bench.ab_serve, bench.serve_bench).
COUNTERS = ("flare_engine_steps_total", "flare_engine_steps_ahead_total", "flare_generation_tokens_total",
            "flare_spec_", "flare_engine_admission_")


async def server_counters(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    """The server's COUNTERS from its Prometheus /metrics; {} for a server without them."""
    try:
        r = await client.get(url + "/metrics")
    except httpx.HTTPError:
        return {}
    if r.status_code != 200:
        return {}
    out = {}
    for line in r.text.splitlines():
        name, _, value = line.rpartition(" ")
        if name.startswith(COUNTERS):
            try:
                out[name] = float(value)
            except ValueError:
                pass
    return out


def machine() -> dict:
    """Where the client ran and the versions of what it could see. The server's own
    machine is described by the GPU runner (bench/collect.py)."""
    from importlib import metadata

    versions = {}
    for pkg in ("httpx", "flare", "torch", "triton", "transformers", "cuda-bindings"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return {"host": platform.node(), "platform": platform.platform(), "python": platform.python_version(),
            "cpus": os.cpu_count(), "versions": versions}
