"""Where do two partitions of one prompt part, on a prepared core's own programs?

A cache-on turn prefills its suffix after a restored prefix; the same prompt with the cache
off is prefilled whole. The prefix cache is exact when both give every prompt row the same
bits and the decode steps after them the same logits. This drives the core's programs
through an executor (``cuda``: the captured graphs, torch-free; ``reference``: eager on the
CPU), one slot per partition, and reports the first prompt position whose final hidden row
differs from the first partition's and the first decode step whose logits differ (teacher
forced with the first partition's greedy tokens).

    python -m bench.partition_probe CORE OUT.json [--executor cuda] [--prompt 153]
        [--partitions 153 122,31 60,31,31,31] [--steps 24]

A partition lists chunk lengths (each at most the prefill chunk; the smallest prefill
capacity that holds a chunk runs it). Where the first decode logits differ while every
prompt row agrees, the divergence is in decode, not in the prompt's rows.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
from pathlib import Path

import numpy as np

from flare.core import interface as io
from flare.core.manifest import ProgramKind, load_manifest
from flare.core.sampling_params import NEUTRAL
from flare.server.cli import make_executor


def _bytes(ex, name: str) -> bytes:
    return ex.read_bytes(name) if hasattr(ex, "read_bytes") else ex.read(name).tobytes()


def _rows(raw: bytes, row_bytes: int, n: int) -> list[bytes]:
    return [raw[i * row_bytes:(i + 1) * row_bytes] for i in range(n)]


async def _one(ex, m, slot: int, pages: list[int], prompt: list[int], chunks: list[int],
               forced: list[int] | None, steps: int) -> dict:
    """Admit, prefill in ``chunks``, then ``steps`` decode steps (feeding ``forced`` tokens
    when given, else the greedy ones). Returns the hidden rows, logits and tokens."""
    c = m.capacities
    for name, value in io.slot_state(pending=0, generated=0, max_new=4096, seed=1, sampling={**NEUTRAL, "top_k": 1},
                                     stop_ids=m.frontend.eos_ids, stop_capacity=c.stop_ids, pages=pages,
                                     max_pages=c.max_pages_per_slot, mask_on=False, logprobs=False).items():
        ex.write(name, np.asarray(value), slot)
    C = m.programs_of(ProgramKind.admit)[0].capacity
    for i in range(0, len(prompt), C):
        chunk = prompt[i:i + C]
        ex.write(io.TOKENS, np.array(chunk, np.int32))
        ex.write(io.AdmitInput.buffer, io.pack(io.AdmitInput(slot, len(chunk), int(i == 0), io.AdmitMode.prompt)))
        await ex.wait(ex.submit(f"admit.{C}"))
    hidden_buf = next(b for b in m.buffers if b.name == "out.prefill_hidden")
    row_bytes = hidden_buf.nbytes // hidden_buf.shape[0]
    logits_buf = next(b for b in m.buffers if b.name == "out.logits")
    logit_bytes = logits_buf.nbytes // logits_buf.shape[0]
    hidden, start = [], 0
    for n in chunks:
        cap = min(x for x in c.prefill_capacities if x >= n)
        ex.write(io.TOKENS, np.array(prompt[start:start + n], np.int32))
        last = start + n == len(prompt)
        ex.write(io.PrefillInput.buffer, io.pack(io.PrefillInput(slot, n, int(last))))
        ticket = ex.submit(f"prefill.{cap}")
        await ex.wait(ticket)
        hidden += _rows(_bytes(ex, "out.prefill_hidden"), row_bytes, n)
        start += n
    logits = [_bytes(ex, "out.logits")[:logit_bytes]]
    tokens = [int(io.completion(ex.completion(ticket)[0]).token)]
    batch = np.zeros(max(c.decode_capacities), np.int32)
    batch[0] = slot
    for k in range(steps):
        if forced is not None:
            ex.write("state.pending", np.int32(forced[k]), slot)
        ex.write(io.DECODE_SLOTS, batch)
        ticket = ex.submit(f"decode.{min(c.decode_capacities)}")
        await ex.wait(ticket)
        logits.append(_bytes(ex, "out.logits")[:logit_bytes])
        tokens.append(int(io.completion(ex.completion(ticket)[0]).token))
    return {"hidden": hidden, "logits": logits, "tokens": tokens}


async def main(args) -> dict:
    m = load_manifest(args.core)
    ex = make_executor(args.executor, Path(args.core), m, None)
    await ex.start()
    rng = np.random.default_rng(args.seed)
    prompt = rng.integers(100, min(m.capacities.sampling_vocab, 40000), args.prompt).tolist()
    parts = [[int(x) for x in p.split(",")] for p in args.partitions]
    assert all(sum(p) == args.prompt for p in parts), "every partition must cover the prompt"
    per_slot = -(-(args.prompt + args.steps + 2) // m.pages.page_size)
    runs, report = [], []
    for i, chunks in enumerate(parts):
        pages = list(range(1 + i * per_slot, 1 + (i + 1) * per_slot))
        forced = runs[0]["tokens"] if runs else None
        runs.append(await _one(ex, m, i + 1, pages, prompt, chunks, forced, args.steps))
        r, base = runs[-1], runs[0]
        rows = [j for j, (a, b) in enumerate(zip(r["hidden"], base["hidden"])) if a != b]
        steps = [j for j, (a, b) in enumerate(zip(r["logits"], base["logits"])) if a != b]
        report.append({"chunks": chunks, "rows_differing": len(rows), "first_row_differing": rows[0] if rows else None,
                       "first_logits_differing": steps[0] if steps else None,
                       "logits_differing": len(steps), "tokens": r["tokens"]})
        print(report[-1], flush=True)
    await ex.close()
    return {"core": args.core, "executor": args.executor, "prompt_tokens": args.prompt, "steps": args.steps,
            "note": "logits index 0 is the prompt's last row (sampled by the prefill), then one per decode step; "
                    "decode steps are teacher forced with the first partition's tokens",
            "partitions": report, "machine": platform.node(), "python": sys.version.split()[0]}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("core")
    p.add_argument("out")
    p.add_argument("--executor", choices=["cuda", "reference"], default="cuda")
    p.add_argument("--prompt", type=int, default=153)
    p.add_argument("--partitions", nargs="+", default=["153", "122,31", "60,31,31,31"])
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--seed", type=int, default=11)
    a = p.parse_args()
    result = asyncio.run(main(a))
    json.dump(result, open(a.out, "w"), indent=1)
