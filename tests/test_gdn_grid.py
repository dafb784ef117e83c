"""Gated DeltaNet prefill on the slot's block grid (``recipes/qwen3_5._aligned_prefill``).

The chunked delta rule rounds by where its 64-token blocks start. A follow-up turn restored
at a message end prefills from there, the same prompt without the cache from token 0: for
the two to compute the same bits, every block must start at the same absolute position with
the same state. The slot therefore keeps the matrix at its block's start and the inputs of
the block's tokens so far (``state.gdn.block``, ``state.gdn.stash``, ``state.gdn.grid``), and
each prefill chunk re-runs those before its own tokens.

These tests call one layer's mixer with the same inputs cut into different chunks and
compare the outputs and every state row bitwise, on the reference path (Transformers' torch
rule) and the CUDA path's pieces (Triton's CPU interpreter; the torch rule stands in for
flash-linear-attention's kernels on the CPU)."""

from __future__ import annotations

import pytest
import torch

from flare.prepare.attention import PagedBatch
from flare.prepare.recipes import qwen3_5 as Q
from tests.rig import load_rig

GDN = (Q.CONV_STATE, Q.RECURRENT_STATE, Q.BLOCK_STATE, Q.STASH, Q.GRID)


@pytest.fixture(scope="module")
def tokens(hybrid_core):
    r = load_rig(hybrid_core)
    mod = next(m for m in r.model.modules() if type(m).__name__ == "PagedGatedDeltaNet" and m.state_index == 1)
    g = torch.Generator().manual_seed(7)
    n, dt = 300, r.v[Q.CONV_STATE].dtype
    mixed = torch.randn(n, mod.conv_dim, generator=g).to(dt)
    b = torch.randn(n, mod.num_v_heads, generator=g).to(dt)
    a = torch.randn(n, mod.num_v_heads, generator=g).to(dt)
    return mixed, b, a


class Layer:
    """One GDN layer's mixer over a rig's state buffers."""

    def __init__(self, core, attention: str, caps=None, device: str = "cpu"):
        self.r = load_rig(core, device=device)
        self.device = device
        self.mod = next(m for m in self.r.model.modules()
                        if type(m).__name__ == "PagedGatedDeltaNet" and m.state_index == 1)
        self.attention = attention
        # Program capacities (the mixer runs any): the core's, or others (below 64, not multiples of 64).
        self.caps = sorted(caps or self.r.m.capacities.prefill_capacities)
        self.len = {}

    def batch(self, slots, positions, valid, single) -> PagedBatch:
        v = self.r.v
        return PagedBatch(kv=v["kv"], page_table=v["state.page_table"], token_slot=slots, positions=positions,
                          slot_mapping=torch.full_like(slots, -1), valid=valid, impl=self.attention,
                          single_slot=single, state={n: v[n] for n in GDN})

    def mix(self, paged, mixed, b, a):
        fn = Q._mix_triton if self.attention == "triton" else Q._mix_torch
        return fn(self.mod, paged, mixed, b, a)

    def prefill(self, slot, mixed, b, a):
        """One chunk in the smallest program capacity that holds it; returns its valid rows."""
        n = mixed.shape[0]
        C = next(c for c in self.caps if c >= n)
        pad = lambda t: torch.cat([t, torch.full((C - n, *t.shape[1:]), 3.0, dtype=t.dtype, device=t.device)])  # noqa
        idx = torch.arange(C, device=self.device)
        start = self.len.get(slot, 0)
        valid = idx < n
        paged = self.batch(torch.full((C,), slot, device=self.device), torch.where(valid, start + idx, 0), valid, True)
        out = self.mix(paged, pad(mixed), pad(b), pad(a))
        self.len[slot] = start + n
        return out[:n]

    def run(self, slot, mixed, b, a, cuts):
        """Chunks cut at ``cuts`` and at most the largest capacity long."""
        ends = [0, *cuts, mixed.shape[0]]
        bounds = sorted({*ends, *(k for i, j in zip(ends, ends[1:]) for k in range(i, j, self.caps[-1]))})
        return torch.cat([self.prefill(slot, mixed[i:j], b[i:j], a[i:j]) for i, j in zip(bounds, bounds[1:])])

    def decode(self, slot, mixed, b, a):
        """Decode steps of one slot, one token each."""
        outs = []
        for t in range(mixed.shape[0]):
            dev = self.device
            pos = torch.tensor([self.len[slot]], device=dev)
            paged = self.batch(torch.tensor([slot], device=dev), pos, torch.tensor([True], device=dev), False)
            outs.append(self.mix(paged, mixed[t:t + 1], b[t:t + 1], a[t:t + 1]))
            self.len[slot] += 1
        return torch.cat(outs)

    def rows(self, slot):
        return {n: self.r.v[n][slot].clone() for n in GDN}


