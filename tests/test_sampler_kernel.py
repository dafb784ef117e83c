"""The sampler's one-program-a-row filters and draw (``kernels/sampler.py``) against the
tensor-op definitions in ``sampling.py`` (``filtered``, ``_draw``, ``_verify``), and its
log-probability block against ``sampling.logprob_block``'s tensor operations.

Without CUDA the kernel runs in Triton's CPU interpreter (conftest.py). The two sum floats
in different orders (block scans with a carried total against one scan of the row), so a
draw may differ only where its target lies within rounding of a cumulative boundary: such
cases are counted and must stay rare; every other draw must pick the same token. Rows
cover peaked and flat distributions, exact ties at the filters' thresholds, every filter
alone and together, vocabularies below, at and across the kernel's block, and rows of
several blocks whose kept prefix ends inside a later block.
"""

from __future__ import annotations

import os

import pytest
import torch

from flare.prepare import sampling as S
from flare.prepare.kernels import sampler as K

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available() else "cuda"


def _rows(V: int, gen: torch.Generator) -> torch.Tensor:
    """Scores of several kinds, one per row."""
    peaked = torch.randn(V, generator=gen) * 4
    flat = torch.randn(V, generator=gen) * 0.05
    ties = torch.randint(0, 6, (V,), generator=gen).float()  # six values, thousands of ties each
    top_tie = torch.full((V,), -3.0)
    top_tie[torch.randperm(V, generator=gen)[:7]] = 2.0  # seven tokens tied at the top
    masked = torch.randn(V, generator=gen)
    masked[torch.randperm(V, generator=gen)[: V // 2]] = float("-inf")  # a grammar mask's -inf
    return torch.stack([peaked, flat, ties, top_tie, masked])


FILTERS = [  # (top_k, top_p, min_p)
    (0, 1.0, 0.0), (1, 1.0, 0.0), (20, 1.0, 0.0), (3000, 1.0, 0.0), (0, 0.5, 0.0), (0, 0.95, 0.0),
    (0, 0.01, 0.0), (0, 1.0, 0.05), (0, 1.0, 0.5), (40, 0.9, 0.02), (7, 0.999, 0.0),
]


def _near_boundary(kept: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Rows whose draw target lies within rounding of a cumulative boundary: closer to one
    than the bound on a float32 sum's error over the row's n kept terms (n * 2^-24 of the
    total), in which two summation orders may place it on different sides."""
    cdf = torch.cumsum(kept.double(), dim=-1)
    target = u.double() * cdf[:, -1]
    n = (kept > 0).sum(dim=-1, keepdim=True).double()
    return ((cdf - target[:, None]).abs() <= 2 * n * 2.0**-24 * cdf[:, -1:]).any(dim=-1)


def _on(*ts):
    return [t.to(DEVICE) for t in ts]


@pytest.mark.parametrize("V", [100, 2048, 5000])
def test_draw_matches_the_tensor_definitions(V):
    """Both sides get the same sorted probabilities (sorted once, on the CPU)."""
    gen = torch.Generator().manual_seed(V)
    x = _rows(V, gen)
    rows, draws, near = 0, 0, 0
    for top_k, top_p, min_p in FILTERS:
        xs = x.repeat(4, 1)  # four draws a row
        n = xs.shape[0]
        tk = torch.full((n,), top_k, dtype=torch.int32)
        tp, mp = torch.full((n,), top_p), torch.full((n,), min_p)
        u = torch.rand(n, generator=gen)
        sp, si = S._sorted(xs)
        kept, _, n_keep = S.filter_sorted(sp, si, tk.long(), tp, mp)
        want = S._draw(kept, si, n_keep, u)
        skip = _near_boundary(kept, u)
        kept_ids = [set(si[i, : int(n_keep[i])].tolist()) for i in range(n)]
        # The default blocks at 100 tokens (one chunk); chunks of 1,024 tokens in blocks of 256 at
        # 2,048 and 5,000, whose rows cross chunks whole and stop in one.
        got = K.draw_sorted(*_on(sp, si, tk, tp, mp, u), **({} if V < 1024 else dict(block=256, chunk=1024))).cpu()
        assert torch.equal(got[~skip], want[~skip]), (top_k, top_p, min_p, got, want)
        # Whatever the rounding, the token is one the filters keep.
        assert all(int(got[i]) in kept_ids[i] for i in range(n)), (top_k, top_p, min_p)
        small = n_keep <= 64
        rows, draws, near = rows + int(small.sum()), draws + int((~skip).sum()), near + int((skip & small).sum())
    # Rows that keep thousands of near-equal terms (the flat and tied rows without a tight
    # filter) may have every target within that bound; a short kept prefix almost never does.
    assert near <= rows // 50, (near, rows)
    assert draws >= len(FILTERS) * 20 // 2, draws


def _dyadic_rows(n: int, V: int, gen: torch.Generator) -> torch.Tensor:
    """Probability rows sorted descending whose values are multiples of 2^-12 summing to 1:
    every partial sum is exact in float32, so no summation order can change a draw."""
    rows = []
    for _ in range(n):
        cuts = torch.sort(torch.randint(0, 4097, (V - 1,), generator=gen)).values
        counts = torch.diff(torch.cat([torch.tensor([0]), cuts, torch.tensor([4096])]))
        if torch.rand(1, generator=gen).item() < 0.3:  # ties: pairs of equal counts
            counts = torch.cat([counts[: V // 2], counts[: V - V // 2]])
            counts[-1] += 4096 - counts.sum()
            counts = counts.clamp(min=0)
            counts[0] += 4096 - counts.sum()
        rows.append(torch.sort(counts.double() / 4096, descending=True).values.float())
    return torch.stack(rows)


@pytest.mark.parametrize("V", [1, 16, 17, 130])
def test_exact_rows_draw_and_verify_as_the_definitions_across_many_blocks(V):
    """On exactly summable rows (``_dyadic_rows``) with 16-token blocks, so that kept
    prefixes cross several blocks and end on or inside them, the kernel's plain draw,
    verdict and redraw equal the definitions' for every filter, including the disabled and
    degenerate ones (top_k <= 0 or >= V, top_p 0 or >= 1, min_p 0 or 1) and draws at 0 and
    just below 1: no case is skipped. One launch: each row carries its own filters."""
    gen = torch.Generator().manual_seed(100 + V)
    combos = [(k, p, m) for k in (-1, 0, 3, 16, V, V + 3) for p in (0.0, 0.5, 0.8125, 1.0, 1.5)
              for m in (0.0, 0.25, 1.0)]
    per = 4  # rows a combination: draws at 0 and just below 1, the most likely token proposed, a random row
    n = len(combos) * per
    sp = _dyadic_rows(n, V, gen)
    si = torch.stack([torch.randperm(V, generator=gen) for _ in range(n)])
    tk = torch.tensor([c[0] for c in combos for _ in range(per)], dtype=torch.int32)
    tp = torch.tensor([c[1] for c in combos for _ in range(per)])
    mp = torch.tensor([c[2] for c in combos for _ in range(per)])
    u = torch.randint(0, 4096, (n,), generator=gen).float() / 4096
    u[::per] = 0.0
    u[1::per] = 1.0 - 2.0**-24
    u_rej = torch.randint(0, 4096, (n,), generator=gen).float() / 4096
    pick = si[torch.arange(n), torch.randint(0, V, (n,), generator=gen)]
    pick[2::per] = si[2::per, 0]  # the most likely token (often the only kept one)
    kept, _, n_keep = S.filter_sorted(sp, si, tk.long(), tp, mp)
    want_plain = S._draw(kept, si, n_keep, u)
    want_tok, want_acc = S._verify(kept, si, pick, u, u_rej)
    plain, tok, acc = K.draw_sorted(*_on(sp, si, tk, tp, mp, u, pick, u_rej), block=16)
    for got, want in ((plain, want_plain), (acc, want_acc), (tok, want_tok)):
        bad = (got.cpu() != want).nonzero().flatten().tolist()
        assert not bad, [combos[i // per] for i in bad[:5]]
    if V > 1:  # the plain draw skips whole chunks (of two blocks) by their sums: draws at 0, near 1, random
        at = torch.arange(n) % per != 2
        got = K.draw_sorted(*_on(sp[at], si[at], tk[at], tp[at], mp[at], u[at]), block=16, chunk=32).cpu()
        bad = (got != want_plain[at]).nonzero().flatten().tolist()
        assert not bad, [combos[int(torch.arange(n)[at][i]) // per] for i in bad[:5]]


def test_a_row_of_nans_draws_its_first_id():
    """A row whose scores are all -inf (a mask that allows nothing) has NaN probabilities:
    nothing is kept, and both paths return the row's first id, never another row's."""
    x = torch.randn(3, 40)
    x[1] = float("-inf")
    tk, tp, mp = torch.zeros(3, dtype=torch.int32), torch.ones(3), torch.zeros(3)
    u = torch.full((3,), 0.5)
    sp, si = S._sorted(x)
    want = S._draw(*S.filter_sorted(sp, si, tk.long(), tp, mp), u)
    got = K.draw_sorted(*_on(sp, si, tk, tp, mp, u), block=16).cpu()
    assert int(got[1]) == int(si[1, 0]) == int(want[1])


@pytest.mark.parametrize("V", [100, 5000])
def test_verify_matches_the_tensor_definitions(V):
    gen = torch.Generator().manual_seed(7 + V)
    x = _rows(V, gen)
    checked, short = 0, 0
    for top_k, top_p, min_p in FILTERS:
        xs = x.repeat(3, 1)  # each of the five kinds of row with each of the three proposals once
        n = xs.shape[0]
        tk = torch.full((n,), top_k, dtype=torch.int32)
        tp, mp = torch.full((n,), top_p), torch.full((n,), min_p)
        u, u_rej = torch.rand(n, generator=gen), torch.rand(n, generator=gen)
        kept, si, n_keep = S.filtered(xs, tk.long(), tp, mp)
        # Proposals: the most likely token, a kept one further down, and one filtered out.
        pick = torch.stack([si[:, 0], si[torch.arange(n), (n_keep - 1) // 2],
                            si[:, -1]], dim=1)[torch.arange(n), torch.arange(n) % 3]
        want_tok, want_acc = S._verify(kept, si, pick, u, u_rej)
        want_plain = S._draw(kept, si, n_keep, u)
        plain, tok, acc = K.draw_sorted(*(t.to(DEVICE) for t in S._sorted(xs)), tk.to(DEVICE), tp.to(DEVICE),
                                        mp.to(DEVICE), u.to(DEVICE), pick.to(DEVICE), u_rej.to(DEVICE))
        at = si == pick[:, None]
        p_x = torch.where(at, kept, 0).sum(-1) / kept.sum(-1)
        rest = torch.where(at, torch.zeros_like(kept), kept)
        # The redraw matters only for a rejected proposal (which leaves some mass behind).
        sure = ~_near_boundary(kept, u) & ((u - p_x).abs() > 1e-4 * p_x) & (want_acc | ~_near_boundary(rest, u_rej))
        assert torch.equal(acc.cpu()[sure], want_acc[sure]), (top_k, top_p, min_p)
        assert torch.equal(tok.cpu()[sure], want_tok[sure]), (top_k, top_p, min_p)
        assert torch.equal(plain.cpu()[sure], want_plain[sure]), (top_k, top_p, min_p)
        # A rejected proposal is never the token drawn instead.
        rejected = ~acc.cpu()
        assert not (tok.cpu()[rejected] == pick[rejected]).any()
        small = n_keep <= 64
        checked, short = checked + int((sure & small).sum()), short + int(small.sum())
    assert checked >= short * 9 // 10, (checked, short)  # short kept prefixes: almost all checked


def test_a_rows_draw_does_not_depend_on_the_batch():
    gen = torch.Generator().manual_seed(3)
    x = _rows(5000, gen).repeat(2, 1)
    n = x.shape[0]
    tk = torch.tensor([0, 20, 1, 3000, 40] * 2, dtype=torch.int32)
    tp = torch.tensor([1.0, 0.9, 1.0, 0.5, 0.95] * 2)
    mp = torch.tensor([0.0, 0.0, 0.3, 0.0, 0.01] * 2)
    u = torch.rand(n, generator=gen)
    args = [t.to(DEVICE) for t in (x, tk, tp, mp, u)]
    together = S.choose(*args, kernel=True).cpu()
    alone = torch.cat([S.choose(*(a[i:i + 1] for a in args), kernel=True).cpu() for i in range(n)])
    assert torch.equal(together, alone)


def test_verify_chain_with_the_kernel_emits_what_the_tensor_ops_emit():
    """``verify_chain`` as verify programs call it, with and without the kernel: peaked
    logits (no target near a boundary), drafts that are partly accepted, penalties and
    every filter; the same tokens, counts and histograms."""
    gen = torch.Generator().manual_seed(5)
    B, W, V = 6, 4, 300
    logits = torch.randn(B, W, V, generator=gen) * 6
    drafts = logits[:, :-1].argmax(-1)  # the most likely tokens: often accepted
    drafts[::2, 1] = (drafts[::2, 1] + 7) % V  # some rejected mid-chain
    count = torch.tensor([3, 2, 3, 0, 1, 3])
    samp = {"temperature": torch.full((B,), 0.8), "top_k": torch.tensor([0, 20, 5, 0, 50, 1], dtype=torch.int32),
            "top_p": torch.tensor([1.0, 0.9, 0.95, 0.5, 1.0, 1.0]),
            "min_p": torch.tensor([0.0, 0.0, 0.05, 0.0, 0.1, 0.0]),
            "repetition": torch.full((B,), 1.1), "presence": torch.full((B,), 0.2), "frequency": torch.zeros(B)}
    hist = torch.zeros(B, V, dtype=torch.int32)
    hist[:, :10] = 1
    args = (logits, drafts, count, torch.ones(B, dtype=torch.bool), hist, samp, torch.arange(B) * 977 + 3,
            torch.full((B,), 11), torch.full((B, 2), -1), torch.zeros(B, dtype=torch.int64), torch.full((B,), 100), V)
    want = S.verify_chain(*args)
    got = S.verify_chain(*(a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args[:5]),
                         {k: v.to(DEVICE) for k, v in samp.items()},
                         *(a.to(DEVICE) for a in args[6:11]), V, kernel=True)
    for g, w in zip(got, want):
        assert torch.equal(g.cpu(), w), (g, w)
    assert int(want[1].sum()) > B  # some drafts were accepted


def _logprob_reference(x: torch.Tensor, tok: torch.Tensor, n: int, vocab: int):
    """``sampling.logprob_block``'s definition with ties ordered by ascending id: (the token's
    value, the n largest values, their ids)."""
    lp = torch.log_softmax(x[:, :vocab].double(), dim=-1)
    order = torch.sort(-lp, dim=-1, stable=True).indices[:, :n]  # descending, equal values by id
    return lp.gather(1, tok[:, None])[:, 0], lp.gather(1, order), order


@pytest.mark.parametrize("V,block", [(100, 4096), (5000, 512), (1030, 512), (20000, 4096)])
def test_logprob_block_matches_log_softmax_and_its_largest_values(V, block):
    """Rows of several kinds (peaked, flat, thousands of exact ties, seven tied at the top, a
    block boundary crossed by the largest values, a block of -inf, -0.0 tied with +0.0), a
    last block with fewer columns than values kept (1,030 = 2 x 512 + 6), tokens out of
    range, 1, 5 and 20 values: the largest ids in order, values within float32 rounding of
    log_softmax computed in double."""
    gen = torch.Generator().manual_seed(11)
    x = torch.cat([_rows(V, gen)[:4], torch.randn(4, V, generator=gen) * 3])
    edge = min(block, V) - 2
    x[5, edge: edge + 4] = 30.0  # the top four straddle a block boundary (or end the row)
    x[6, : min(block, V // 2)] = float("-inf")  # a whole block of -inf logits (or half the row): no NaN
    x[7, :60] = 0.0
    x[7, 1:60:2] = -0.0  # -0.0 and +0.0 tie: ascending ids
    x[7, 60:] = -5.0
    x = torch.cat([x, torch.randn(x.shape[0], 3, generator=gen)], dim=1)  # columns past the vocabulary
    tok = torch.randint(0, V, (x.shape[0],), generator=gen)
    tok[0], tok[1] = V + 2, -3  # out of range: clamped, as the tensor ops do
    tok[6] = V - 1  # a finite logit
    for n in (1, 5, 20):
        got = K.logprob_block(*_on(x, tok), n, V, block=block).cpu()
        value, top, ids = _logprob_reference(x, tok.clamp(0, V - 1), n, V)
        assert torch.isfinite(got[:, : 1 + n].view(torch.float32)[6:]).all()
        vals = got[:, : 1 + n].view(torch.float32).double()
        assert torch.equal(got[:, 1 + n:].long(), ids), (n, got[:, 1 + n:], ids)
        assert (vals[:, 0] - value).abs().max() < 4e-6 * (1 + value.abs().max())
        assert (vals[:, 1:] - top).abs().max() < 4e-6 * (1 + top.abs().max())


def test_logprob_block_rows_do_not_depend_on_the_batch():
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(6, 3000, generator=gen) * 4
    tok = torch.randint(0, 3000, (6,), generator=gen)
    args = _on(x, tok)
    together = K.logprob_block(*args, 8, 3000, block=512).cpu()
    alone = torch.cat([K.logprob_block(args[0][i:i + 1], args[1][i:i + 1], 8, 3000, block=512).cpu()
                       for i in range(6)])
    assert torch.equal(together, alone)


def test_the_programs_log_probability_block_is_the_same_with_the_kernel():
    """``sampling.logprob_block`` as the programs call it (float32 logits wider than the
    sampling vocabulary, int64 tokens), kernel against tensor operations, on rows without
    ties: the same ids, values within float32 rounding."""
    gen = torch.Generator().manual_seed(13)
    V = 3000
    logits = torch.randn(4, V + 8, generator=gen) * 5
    tok = torch.randint(0, V, (4,), generator=gen)
    ops, ker = (S.logprob_block(*_on(logits, tok), 6, V, kernel=kernel).cpu() for kernel in (False, True))
    assert ker.dtype == ops.dtype and ker.shape == ops.shape == (4, 13)
    assert torch.equal(ker[:, 7:], ops[:, 7:])
    assert (ker[:, :7].view(torch.float32) - ops[:, :7].view(torch.float32)).abs().max() < 1e-5

@pytest.mark.parametrize("V", [100, 1000, 4096 + 17])
def test_the_split_softmax_is_torchs_within_rounding(V):
    """``softmax_rows`` (chunks of 64: several a row, a last partial one) against torch.softmax:
    peaked, flat and tied rows, a row with a chunk of -inf only, within float32 rounding; a row
    of -inf only, a row with one NaN and one with a +inf come out NaN where torch's does; rows do
    not depend on the batch."""
    gen = torch.Generator().manual_seed(15)
    x = _rows(V, gen)
    x[4, :64] = float("-inf")  # (the masked row: its first chunk has no mass)
    want = torch.softmax(x.double(), dim=-1)
    got = K.softmax_rows(*_on(x), chunk=64).cpu()
    assert got.dtype == torch.float32 and got.shape == x.shape
    assert ((got.double() - want).abs() <= 1e-6 * want + 1e-12).all(), ((got.double() - want).abs() / want).max()
    assert torch.equal(got[4, :64], torch.zeros(64))
    alone = torch.cat([K.softmax_rows(*_on(x[i:i + 1]), chunk=64).cpu() for i in range(x.shape[0])])
    assert torch.equal(got, alone)
    bad = torch.randn(3, V, generator=gen)
    bad[0] = float("-inf")
    bad[1, V // 2] = float("nan")
    bad[2, V - 1] = float("inf")
    assert torch.equal(torch.isnan(K.softmax_rows(*_on(bad), chunk=64).cpu()), torch.isnan(torch.softmax(bad, dim=-1)))
    assert torch.isnan(torch.softmax(bad[:2], dim=-1)).all()


@pytest.mark.parametrize("kernel", [False, True])
def test_rows_whose_slots_ask_for_no_log_probabilities_get_zeros(kernel):
    """``wants``: rows whose slot's flag is 0 get zeros (the kernels read none of their logits),
    the others exactly the block they get without the gate; a flag is read through the row's slot."""
    gen = torch.Generator().manual_seed(14)
    V = 3000
    logits = torch.randn(4, V + 8, generator=gen) * 5
    tok = torch.randint(0, V, (4,), generator=gen)
    slots = torch.tensor([3, 1, 0, 2])  # row 0 on slot 3, ...
    on = torch.tensor([0, 1, 0, 1], dtype=torch.int32)  # slots 1 and 3 ask: rows 0 and 1
    full = S.logprob_block(*_on(logits, tok), 6, V, kernel=kernel).cpu()
    got = S.logprob_block(*_on(logits, tok), 6, V, kernel=kernel, wants=tuple(_on(slots, on))).cpu()
    assert got.shape == full.shape == (4, 13)
    assert torch.equal(got[:2], full[:2])
    assert torch.equal(got[2:], torch.zeros(2, 13, dtype=torch.int32))
    assert full[2:].abs().sum() > 0


def test_top_p_of_one_keeps_every_token_even_where_the_mass_rounds_to_one():
    """A peaked row whose float32 mass before its tail tokens rounds to 1: with top-p 1 (the
    default of OpenAI clients, as top-k 0) every token stays a candidate on both paths, and
    the kernel finds that without walking the row; top-p just under 1 still cuts the tail."""
    V = 3000
    x = torch.full((2, V), -30.0)
    x[:, 0] = 30.0  # p0 rounds to 1 in float32: the mass before every other token is 1
    sp, si = S._sorted(x)
    assert float(torch.cumsum(sp, -1)[0, 0]) == 1.0
    top_k = torch.zeros(2, dtype=torch.int32)
    top_p = torch.tensor([1.0, 0.999])
    min_p = torch.zeros(2)
    kept, _, n_keep = S.filter_sorted(sp, si, top_k, top_p, min_p)
    assert n_keep.tolist() == [V, 1]
    u = torch.tensor([0.5, 0.5])
    assert torch.equal(K.draw_sorted(*_on(sp, si, top_k, top_p, min_p, u)).cpu(), S._draw(kept, si, n_keep, u))
    # A tail token proposed with u_accept = 0: a candidate (accepted, p > 0) only where top-p 1
    # kept the tail; the kernel and the tensor ops agree.
    proposal = si[:, 5].clone()
    zero = torch.zeros(2)
    want = S._verify(kept, si, proposal, zero, u)
    got = K.draw_sorted(*_on(sp, si, top_k, top_p, min_p, zero, proposal, u))
    assert want[1].tolist() == [True, False]
    assert torch.equal(got[1].cpu(), want[0]) and torch.equal(got[2].cpu(), want[1])


def test_the_commit_in_one_launch_writes_what_the_tensor_commit_writes():
    """``commit_rows``: the slot state a sampled token leaves (pending token, generated count,
    counter, done flag, histogram) and the completion record, as the programs' tensor commit
    (``ProgramSet._commit_rows_eager`` and its index_copy / index_add writes) leaves them: a row
    that hits a stop id, one that reaches its length, one running on, one not live (finished
    before), a padding row on the null slot; and the log-probability block into the record's
    columns."""
    from types import SimpleNamespace

    from flare.prepare.programs import ProgramSet

    gen = torch.Generator().manual_seed(17)
    S_, V, NS = 6, 50, 3
    state = {"state.pending": torch.randint(0, V, (S_,), generator=gen, dtype=torch.int32),
             "state.generated": torch.tensor([0, 4, 9, 2, 5, 1], dtype=torch.int32),
             "state.counter": torch.randint(0, 1 << 40, (S_,), generator=gen),
             "state.done": torch.tensor([0, 0, 0, 0, 1, 0], dtype=torch.int32),
             "state.hist": torch.randint(0, 3, (S_, V), generator=gen, dtype=torch.int32),
             "state.stop_ids": torch.tensor([[-1] * NS, [7, -1, -1], [-1] * NS, [11, 12, -1], [-1] * NS, [-1] * NS],
                                            dtype=torch.int32),
             "state.max_new": torch.tensor([0, 100, 10, 100, 100, 100], dtype=torch.int32)}
    slots = torch.tensor([1, 2, 3, 4, 0])
    tok = torch.tensor([7, 30, 13, 21, 5])
    live = torch.tensor([True, True, True, False, False])
    want = {k: t.clone() for k, t in state.items()}
    glue = SimpleNamespace(v=want, caps=SimpleNamespace(vocab_size=V))
    pending, generated, counter, done, hist_at, count, record = ProgramSet._commit_rows_eager(glue, slots, live, tok)
    for name, rows in (("pending", pending), ("generated", generated), ("counter", counter), ("done", done)):
        want[f"state.{name}"].index_copy_(0, slots, rows)
    want["state.hist"].view(-1).index_add_(0, hist_at, count)
    logits = torch.randn(5, V + 4, generator=gen) * 3
    lp = S.logprob_block(*_on(logits, tok), 2, V, kernel=True).cpu()
    got = {k: t.clone().to(DEVICE) for k, t in state.items()}
    completion = torch.full((5, 4 + lp.shape[1]), -7, dtype=torch.int32, device=DEVICE)
    K.commit_rows(got, *_on(slots, live, tok), completion)
    K.logprob_block(logits.to(DEVICE), tok.to(DEVICE), 2, V, out=completion[:, 4:])
    for name in want:
        assert torch.equal(got[name].cpu(), want[name]), name
    assert torch.equal(completion.cpu()[:, :4], record)
    assert torch.equal(completion.cpu()[:, 4:], lp)
    assert record[:, 3].tolist() == [1, 2, 0, -1, -1]  # stop, length, running, inactive twice


def test_the_commit_before_the_head_in_one_launch():
    """``commit_hidden``: a live row's slot takes its hidden vector and one more length, as the
    decode step's tensor commit; rows not live (padding on the null slot, a finished slot) leave
    their slots as they were."""
    gen = torch.Generator().manual_seed(5)
    state = {"state.hidden": torch.randn(5, 40, generator=gen), "state.len": torch.tensor([0, 3, 9, 4, 7],
                                                                                          dtype=torch.int32)}
    slots, live = torch.tensor([3, 0, 1, 4]), torch.tensor([True, False, True, False])
    hidden = torch.randn(4, 40, generator=gen)
    want = {k: t.clone() for k, t in state.items()}
    old = want["state.hidden"].index_select(0, slots)
    want["state.hidden"].index_copy_(0, slots, torch.where(live[:, None], hidden, old))
    want["state.len"].index_copy_(0, slots, (want["state.len"].index_select(0, slots).long() + live.long()).int())
    got = {k: t.clone().to(DEVICE) for k, t in state.items()}
    K.commit_hidden(got, *_on(slots, live, hidden))
    for name in want:
        assert torch.equal(got[name].cpu(), want[name]), name


@pytest.mark.skipif(DEVICE == "cuda", reason="the tiny core's rig holds its arena on the CPU: the kernels run there "
                    "under Triton's interpreter (on the GPU the suite's cores run them, the CUDA default)")
def test_programs_with_the_kernels_commit_what_the_tensor_programs_commit(tiny_core):
    """A core's prefill and decode programs with the sampler's and the commit's kernels
    (``--sampler kernel``) against the same programs in tensor operations, greedy (the draw
    cannot differ): the same completion records and the same slot state after every program
    (tokens, counts, counters, flags, histograms, hidden vectors, lengths); slot 1 asks for
    log-probabilities, slot 2 not: its records' blocks are zeros on both paths, slot 1's carry
    the same ids and values within float32 rounding."""
    from flare.core import interface as io
    from tests.rig import admit, decode, load_rig, prefill

    rigs = [load_rig(tiny_core, seed=1, sampler_kernel=kernel) for kernel in (False, True)]
    names = ["state.pending", "state.generated", "state.counter", "state.done", "state.hist", "state.hidden",
             "state.len"]
    records, blocks = [], []
    for r in rigs:
        got, rows = [], {1: [], 2: []}
        for slot, prompt in ((1, list(range(40, 57))), (2, list(range(300, 309)))):
            admit(r, slot, prompt, r.pages(4), seed=slot, logprobs=slot == 1)
            got.append(prefill(r, slot, prompt)[2])
            rows[slot].append(r.v[io.PREFILL_COMPLETION][0, 4:].clone())
        for step in range(3):
            got.append(decode(r, [2, 1], [int(r.v["state.pending"][s]) for s in (2, 1)])[1])
            rows[2].append(r.v[io.DECODE_COMPLETION][0, 4:].clone())
            rows[1].append(r.v[io.DECODE_COMPLETION][1, 4:].clone())
        records.append(got)
        blocks.append({s: torch.stack(b) for s, b in rows.items()})
    assert records[0] == records[1]
    for name in names:
        assert torch.equal(rigs[0].v[name], rigs[1].v[name]), name
    n = rigs[0].m.capacities.max_logprobs
    assert n > 0 and blocks[0][1].shape == (4, 1 + 2 * n)
    for b in blocks:
        assert torch.equal(b[2], torch.zeros_like(b[2])) and b[1][:, 1 + n:].abs().sum() > 0
    assert torch.equal(blocks[0][1][:, 1 + n:], blocks[1][1][:, 1 + n:])
    vals = [b[1][:, : 1 + n].view(torch.float32) for b in blocks]
    assert (vals[0] - vals[1]).abs().max() < 1e-5
