"""Teacher-forced run of a CUDA core through the torch-free executor.

usage: python -m tests.gpu.drive_teacher CORE PROMPTS.json OUT.npz DECODE_STEPS [release]

For each prompt (token ids): prefill all but the last DECODE_STEPS tokens in
chunks with sampling off and keep the final hidden rows (bf16 bits); then feed
the remaining tokens one decode step at a time (overwriting the pending token)
and keep the decode logits. Writes prompt i's arrays as hidden_i / logits_i.
``release`` (a core with ``pages.kv_window``): before each chunk and step the page-table
entries of the pages the scheduler would have given back (``Scheduler._release_window``: those
ending a page before the window of the chunk's first position) point at the null page.
"""

from __future__ import annotations

import asyncio
import json
import sys

import numpy as np

from flare.core import interface as io
from flare.core.manifest import ProgramKind, load_manifest
from flare.core.sampling_params import NEUTRAL
from flare.runtime.cuda_tp import open_executor
from flare.runtime.pages import window_released


def _release(ex, m, slot: int, position: int) -> None:
    """Point the slot's pages that end a page before ``position``'s window at the null page."""
    before = window_released(position, m.pages.kv_window, m.pages.page_size)
    if before > 0:
        ex.write("state.page_table", np.full(before, m.pages.null_page, np.int32), (slot, slice(0, before)))


async def main(core: str, prompts_path: str, out: str, steps: int, release: bool = False) -> None:
    m = load_manifest(core)
    if release and m.pages.kv_window is None:
        raise SystemExit("release: the core declares no kv_window")
    ex = open_executor(core, m)
    await ex.start()
    c = m.capacities
    caps = sorted(p.capacity for p in m.programs if p.kind.value == "prefill")
    prompts = json.load(open(prompts_path))
    arrays = {}
    slot = 1
    for i, ids in enumerate(prompts):
        n_pages = -(-len(ids) // m.pages.page_size) + 1
        for name, value in io.slot_state(pending=0, generated=0, max_new=1 << 30, seed=7, sampling=NEUTRAL,
                                         stop_ids=(), stop_capacity=c.stop_ids, pages=range(1, n_pages + 1),
                                         max_pages=c.max_pages_per_slot, mask_on=False, logprobs=False).items():
            ex.write(name, value, slot)
        # Admission's first admit chunk clears the slot's continuation state: a hybrid's
        # recurrent and convolution rows must not carry the previous prompt's state.
        ex.write(io.AdmitInput.buffer, io.pack(io.AdmitInput(slot, 0, clear=1, mode=io.AdmitMode.prompt)))
        ex.submit(m.programs_of(ProgramKind.admit)[0].name)
        prefix, tail = ids[: len(ids) - steps], ids[len(ids) - steps :]
        rows = []
        for start in range(0, len(prefix), c.prefill_chunk):
            chunk = prefix[start : start + c.prefill_chunk]
            cap = next(x for x in caps if x >= len(chunk))
            if release:
                _release(ex, m, slot, start)
            ex.write(io.TOKENS, np.asarray(chunk, np.int32))
            ex.write(io.PrefillInput.buffer, io.pack(io.PrefillInput(slot, len(chunk), 0)))
            ex.submit(f"prefill.{cap}")
            await ex.wait()
            rows.append(ex.read("out.prefill_hidden")[: len(chunk)])
        arrays[f"hidden_{i}"] = np.concatenate(rows)
        logits = []
        slots = np.zeros(max(c.decode_capacities), np.int32)
        slots[0] = slot
        for k, t in enumerate(tail):
            if release:
                _release(ex, m, slot, len(prefix) + k)
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
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5:] == ["release"]))