def _equal_state(x: Layer, s: int, y: Layer, t: int) -> None:
    a, b = x.rows(s), y.rows(t)
    r = int(a[Q.GRID][1, 1])
    assert torch.equal(a[Q.GRID], b[Q.GRID])
    for n in (Q.CONV_STATE, Q.RECURRENT_STATE, Q.BLOCK_STATE):
        assert torch.equal(a[n], b[n]), n
    assert torch.equal(a[Q.STASH][:, :r], b[Q.STASH][:, :r])  # rows past r are never read


@pytest.mark.parametrize("caps", [None, (16, 40, 100)], ids=["core", "16-40-100"])
@pytest.mark.parametrize("attention", ["reference", "triton"])
def test_any_partition_of_a_prompt_computes_the_same_bits(hybrid_core, tokens, attention, caps):
    """The same 300 tokens in chunks cut at the largest capacity, at five odd places, and
    one token after another for the first 70: every output row and the final state rows
    are bitwise equal; the grid records (S, S mod 64) in each. With the core's capacity
    (128) and with capacities below 64 and not multiples of it. (With the core's capacity
    one token after another for the first 3 and from 60 to 70, across the block's end: a
    single token's stash and row land in the block under way whatever the program's
    capacity, so the tokens between take the path they take in the 16-row programs, where
    every one is cut, with more padded rows; under the interpreter each is a program of
    128 rows.)"""
    mixed, b, a = tokens
    x = Layer(hybrid_core, attention, caps)
    whole = x.run(1, mixed, b, a, [128, 256])
    singles = [*range(1, 71)] if caps else [1, 2, 3, *range(60, 71)]
    for slot, cuts in ((2, [37, 101, 170, 257, 299]), (3, [*singles, 190])):
        got = x.run(slot, mixed, b, a, cuts)
        assert torch.equal(got, whole), (slot, (got - whole).abs().max())
        _equal_state(x, 1, x, slot)
    assert x.rows(1)[Q.GRID][1].tolist() == [300, 300 % 64]  # this layer's (S, r)


@pytest.mark.parametrize("attention", ["reference", "triton"])
def test_a_restored_checkpoint_continues_on_the_grid(hybrid_core, tokens, attention):
    """A checkpoint after 101 tokens (the slot's rows copied, as snapshot and restore do)
    continued in another slot by the remaining 199 gives the bits of the 300 prefilled
    whole; the stash carries the 37 tokens of the block under way."""
    mixed, b, a = tokens
    x = Layer(hybrid_core, attention)
    whole = x.run(1, mixed, b, a, [128, 256])
    x.run(2, mixed[:101], b[:101], a[:101], [])
    assert x.rows(2)[Q.GRID][1].tolist() == [101, 101 - 64]
    for n in GDN:
        x.r.v[n][3].copy_(x.r.v[n][2])
    x.len[3] = 101
    got = x.run(3, mixed[101:], b[101:], a[101:], [])
    assert torch.equal(got, whole[101:])
    _equal_state(x, 1, x, 3)


