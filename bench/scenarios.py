"""The serving workloads of the benchmark, one coroutine each (see docs/performance.md).

Every prompt is salted with the run's salt: a prompt is a prefix-cache hit only
where the scenario means it to be (prefix-hit, agent), also when the benchmark
is run twice against one server. Every request's ``cached_tokens`` is recorded,
so a cold measurement that was not cold shows in the JSON.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import asdict, dataclass

import httpx

from bench.client import (
    Refused,
    Stream,
    Target,
    SAMPLING,
    chat,
    complete,
    pct,
    spread,
    stream,
    token_prompt,
)


@dataclass(frozen=True)
class Options:
    tokens: int = 256
    concurrency: tuple[int, ...] = (1, 2, 4)
    cold_prompts: tuple[int, ...] = (512, 4096)
    prefill_prompts: tuple[int, ...] = (4096, 65536)
    prefix_tokens: int = 4096
    tail_tokens: int = 11
    short_prompt: int = 16  # the cold prompt a prefix hit is compared with
    agent_turns: int = 8
    agent_tokens: int = 64
    agent_result_items: int = 12  # entries per tool result (about 50 tokens each with the SmolLM2 tokenizer)
    # One slot fewer than the usual largest decode batch (4): the long prompt is admitted
    # next to running decodes instead of queueing behind them.
    interference_decoders: int = 3
    interference_tokens: int = 512
    interference_prompt: int = 4096
    interference_after: int = 64  # tokens every decoder has streamed before the long prompt is sent
    arrival_prompts: int = 4  # short cold prompts sent together (arrivals)
    arrival_tokens: int = 12
    rewrite_items: int = 10  # records of the JSON document the rewrite scenario re-emits (~30 tokens each)
    rewrite_tokens: int = 320
    repeats: int = 3
    decode_rounds: int = 1  # rounds of c stories at each concurrency (decode)
    salt: str = "0"
    context_limit: int | None = None
    limit_source: str = "unknown"

    def __post_init__(self):
        for name in ("tokens", "tail_tokens", "short_prompt", "agent_turns", "agent_tokens", "repeats", "decode_rounds",
                     "interference_decoders", "interference_tokens", "interference_prompt", "prefix_tokens",
                     "arrival_prompts", "arrival_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, not {getattr(self, name)}")
        if not 1 <= self.interference_after < self.interference_tokens:
            raise ValueError("interference_after must be in [1, interference_tokens)")

    def over_limit(self, prompt: int, out: int) -> str | None:
        if self.context_limit is not None and prompt + out > self.context_limit:
            return (f"{prompt} prompt + {out} output tokens exceed the server's context limit of "
                    f"{self.context_limit} ({self.limit_source})")
        return None


@dataclass(frozen=True)
class Env:
    client: httpx.AsyncClient
    target: Target
    opts: Options


def _skipped(reason: str) -> dict:
    return {"skipped": True, "reason": reason}


async def decode(env: Env) -> dict:
    """TTFT, ITL p50/p99 and completed tokens/s at each concurrency: ``decode_rounds`` rounds
    of c sampled stories each (distinct prompts and seeds per round), tokens/s their median."""
    out = {}
    for c in env.opts.concurrency:
        runs, rates, walls = [], [], []
        for k in range(env.opts.decode_rounds):
            tag = env.opts.salt if k == 0 else f"{env.opts.salt} round {k}"
            t0 = time.perf_counter()
            batch = await asyncio.gather(*(complete(env.client, env.target, f"Story {i} of {c} ({tag}): once "
                                                    "upon a time", env.opts.tokens, k * c + i) for i in range(c)))
            walls.append(time.perf_counter() - t0)
            rates.append(sum(r.tokens for r in batch) / walls[-1])
            runs += batch
        gaps = [g for r in runs for g in r.gaps_s]
        out[c] = {"decode_tokens_per_s": statistics.median(rates),
                  "ttft_s_median": statistics.median(r.ttft_s for r in runs),
                  "itl_s_p50": pct(gaps, 50), "itl_s_p99": pct(gaps, 99),
                  "itl_s_mean": statistics.mean(r.summary()["mean_itl_s"] for r in runs),
                  "wall_s": sum(walls), "rounds_tokens_per_s": rates, "raw": [r.summary() for r in runs]}
        print("decode", c, {k: v for k, v in out[c].items() if k != "raw"}, flush=True)
    return out


async def _one_token(env: Env, salt: str, n: int) -> dict:
    """A cold n-token prompt, one output token: TTFT is the prefill."""
    reason = env.opts.over_limit(n, 1)
    if reason:
        return _skipped(reason)
    runs = []
    for k in range(env.opts.repeats):
        try:
            s = await complete(env.client, env.target, token_prompt(f"{env.opts.salt}:{salt}:{k}", n), 1, 99)
        except Refused as e:
            if e.status == 400:  # the limit the server did not advertise
                return _skipped(f"server refused a {n}-token prompt: {e.message}")
            raise
        runs.append(s.summary())
    ttft = statistics.median(r["ttft_s"] for r in runs)
    return {"ttft_s": ttft, "prefill_tokens_per_s": n / ttft, "cached_tokens": [r["cached_tokens"] for r in runs],
            "raw": runs}


async def _sizes(env: Env, kind: str, sizes: tuple[int, ...]) -> dict:
    out = {}
    for n in sizes:
        out[n] = await _one_token(env, kind, n)
        print(kind, n, {k: v for k, v in out[n].items() if k != "raw"}, flush=True)
    return out


async def cold_ttft(env: Env) -> dict:
    return await _sizes(env, "cold", env.opts.cold_prompts)


async def prefill(env: Env) -> dict:
    """Prefill throughput of single long prompts (sizes over the context limit are skipped)."""
    return await _sizes(env, "prefill", env.opts.prefill_prompts)


async def prefix_hit(env: Env) -> dict:
    """TTFT of prefix + tail after the prefix was sent once, against a cold short prompt."""
    o = env.opts
    reason = o.over_limit(o.prefix_tokens + o.tail_tokens, 1)
    if reason:
        return _skipped(reason)
    hits, colds = [], []
    for k in range(o.repeats):
        prefix = token_prompt(f"{o.salt}:prefix:{k}", o.prefix_tokens)
        # Two output tokens: the prompt endpoint is captured before the first is sampled
        # (docs/prefix-cache.md); the stream ending then guarantees the prefix is cached.
        await complete(env.client, env.target, prefix, 2, k)
        tail = token_prompt(f"{o.salt}:tail:{k}", o.tail_tokens)
        hits.append((await complete(env.client, env.target, prefix + tail, 1, k)).summary())
        colds.append((await complete(env.client, env.target, token_prompt(f"{o.salt}:short:{k}", o.short_prompt),
                                     1, k)).summary())
    hit = statistics.median(r["ttft_s"] for r in hits)
    cold = statistics.median(r["ttft_s"] for r in colds)
    out = {"hit_ttft_s": hit, "cold_short_ttft_s": cold, "ratio": hit / cold, "target_ratio": 1.2,
           "cached_tokens": [r["cached_tokens"] for r in hits], "raw_hit": hits, "raw_cold_short": colds}
    print("prefix-hit", {k: v for k, v in out.items() if not k.startswith("raw")}, flush=True)
    return out


def agent_messages(salt: str, turns: int, items: int) -> tuple[list[dict], list[list[dict]]]:
    """The opening (system prompt with tool definitions, the user's task) and, per turn,
    the two messages the agent appends: its tool call and the tool's result. Scripted, so
    every server sees the same conversation; the salt keeps the first turn cold."""
    tools = [{"type": "function", "function": {"name": name, "description": desc, "parameters": {
        "type": "object", "properties": {p: {"type": "string"} for p in params}, "required": list(params)}}}
        for name, desc, params in (("search_code", "Search the repository for a pattern.", ("pattern", "path")),
                                   ("read_file", "Read lines of a file.", ("path", "start", "end")),
                                   ("run_tests", "Run a test selection and report failures.", ("selection",)),
                                   ("edit_file", "Replace a unique string in a file.", ("path", "old", "new")))]
    system = (f"Session {salt}. You are a coding agent. Call a tool by writing <tool_call>{{\"name\": ..., "
              "\"arguments\": {...}}</tool_call> and wait for its result.\nTools:\n"
              + "\n".join(json.dumps(t) for t in tools))
    opening = [{"role": "system", "content": system},
               {"role": "user", "content": "The scheduler drops a request when a prefill chunk ends exactly on a "
                                           "page boundary. Find the cause and fix it."}]
    appended = []
    for t in range(turns):
        call = {"name": "search_code", "arguments": {"pattern": f"page_boundary_{t}", "path": "src/"}}
        result = {"matches": [{"path": f"src/flare/runtime/module_{t}_{i}.py", "line": 17 * i + t,
                               "text": f"if start % page_size == 0: chunk = pages[{i}]"} for i in range(items)]}
        appended.append([{"role": "assistant", "content": f"<tool_call>{json.dumps(call)}</tool_call>"},
                         {"role": "tool", "content": json.dumps(result)}])
    return opening, appended


async def agent(env: Env) -> dict:
    """A multi-turn chat: per turn TTFT, prompt tokens and cached_tokens."""
    o = env.opts
    messages, appended = agent_messages(o.salt, o.agent_turns, o.agent_result_items)
    turns = []
    for t in range(o.agent_turns + 1):
        try:
            s = await chat(env.client, env.target, messages, o.agent_tokens, t)
        except Refused as e:
            if e.status == 400 and turns:  # the conversation outgrew the context
                turns.append(_skipped(f"turn {t}: {e.message}"))
                break
            raise
        r = s.summary()
        turns.append({"turn": t, "ttft_s": r["ttft_s"], "prompt_tokens": r["prompt_tokens"],
                      "cached_tokens": r["cached_tokens"], "completion_tokens": r["tokens"], "total_s": r["total_s"]})
        print("agent", turns[-1], flush=True)
        if t < o.agent_turns:
            messages = messages + appended[t]
    return {"turns": turns}


async def interference(env: Env) -> dict:
    """ITL of running decodes before and while a long prompt is prefilled."""
    o = env.opts
    reason = o.over_limit(o.interference_prompt, 1) or o.over_limit(64, o.interference_tokens)
    if reason:
        return _skipped(reason)
    ready = asyncio.Event()
    started: set[int] = set()

    def progress(i: int):
        def on_text(s: Stream) -> None:
            if len(s.arrivals) >= o.interference_after:
                started.add(i)
                if len(started) == o.interference_decoders:
                    ready.set()
        return on_text

    decoders = [asyncio.create_task(complete(env.client, env.target, f"Decoder {i} ({o.salt}): the history of",
                                             o.interference_tokens, i, progress(i)))
                for i in range(o.interference_decoders)]
    await ready.wait()
    submitted = time.perf_counter()
    long = await complete(env.client, env.target, token_prompt(f"{o.salt}:interference", o.interference_prompt), 1, 7)
    first = long.arrivals[0]
    runs = await asyncio.gather(*decoders)
    if not all(r.arrivals[-1] > first for r in runs):
        raise RuntimeError("a decoder finished during the prefill window; raise --interference-tokens")
    # A gap belongs to the prefill window when it overlaps it: the gap a decoder stalls
    # through while the prefill runs closes with the first token after the window.
    gaps = [(a, b) for r in runs for a, b in zip(r.arrivals, r.arrivals[1:])]
    before = [b - a for a, b in gaps if b <= submitted]
    during = [b - a for a, b in gaps if b > submitted and a < first]
    out = {"prefill_window_s": first - submitted, "long_ttft_s": long.ttft_s, "long_cached_tokens": long.cached_tokens,
           "decoders": o.interference_decoders, "itl_before": spread(before), "itl_during": spread(during),
           "raw": [r.summary() for r in runs]}
    print("interference", {k: v for k, v in out.items() if k != "raw"}, flush=True)
    return out


async def arrivals(env: Env) -> dict:
    """TTFT of short cold prompts sent together (one output token each) against one sent
    alone, ``repeats`` times: what packing and small prefill programs are for. Token-id
    prompts to /v1/completions (nothing to render), then the same as chat messages to
    /v1/chat/completions (``chat``: each request's template and tokenizer run first)."""
    o = env.opts

    async def lone_and_together(send) -> dict:
        lone, together, cached = [], [], []
        for k in range(o.repeats):
            s = await send(f"{o.salt}:lone:{k}", 99)
            lone.append(s.ttft_s)
            runs = await asyncio.gather(*(send(f"{o.salt}:arrive:{k}:{i}", 100 + i) for i in range(o.arrival_prompts)))
            together.append(sorted(r.ttft_s for r in runs))
            cached += [s.cached_tokens, *(r.cached_tokens for r in runs)]
        lone_s = statistics.median(lone)
        last_s = statistics.median(t[-1] for t in together)
        return {"lone_ttft_s": lone_s, "last_ttft_s": last_s, "last_over_lone": last_s / lone_s,
                "raw_lone_ttft_s": lone, "raw_together_ttft_s": together, "cached_tokens": cached}

    out = {"prompts": o.arrival_prompts, "prompt_tokens": o.arrival_tokens,
           **await lone_and_together(lambda salt, seed: complete(
               env.client, env.target, token_prompt(salt, o.arrival_tokens), 1, seed))}
    # A user message of arrival_tokens words, distinct per salt (cold); the template adds its own.
    out["chat"] = await lone_and_together(lambda salt, seed: chat(
        env.client, env.target, [{"role": "user", "content": " ".join(
            f"w{t}" for t in token_prompt(salt, o.arrival_tokens))}], 1, seed))
    print("arrivals", {k: v for k, v in out.items() if not k.startswith("raw") and k != "chat"},
          {k: v for k, v in out["chat"].items() if not k.startswith("raw")}, flush=True)
    return out


def rewrite_messages(salt: str, items: int) -> list[dict]:
    """A copy-heavy agent turn: re-emit a JSON document with one change (what speculative
    copy drafts are for). The salt keeps the document cold."""
    doc = {"session": salt, "tickets": [{"id": 4100 + i, "title": f"Page boundary bug in module {i}",
                                         "status": "open", "owner": f"dev{i % 3}", "points": i % 5 + 1}
                                        for i in range(items)]}
    return [{"role": "system", "content": "You are a careful editor. Output only the JSON document."},
            {"role": "user", "content": "Rewrite this JSON document exactly as it is, except that ticket "
                                        f"{4100 + items // 2} gets the status \"closed\":\n\n"
                                        + json.dumps(doc, indent=1)}]


async def rewrite(env: Env) -> dict:
    """Decode speed of a copy-heavy turn (re-emit a ~300-token JSON document with one change),
    sampled (the client's sampling) and greedy (top_k 1), ``repeats`` times each: decode
    tokens/s after the first token, the median. Compare a server with and without
    speculative decoding on the same core (bench.ab_serve)."""
    o = env.opts
    out = {}
    for mode, sampling in (("sampled", SAMPLING), ("greedy", {**SAMPLING, "top_k": 1})):
        runs = []
        for k in range(o.repeats):
            body = {"messages": rewrite_messages(f"{o.salt}:{mode}:{k}", o.rewrite_items),
                    "max_tokens": o.rewrite_tokens, "ignore_eos": True, "seed": k, **sampling}
            s = await stream(env.client, env.target, "/v1/chat/completions", body)
            r = s.summary()
            runs.append({"decode_tokens_per_s": (r["tokens"] - 1) / (r["total_s"] - r["ttft_s"]),
                         "tokens": r["tokens"], "ttft_s": r["ttft_s"], "prompt_tokens": r["prompt_tokens"]})
        out[mode] = {"decode_tokens_per_s": statistics.median(r["decode_tokens_per_s"] for r in runs), "raw": runs}
        print("rewrite", mode, out[mode]["decode_tokens_per_s"], flush=True)
    return out


SCENARIOS = {"decode": decode, "cold": cold_ttft, "prefill": prefill, "prefix": prefix_hit, "agent": agent,
             "interference": interference, "arrivals": arrivals, "rewrite": rewrite}


def options_record(o: Options) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(o).items()}
