"""The sampler's one-program-a-row filters and draw (``kernels/sampler.py``) against the
tensor-op definitions in ``sampling.py`` (``filtered``, ``_draw``, ``_verify``).

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


@pytest.mark.parametrize("V", [100, 2048, 5000])
def test_draw_matches_the_tensor_definitions(V):
    gen = torch.Generator().manual_seed(V)
    x = _rows(V, gen)
    rows, draws, near = 0, 0, 0
    for top_k, top_p, min_p in FILTERS:
        xs = x.repeat(8, 1)  # eight draws a row
        n = xs.shape[0]
        tk = torch.full((n,), top_k, dtype=torch.int32)
        tp, mp = torch.full((n,), top_p), torch.full((n,), min_p)
        u = torch.rand(n, generator=gen)
        kept, si, n_keep = S.filtered(xs, tk.long(), tp, mp)
        want = S._draw(kept, si, n_keep, u)
        got = S.choose(xs.to(DEVICE), tk.to(DEVICE), tp.to(DEVICE), mp.to(DEVICE), u.to(DEVICE), kernel=True).cpu()
        skip = _near_boundary(kept, u)
        assert torch.equal(got[~skip], want[~skip]), (top_k, top_p, min_p, got, want)
        # Whatever the rounding, the token is one the filters keep.
        kept_ids = [set(si[i, : int(n_keep[i])].tolist()) for i in range(n)]
        assert all(int(got[i]) in kept_ids[i] for i in range(n)), (top_k, top_p, min_p)
        small = n_keep <= 64
        rows, draws, near = rows + int(small.sum()), draws + int((~skip).sum()), near + int((skip & small).sum())
    # Rows that keep thousands of near-equal terms (the flat and tied rows without a tight
    # filter) may have every target within that bound; a short kept prefix almost never does.
    assert near <= rows // 50, (near, rows)
    assert draws >= len(FILTERS) * 40 // 2, draws


@pytest.mark.parametrize("V", [100, 5000])
def test_verify_matches_the_tensor_definitions(V):
    gen = torch.Generator().manual_seed(7 + V)
    x = _rows(V, gen)
    checked, short = 0, 0
    for top_k, top_p, min_p in FILTERS:
        xs = x.repeat(6, 1)
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
