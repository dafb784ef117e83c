"""The compiled glue of the sampling programs is the same function as the eager one.

On CUDA, preparation compiles the pure pieces around the model (decode inputs,
mask + sampler, committed rows: ``ProgramSet.compile_glue``). Here the same
functions go through Inductor's CPU backend and drive free-running sampled
decoding (temperature, top-k, top-p, penalties, a grammar mask on one slot) next
to an eager copy of the same core: every completion record and every state
buffer must be identical after every step. Integer hashing, masks and
selection must not change under compilation; a float reduction order that
moved a draw would show here as a different token.
"""

from __future__ import annotations

import torch

from flare.core import interface as io
from tests.rig import admit, load_rig, prefill

STATE = ("state.pending", "state.generated", "state.counter", "state.done", "state.hist", "state.len")


def _setup(r, prompts):
    v = r.v
    for slot, prompt in prompts.items():
        admit(r, slot, prompt, r.pages(8), seed=1000 + slot, top_k=20, sampling=dict(
            temperature=0.9, top_p=0.95, min_p=0.01, repetition_penalty=1.1, presence_penalty=0.2,
            frequency_penalty=0.1))
    # Slot 2 is grammar-constrained to the even token ids below 64.
    words = torch.zeros(v["in.token_mask"].shape[1], dtype=torch.int64)
    words[:2] = 0x55555555
    v["in.token_mask"][2] = words.to(torch.int32)
    v["state.mask_on"][2] = 1
    return {slot: prefill(r, slot, prompt)[2] for slot, prompt in prompts.items()}


def test_compiled_glue_matches_eager(tiny_core):
    torch.manual_seed(0)
    eager, compiled = load_rig(tiny_core, seed=3), load_rig(tiny_core, seed=3, compiled=True)
    vocab = eager.m.capacities.vocab_size
    prompts = {s: torch.randint(0, vocab, (9 + 5 * s,)).tolist() for s in (1, 2, 3)}
    first = [_setup(r, prompts) for r in (eager, compiled)]
    assert all(first[0][s] == first[1][s] for s in prompts)
    decode_cap = max(eager.m.capacities.decode_capacities)
    # One batch shape (Inductor on the CPU compiles each shape for a minute).
    slots = [1, 2, 3]
    for step in range(12):
        cap = next(c for c in eager.m.capacities.decode_capacities if c >= len(slots))
        records = []
        for r in (eager, compiled):
            batch = torch.zeros(decode_cap, dtype=torch.int32)
            batch[: len(slots)] = torch.tensor(slots, dtype=torch.int32)
            r.v["in.decode_slots"][:] = batch
            r.run[f"decode.{cap}"]()
            records.append(r.v["out.decode_completion"][: len(slots)].clone())
        assert torch.equal(records[0], records[1]), (step, records)
        tokens = [io.completion(row).token for row in records[0]]
        assert all(t % 2 == 0 and t < 64 for s, t in zip(slots, tokens) if s == 2)
        for name in STATE:
            assert torch.equal(eager.v[name], compiled.v[name]), (step, name)