@pytest.mark.parametrize("attention", ["reference", "triton"])
def test_after_decode_steps_a_chunk_starts_a_grid_of_its_own(hybrid_core, tokens, attention):
    """Decode steps keep no stash: a chunk after them starts a new grid at its first token
    from the recurrent matrix (grid (S, r) counted from there), and its rows agree with the
    same tokens prefilled whole to the rounding of a different partition."""
    mixed, b, a = tokens
    x = Layer(hybrid_core, attention)
    whole = x.run(1, mixed[:200], b[:200], a[:200], [])
    x.run(2, mixed[:100], b[:100], a[:100], [])
    stepped = x.decode(2, mixed[100:103], b[100:103], a[100:103])
    before = x.rows(2)
    tail = x.run(2, mixed[103:200], b[103:200], a[103:200], [])
    assert x.rows(2)[Q.GRID][1].tolist() == [200, (200 - 103) % 64]
    assert not torch.equal(before[Q.BLOCK_STATE], x.rows(2)[Q.BLOCK_STATE])
    got = torch.cat([stepped, tail]).float()
    torch.testing.assert_close(got, whole[100:].float(), atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(x.rows(2)[Q.RECURRENT_STATE], x.rows(1)[Q.RECURRENT_STATE], atol=2e-4, rtol=2e-3)


@pytest.mark.parametrize("attention", ["reference", "triton"])
def test_a_chunk_without_tokens_changes_no_state(hybrid_core, tokens, attention):
    mixed, b, a = tokens
    x = Layer(hybrid_core, attention)
    x.run(1, mixed[:90], b[:90], a[:90], [])
    before = x.rows(1)
    C = x.caps[0]
    valid = torch.zeros(C, dtype=torch.bool)
    x.mix(x.batch(torch.full((C,), 1), torch.zeros(C, dtype=torch.long), valid, True), mixed[:C], b[:C], a[:C])
    after = x.rows(1)
    for n in (Q.RECURRENT_STATE, Q.BLOCK_STATE, Q.STASH, Q.GRID):
        assert torch.equal(before[n], after[n]), n


def _movement_in_torch(mod, paged, rows, slot, count, rule):
    """The CUDA path's prefill with ``_aligned_prefill``'s torch data movement in place of
    ``kernels/gdn_grid.py``'s three launches (the same convolution, gates and rule)."""
    from flare.prepare.kernels import gdn as K

    def inputs(part, valid):
        mixed, b, a = Q._split_rows(mod, part)
        mixed = torch.where((torch.arange(part.shape[0], device=part.device) < valid)[:, None], mixed, 0)
        g, beta = K.gdn_prefill_gates(a, b, mod.A_log, mod.dt_bias, valid.reshape(1).int())
        return *Q._split_heads(mod, mixed), g, beta

    return Q._aligned_prefill(mod, paged, *Q._split_rows(mod, rows), inputs, rule)


def test_the_fused_grid_moves_the_bits_of_the_torch_movement(hybrid_core, tokens, monkeypatch):
    """The CUDA path gathers the stash and the chunk, picks the initial matrix, assembles the
    output rows and writes the state rows in three launches (``kernels/gdn_grid.py``); with
    the torch movement of the reference in their place, chunks on the grid, chunks after
    decode steps (off the grid), a chunk of one token and an empty chunk give the same
    output rows and state rows, bitwise."""
    mixed, b, a = tokens
    x, y = Layer(hybrid_core, "triton"), Layer(hybrid_core, "triton")
    cuts = [(0, 37), (37, 101), (101, 102), (102, 170)]
    for lo, hi in cuts:
        got = x.prefill(1, mixed[lo:hi], b[lo:hi], a[lo:hi])
        with monkeypatch.context() as m:
            m.setattr(Q, "_aligned_prefill_triton", _movement_in_torch)
            want = y.prefill(1, mixed[lo:hi], b[lo:hi], a[lo:hi])
        assert torch.equal(got, want), (lo, hi)
        _equal_state(x, 1, y, 1)
    x.decode(1, mixed[170:173], b[170:173], a[170:173])
    y.decode(1, mixed[170:173], b[170:173], a[170:173])
    got = x.prefill(1, mixed[173:260], b[173:260], a[173:260])
    with monkeypatch.context() as m:
        m.setattr(Q, "_aligned_prefill_triton", _movement_in_torch)
        want = y.prefill(1, mixed[173:260], b[173:260], a[173:260])
    assert x.rows(1)[Q.GRID][1].tolist() == [260, (260 - 173) % 64]
    assert torch.equal(got, want)
    _equal_state(x, 1, y, 1)
    C = x.caps[0]
    empty = lambda layer: layer.batch(torch.full((C,), 1), torch.zeros(C, dtype=torch.long),  # noqa: E731
                                      torch.zeros(C, dtype=torch.bool), True)
    before = x.rows(1)
    x.mix(empty(x), mixed[:C], b[:C], a[:C])
    with monkeypatch.context() as m:
        m.setattr(Q, "_aligned_prefill_triton", _movement_in_torch)
        y.mix(empty(y), mixed[:C], b[:C], a[:C])
    _equal_state(x, 1, y, 1)
    assert all(torch.equal(before[n], x.rows(1)[n]) for n in GDN)
