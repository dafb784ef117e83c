"""Speculative verification on the Qwen3.5 hybrid: rollback of the recurrent state.

A verify program runs each row's pending token and drafts as W positions of its slot.
The Gated DeltaNet layers step position by position on a copy of the slot's state and keep
the state after each position (``verify.state.gdn.*``, [B, W, *row]); the program's commit
writes the accepted position's into the slot. A rejected draft's state therefore never
becomes the slot's: every test below drives a rejection at each draft position and compares
with plain decode steps of the accepted tokens."""

from __future__ import annotations

import pytest
import torch

from flare.core import interface as io
from flare.core.manifest import verify_buffer
from tests.conftest import QUALIFIED
from tests.rig import (STEP_STATE, admit, copy_rig, decode, decode_alike, greedy_continuation, load_rig, prefill,
                       prefilled_rigs)
from tests.test_programs import VERIFY_PROMPTS, _verify

STATE = ("state.gdn.conv", "state.gdn.recurrent")


@pytest.fixture(scope="module")
def hybrid_verify_core():
    return QUALIFIED["qwen3_5-tiny"]()  # HYBRID_OPTS and --draft-tokens 3 (with golden replays)


@pytest.mark.parametrize("attention", ["reference", "triton"])
def test_rejections_at_every_position_leave_the_state_of_the_accepted_tokens(hybrid_verify_core, attention):
    """Four greedy slots, one verify step: all three drafts true (4 tokens emitted), the third
    wrong (3), the second wrong (2), the first wrong (1). Each emits the true tokens and
    leaves its slot (length, pending, counters, histogram, convolution history, recurrent
    matrices, hidden vector) as plain decode steps of the emitted tokens do; the next steps
    of both rigs agree. On the reference path and the CUDA path's kernels (Triton's CPU
    interpreter for the convolution and delta-rule steps)."""
    prompts = VERIFY_PROMPTS
    # Two rigs in one state, the prompts prefilled (once, on the reference path: the
    # prefills are not what this test checks, and under Triton's interpreter each takes seconds).
    spec, plain = prefilled_rigs(hybrid_verify_core, prompts, 2, attention=attention)
    c = spec.m.capacities
    assert c.draft_tokens == 3
    assert spec.v[verify_buffer("state.gdn.recurrent")].shape[:2] == (max(c.decode_capacities), 4)
    # The true continuation from a third rig in that state on the reference path (as in
    # test_programs' verify test: another path's truth can make the test fail, never pass).
    shadow = load_rig(hybrid_verify_core)
    copy_rig(spec, shadow)
    truth = greedy_continuation(shadow, list(prompts), 4)
    wrong = lambda t: (t + 1) % c.sampling_vocab  # noqa: E731
    t = {s: truth[s][1:4] for s in prompts}
    rows = [(1, t[1]), (2, [t[2][0], t[2][1], wrong(t[2][2])]), (3, [t[3][0], wrong(t[3][1]), t[3][2]]),
            (4, [wrong(t[4][0]), t[4][1], t[4][2]])]
    before = {n: spec.v[n][1:5].clone() for n in STATE}
    got = _verify(spec, rows)
    want = {1: 4, 2: 3, 3: 2, 4: 1}
    for (slot, _), (rec, toks) in zip(rows, got):
        assert rec.slot == slot and rec.emitted == want[slot] and rec.status == int(io.Status.running)
        assert toks == truth[slot][1 : 1 + rec.emitted], (slot, toks, truth[slot])
    assert all(not torch.equal(spec.v[n][1:5], before[n]) for n in STATE)  # the step moved every slot
    for k in range(4):
        due = [s for s in prompts if want[s] > k]
        decode(plain, due, [int(plain.v["state.pending"][s]) for s in due])
    for slot in prompts:
        for name in STEP_STATE:
            assert torch.equal(spec.v[name][slot], plain.v[name][slot]), (slot, name)
        for name in (*STATE, "state.hidden"):
            torch.testing.assert_close(spec.v[name][slot], plain.v[name][slot], atol=2e-5, rtol=1e-5,
                                       msg=lambda m, slot=slot, name=name: f"slot {slot} {name}: {m}")
    decode_alike(spec, plain, list(prompts))


def test_a_finished_slot_keeps_its_state(hybrid_verify_core):
    """A row whose slot is done emits nothing and its recurrent state stays as it was."""
    r = load_rig(hybrid_verify_core)
    admit(r, 1, list(range(10, 30)), r.pages(4), seed=1)
    prefill(r, 1, list(range(10, 30)))
    admit(r, 2, list(range(50, 60)), r.pages(4), seed=2)
    prefill(r, 2, list(range(50, 60)))
    r.v["state.done"][2] = int(io.Status.stop)
    kept = {n: r.v[n][2].clone() for n in STATE}
    (done, toks), (running, _) = _verify(r, [(2, [1, 2, 3]), (1, [4, 5, 6])])
    assert done.status == int(io.Status.inactive) and done.emitted == 0 and toks == []
    assert running.emitted >= 1
    assert all(torch.equal(r.v[n][2], kept[n]) for n in STATE)


def test_greedy_hybrid_requests_are_the_same_with_verified_drafts(hybrid_core, hybrid_verify_core, monkeypatch):
    """The engine on the hybrid with speculation: greedy requests come out as without it, a
    follow-up turn included (its prefix restored from a checkpoint taken after verified
    steps). The random hybrid does not repeat itself, so copy drafts would never be made:
    the proposer here drafts each request's true continuation (from the run without
    speculation) with one token made wrong at a position that cycles through every draft
    position, or none, step by step."""
    import asyncio

    from flare.runtime.speculation import Speculation
    from tests.test_pipeline import Sink, _params, _run

    greedy = lambda seed, n: _params(seed, n, top_k=1, repetition_penalty=1.0)  # noqa: E731
    prompts = [[(13 * k + 5) % 4000 for k in range(30)], [(31 * k + 2) % 4000 for k in range(20)]]

    def batches():
        return [[(p, greedy(10 + i, 24), Sink()) for i, p in enumerate(prompts)],
                [(prompts[0] + [3, 4], greedy(20, 16), Sink())]]

    plain, _ = asyncio.run(_run(hybrid_core, 2, batches()))
    truth = {tuple(r.prompt): r.output for r in sum(plain, [])}
    steps = []

    def propose(self, req, room):
        out = truth[tuple(req.prompt)]
        drafts = list(out[len(req.output): len(req.output) + min(3, room)])
        wrong_at = len(steps) % 4  # 3: none wrong
        steps.append(wrong_at)
        if wrong_at < len(drafts):
            drafts[wrong_at] = (drafts[wrong_at] + 1) % 4000
        return drafts

    monkeypatch.setattr(Speculation, "propose", propose)
    ran: list[str] = []
    spec, _ = asyncio.run(_run(hybrid_verify_core, 2, batches(), ran, draft_tokens=3, speculate_always=True))
    assert sum(name.startswith("verify.") for name in ran) >= 8 and set(steps) == {0, 1, 2, 3}, ran
    for a, b in zip(sum(plain, []), sum(spec, [])):
        assert a.output == b.output and len(b.output) == b.params.max_tokens, (a.output, b.output)
    assert spec[1][0].cached_tokens >= len(prompts[0])
