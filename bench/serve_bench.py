"""Serving benchmark against any OpenAI-compatible server (asyncio + httpx, SSE).

usage: python -m bench.serve_bench URL MODEL OUT.json [--tokens 256] [--concurrency 1,2,4]

Measures, with temperature 1, top-k 20, top-p 0.95 (the primary sampling):
time to first token, inter-token latency (p50/p99 of chunk gaps, and the mean
from token counts), completed tokens/s at each concurrency, and cold TTFT for
long prompts. Raw samples are kept in the JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import httpx

SAMPLING = {"temperature": 1.0, "top_p": 0.95, "top_k": 20}


async def one(client: httpx.AsyncClient, url: str, model: str, prompt, tokens: int, seed: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "stream": True, "ignore_eos": True,
            "seed": seed, "stream_options": {"include_usage": True}, **SAMPLING}
    t0 = time.perf_counter()
    arrivals, usage = [], None
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {await r.aread()}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("usage"):
                usage = ev["usage"]
            if any(c.get("text") for c in ev["choices"]):
                arrivals.append(time.perf_counter())
    end = time.perf_counter()
    n = usage["completion_tokens"] if usage else len(arrivals)
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    ttft = arrivals[0] - t0 if arrivals else float("nan")
    return {"ttft_s": ttft, "total_s": end - t0, "tokens": n, "gaps_s": gaps,
            "mean_itl_s": (end - arrivals[0]) / max(n - 1, 1) if arrivals else float("nan")}


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] if xs else float("nan")


async def main(a) -> None:
    results = {"url": a.url, "model": a.model, "sampling": SAMPLING, "tokens": a.tokens, "concurrency": {}}
    async with httpx.AsyncClient(timeout=600) as client:
        await one(client, a.url, a.model, "warm up", 8, 0)
        for c in a.concurrency:
            t0 = time.perf_counter()
            # Prompts differ across concurrency levels: a repeated prompt would be a prefix-cache
            # hit (resume, no prefill) and change what TTFT measures.
            runs = await asyncio.gather(*(one(client, a.url, a.model, f"Story {i} of {c}: once upon a time",
                                              a.tokens, i) for i in range(c)))
            wall = time.perf_counter() - t0
            gaps = [g for r in runs for g in r["gaps_s"]]
            results["concurrency"][c] = {
                "decode_tokens_per_s": sum(r["tokens"] for r in runs) / wall,
                "ttft_s_median": statistics.median(r["ttft_s"] for r in runs),
                "itl_s_p50": pct(gaps, 50), "itl_s_p99": pct(gaps, 99),
                "itl_s_mean": statistics.mean(r["mean_itl_s"] for r in runs),
                "wall_s": wall, "raw": runs,
            }
            print(c, {k: v for k, v in results["concurrency"][c].items() if k != "raw"}, flush=True)
        cold = {}
        for n in a.cold_prompts:
            # Salted by n: a shorter cold prompt must not be a cached prefix of a longer one.
            ids = [1000 + (i * 7919 + n) % 30000 for i in range(n)]
            r = await one(client, a.url, a.model, ids, 1, 99)
            cold[n] = {"ttft_s": r["ttft_s"], "prefill_tokens_per_s": n / r["ttft_s"]}
            print("cold", n, cold[n], flush=True)
        results["cold_ttft"] = cold
    json.dump(results, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("model")
    p.add_argument("out")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4])
    p.add_argument("--cold-prompts", type=lambda s: [int(x) for x in s.split(",")], default=[512, 2048])
    asyncio.run(main(p.parse_args()))
