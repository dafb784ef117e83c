"""Teacher-forced run of a CUDA core through the torch-free executor.

usage: python -m tests.gpu.drive_teacher CORE PROMPTS.json OUT.npz DECODE_STEPS

For each prompt (token ids): prefill all but the last DECODE_STEPS tokens in
chunks with sampling off and keep the final hidden rows (bf16 bits); then feed
the remaining tokens one decode step at a time (overwriting the pending token)
and keep the decode logits. Writes prompt i's arrays as hidden_i / logits_i.
"""

from __future__ import annotations

import asyncio
import json
import sys

import numpy as np

from flare.core.manifest import load_manifest
from flare.runtime.cuda_tp import open_executor


async def main(core: str, prompts_path: str, out: str, steps: int) -> None:
    m = load_manifest(core)
    ex = open_executor(core, m)
    await ex.start()
    c = m.capacities
    caps = sorted(p.capacity for p in m.programs if p.kind.value == "prefill")
    prompts = json.load(open(prompts_path))
    arrays = {}
    slot = 1
    for i, ids in enumerate(prompts):
        n_pages = -(-len(ids) // m.pages.page_size) + 1
        table = np.zeros(c.max_pages_per_slot, np.int32)
        table[:n_pages] = np.arange(1, n_pages + 1)
        stops = np.full(c.stop_ids, -1, np.int32)
        for name, value in {
            "state.len": 0, "state.pending": 0, "state.generated": 0, "state.max_new": 1 << 30, "state.done": 0,
            "state.seed": 7, "state.counter": 0, "state.top_k": 0,
            "state.sampling": np.array([1, 1, 0, 1, 0, 0], np.float32), "state.stop_ids": stops,
            "state.page_table": table,
        }.items():
            ex.write(name, np.asarray(value), slot)
        prefix, tail = ids[: len(ids) - steps], ids[len(ids) - steps :]
        rows = []
        for start in range(0, len(prefix), c.prefill_chunk):
            chunk = prefix[start : start + c.prefill_chunk]
            cap = next(x for x in caps if x >= len(chunk))
            ex.write("in.tokens", np.asarray(chunk, np.int32))
            ex.write("in.prefill", np.array([slot, len(chunk), 0, 0], np.int32))
            ex.submit(f"prefill.{cap}")
            await ex.wait()
            rows.append(ex.read("out.prefill_hidden")[: len(chunk)])
        arrays[f"hidden_{i}"] = np.concatenate(rows)
        logits = []
        slots = np.zeros(max(c.decode_capacities), np.int32)
        slots[0] = slot
        for t in tail:
            ex.write("state.pending", np.int32(t), slot)
            ex.write("in.decode_slots", slots)
            ex.submit("decode.1")
            await ex.wait()
            logits.append(ex.read("out.logits")[0].copy())
        arrays[f"logits_{i}"] = np.stack(logits)
    await ex.close()
    assert "torch" not in sys.modules
    np.savez(out, **arrays)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])))
