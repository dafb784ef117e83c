"""Admission builds the penalty histogram only when a penalty reads it.

The admit programs mark every prompt token in the slot's histogram, one
program per admit-capacity chunk. Only repetition, presence and frequency
penalties read that histogram; at their neutral values (1, 0, 0) the sampler
leaves every logit as it is, so the scheduler runs just the first chunk (which
also clears the slot's state). Checked through the real programs: with
neutral penalties a slot admitted from its first chunk only samples exactly
what a fully admitted one does; with a repetition penalty the two differ,
so the comparison can see the histogram.
"""

from __future__ import annotations

import torch

from flare.core import interface as io
from flare.core.manifest import ProgramKind, load_manifest
from flare.runtime.request import Request, SamplingParams
from flare.runtime.scheduler import Scheduler
from tests.rig import admit, load_rig, prefill


def _params(**kw) -> SamplingParams:
    base = dict(temperature=1.0, top_k=20, top_p=0.95, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0,
                frequency_penalty=0.0, seed=5, max_tokens=8, ignore_eos=True)
    return SamplingParams(**{**base, **kw})


def test_admit_programs_per_request(tiny_core):
    m = load_manifest(tiny_core)
    cap = m.programs_of(ProgramKind.admit)[0].capacity
    prompt = [(13 * i + 7) % m.capacities.vocab_size for i in range(3 * cap - 5)]
    counts = {}
    for name, params in {"neutral": _params(), "repetition": _params(repetition_penalty=1.2),
                         "presence": _params(presence_penalty=0.5), "frequency": _params(frequency_penalty=0.5)}.items():
        sched = Scheduler(m)
        sched.add(Request(prompt, params))
        steps = []
        while (step := sched.schedule()) is not None and step.kind == ProgramKind.admit:
            steps.append(step)
            sched.complete(step, None)
        counts[name] = len(steps)
        assert io.unpack(io.AdmitInput, steps[0].writes[-1].value).clear == 1  # the first chunk clears the slot
    assert counts == {"neutral": 1, "repetition": 3, "presence": 3, "frequency": 3}


def _decode_run(r, slot: int, steps: int) -> tuple[list[int], torch.Tensor]:
    v = r.v
    cap = max(r.m.capacities.decode_capacities)
    tokens, logits = [], []
    for _ in range(steps):
        batch = torch.zeros(cap, dtype=torch.int32)
        batch[0] = slot
        v[io.DECODE_SLOTS][:] = batch
        r.run[f"decode.{min(r.m.capacities.decode_capacities)}"]()
        tokens.append(io.completion(v[io.DECODE_COMPLETION][0]).token)
        logits.append(v["out.logits"][0].clone())
    return tokens, torch.stack(logits)


def _sampled(r, prompt, *, repetition: float, chunks: int | None, slot: int):
    ps = r.m.pages.page_size
    admit(r, slot, prompt, r.pages(-(-(len(prompt) + 16) // ps)), seed=11, top_k=20, chunks=chunks,
          sampling=dict(top_p=0.95, repetition_penalty=repetition))
    first = prefill(r, slot, prompt)[2].token
    tokens, logits = _decode_run(r, slot, 12)
    return [first, *tokens], logits


def test_neutral_penalties_do_not_read_the_history(tiny_core):
    r = load_rig(tiny_core)
    cap = r.m.programs_of(ProgramKind.admit)[0].capacity
    # The chunks after the first hold the tokens this model samples after the first
    # chunk alone: exactly what a history-reading penalty would push down.
    head = [(29 * i) % 97 + 3 for i in range(cap)]
    likely = _sampled(r, head, repetition=1.0, chunks=None, slot=5)[0]
    prompt = head + [likely[i % len(likely)] for i in range(cap + 40)]
    assert not set(likely) <= set(head)
    full = _sampled(r, prompt, repetition=1.0, chunks=None, slot=1)
    first_only = _sampled(r, prompt, repetition=1.0, chunks=1, slot=2)
    assert full[0] == first_only[0]
    assert torch.equal(full[1], first_only[1])
    # Control: a penalty does read the history, and the comparison sees it.
    pen_full = _sampled(r, prompt, repetition=1.5, chunks=None, slot=3)
    pen_first = _sampled(r, prompt, repetition=1.5, chunks=1, slot=4)
    assert pen_full[0] != pen_first[0]
