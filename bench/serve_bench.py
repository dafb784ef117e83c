"""Serving benchmark against any OpenAI-compatible server (asyncio + httpx, SSE).

usage: python -m bench.serve_bench URL MODEL OUT.json [--tokens 256] [--concurrency 1,2,4]
           [--scenarios decode,cold,prefill,prefix,agent,interference] [sizes, see --help]

Primary sampling: temperature 1, top-k 20, top-p 0.95. Scenarios (docs/performance.md):

  decode        TTFT, ITL p50/p99 and completed tokens/s at each concurrency
  cold          cold TTFT of long prompts (--cold-prompts)
  prefill       prefill throughput of single prompts (--prefill-prompts); sizes over
                the server's context limit are recorded as skipped with the reason
  prefix        TTFT of a cached prefix plus a short tail against a cold short prompt
  agent         multi-turn chat with tools in the system prompt: per-turn TTFT and cached_tokens
  interference  ITL of running decodes before and while a long prompt is prefilled
  arrivals      TTFT of short cold prompts sent together against one sent alone
  rewrite       decode tokens/s of a copy-heavy turn: a ~300-token JSON document re-emitted with one
                change, sampled and greedy (what speculative copy drafts are for)

The context limit comes from --context-limit, else /v1/models, else a 400. The
JSON keeps every raw sample, the client machine, the options and the server's
/v1/models entry.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import secrets
from dataclasses import replace

import httpx

from bench.client import SAMPLING, Target, complete, context_limit, machine, server_counters
from bench.scenarios import SCENARIOS, Env, Options, options_record


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split(",") if x)


def _scenarios(s: str) -> tuple[str, ...]:
    names = tuple(x for x in s.split(",") if x)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown scenarios {unknown}; known: {', '.join(SCENARIOS)}")
    return names


async def run(a: argparse.Namespace) -> dict:
    target = Target(a.url, a.model)
    opts = Options(tokens=a.tokens, concurrency=a.concurrency, cold_prompts=a.cold_prompts,
                   prefill_prompts=a.prefill_prompts, prefix_tokens=a.prefix_tokens, tail_tokens=a.tail_tokens,
                   short_prompt=a.short_prompt, agent_turns=a.agent_turns, agent_tokens=a.agent_tokens,
                   agent_result_items=a.agent_result_items,
                   interference_decoders=a.interference_decoders, interference_tokens=a.interference_tokens,
                   interference_prompt=a.interference_prompt, interference_after=a.interference_after,
                   arrival_prompts=a.arrival_prompts, arrival_tokens=a.arrival_tokens,
                   rewrite_items=a.rewrite_items, rewrite_tokens=a.rewrite_tokens,
                   repeats=a.repeats, decode_rounds=a.decode_rounds, salt=a.salt or secrets.token_hex(4))
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    async with httpx.AsyncClient(timeout=a.timeout, headers=headers) as client:
        if a.context_limit is not None:
            opts = replace(opts, context_limit=a.context_limit, limit_source="--context-limit")
        else:
            limit, source = await context_limit(client, target)
            opts = replace(opts, context_limit=limit, limit_source=source)
        models = (await client.get(a.url + "/v1/models")).json()
        results = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                   "url": a.url, "model": a.model, "sampling": SAMPLING, "tokens": a.tokens,
                   "machine": machine(), "server_models": models, "options": options_record(opts),
                   "scenarios": list(a.scenarios)}
        await complete(client, target, "warm up", 8, 0)
        env = Env(client, target, opts)
        by_scenario = results["server_counters_by_scenario"] = {}
        for name in a.scenarios:
            # The keys of the first two predate the scenario list (bench/report.py reads them).
            key = {"decode": "concurrency", "cold": "cold_ttft"}.get(name, name)
            before = await server_counters(client, a.url)
            results[key] = await SCENARIOS[name](env)
            after = await server_counters(client, a.url)
            if after:  # a Flare server: what each scenario made it do (steps, drafts, ...)
                by_scenario[name] = {k: v - before.get(k, 0.0) for k, v in after.items() if "_bucket{" not in k}
    return results


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("url")
    p.add_argument("model")
    p.add_argument("out")
    d = Options()
    p.add_argument("--scenarios", type=_scenarios, default=("decode", "cold"),
                   help=f"comma-separated, of {','.join(SCENARIOS)} (default decode,cold)")
    p.add_argument("--tokens", type=int, default=d.tokens, help="generated tokens per decode request")
    p.add_argument("--concurrency", type=_ints, default=d.concurrency)
    p.add_argument("--cold-prompts", type=_ints, default=d.cold_prompts)
    p.add_argument("--prefill-prompts", type=_ints, default=d.prefill_prompts)
    p.add_argument("--prefix-tokens", type=int, default=d.prefix_tokens)
    p.add_argument("--tail-tokens", type=int, default=d.tail_tokens)
    p.add_argument("--short-prompt", type=int, default=d.short_prompt, help="cold prompt the prefix hit is compared with")
    p.add_argument("--agent-turns", type=int, default=d.agent_turns, help="tool calls appended after the first turn")
    p.add_argument("--agent-tokens", type=int, default=d.agent_tokens)
    p.add_argument("--agent-result-items", type=int, default=d.agent_result_items,
                   help="entries per tool result (about 50 tokens each with the SmolLM2 tokenizer)")
    p.add_argument("--interference-decoders", type=int, default=d.interference_decoders)
    p.add_argument("--interference-tokens", type=int, default=d.interference_tokens)
    p.add_argument("--interference-prompt", type=int, default=d.interference_prompt)
    p.add_argument("--interference-after", type=int, default=d.interference_after,
                   help="tokens each decoder streams before the long prompt is sent")
    p.add_argument("--arrival-prompts", type=int, default=d.arrival_prompts,
                   help="short prompts sent together (arrivals)")
    p.add_argument("--arrival-tokens", type=int, default=d.arrival_tokens)
    p.add_argument("--rewrite-items", type=int, default=d.rewrite_items,
                   help="records of the JSON document the rewrite scenario re-emits")
    p.add_argument("--rewrite-tokens", type=int, default=d.rewrite_tokens)
    p.add_argument("--repeats", type=int, default=d.repeats,
                   help="repeats of cold, prefill, prefix and arrivals (median)")
    p.add_argument("--decode-rounds", type=int, default=d.decode_rounds,
                   help="rounds of stories at each concurrency (decode: tokens/s is their median)")
    p.add_argument("--context-limit", type=int, default=None, help="override the limit read from /v1/models")
    p.add_argument("--salt", default=None, help="prompt salt (default: random, so every run is cold)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="default $OPENAI_API_KEY")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    return p


def main(argv: list[str] | None = None) -> None:
    a = parser().parse_args(argv)
    results = asyncio.run(run(a))
    with open(a.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
