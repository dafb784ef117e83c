"""Mixture-of-experts pieces (kernels/moe.py): routing against Transformers' router,
the expert plan, and the Triton grouped GEMMs against a float64 loop over pairs.

Without CUDA the kernels run in Triton's CPU interpreter (conftest.py sets
TRITON_INTERPRET=1), so the shapes are tiny."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available() else "cuda"

pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot be tested")

from flare.prepare.kernels import moe  # noqa: E402
from flare.prepare.kernels.moe import (  # noqa: E402
    combine,
    combine_triton,
    experts_torch,
    experts_decode,
    experts_triton,
    invariant_linear,
    max_tiles,
    plan,
    plan_triton,
    route,
    route_logits,
    route_plan,
    route_rows,
    router_gemv,
)

F64 = torch.float64


def _weights(E, H, I, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(E, 2 * I, H, generator=g, dtype=F64) * H ** -0.5).to(dtype).to(DEVICE)
    down = (torch.randn(E, H, I, generator=g, dtype=F64) * I ** -0.5).to(dtype).to(DEVICE)
    return gate_up, down


def _loop64(x, weights, ids, gate_up, down):
    """Pair by pair in float64: the definition."""
    E = gate_up.shape[0]
    out = torch.zeros(x.shape, dtype=F64)
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e >= E:
                continue
            gu = gate_up[e].to(F64) @ x[t].to(F64)
            g, u = gu.chunk(2)
            out[t] += float(weights[t, j]) * (down[e].to(F64) @ (F.silu(g) * u))
    return out


def _added(got, residual, out):
    """``got`` is ``residual + out`` in out's dtype: the same bits on the GPU; in the CPU
    interpreter, whose float32 -> bfloat16 conversion truncates, within its rounding."""
    if DEVICE == "cuda" or out.dtype == torch.float32:
        assert torch.equal(got, residual + out)
    else:
        torch.testing.assert_close(got.float(), residual.float() + out.float(), rtol=2 ** -7, atol=0)


def test_route_matches_transformers_router_and_breaks_ties_by_index():
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    cfg = Qwen3MoeConfig(hidden_size=32, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True)
    router = Qwen3MoeTopKRouter(cfg)
    g = torch.Generator().manual_seed(0)
    router.weight.data = torch.randn(16, 32, generator=g)
    x = torch.randn(9, 32, generator=g)
    _, ref_w, ref_ids = router(x)
    w, ids = route(x, router.weight, 4, True)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w.float())
    # Exact ties (a zero router row scores every expert alike): the lowest indices, in order.
    w, ids = route(torch.zeros(2, 32), router.weight, 4, True)
    assert ids.tolist() == [[0, 1, 2, 3]] * 2
    torch.testing.assert_close(w, torch.full((2, 4), 0.25))
    # Invalid rows: the sentinel expert and weight 0.
    w, ids = route(x[:3], router.weight, 4, False, valid=torch.tensor([True, False, True]))
    assert ids[1].tolist() == [16] * 4 and w[1].abs().sum() == 0 and (ids[0] < 16).all()


def test_plan_groups_pairs_by_expert_in_static_tiles():
    ids = torch.tensor([[3, 1], [1, 5], [5, 5 + 1], [1, 3]])  # E = 6: 6 is the sentinel
    p = plan(ids, 6, 2)
    flat = ids.reshape(-1)
    order = p.order.long()
    assert flat[order].tolist() == sorted(flat.tolist())  # stable: equal experts keep pair order
    assert order[:3].tolist() == [1, 2, 6]  # expert 1's pairs in pair order
    assert p.tile_expert.numel() == max_tiles(8, 6, 2)
    rows = {}
    for e, a, b in zip(p.tile_expert.tolist(), p.tile_start.tolist(), p.tile_end.tolist()):
        if e >= 0:
            rows.setdefault(e, []).extend(range(a, min(a + 2, b)))
    assert {e: flat[order[r]].tolist() for e, r in rows.items()} == {1: [1, 1, 1], 3: [3, 3], 5: [5, 5]}
    assert sum(len(r) for r in rows.values()) == 7  # the sentinel pair is in no tile


@pytest.mark.parametrize("T,k,E,block_m,dead", [
    (1, 2, 6, 2, 0), (4, 2, 6, 2, 1), (5, 8, 256, 64, 2), (128, 8, 256, 64, 100),  # prefill.128, 16 live tokens
    (300, 10, 512, 64, 7), (130, 8, 128, 16, 0), (64, 4, 300, 64, 0)])  # more pairs than a chunk; E not 2^n
def test_triton_plan_is_the_plan_to_the_bit(T, k, E, block_m, dead):
    """plan_triton (two launches) gives plan's order and tiles exactly, an unused tile's start
    and end included: the sentinel pairs (dead rows route to E) last, equal experts in pair
    order, routing crowded onto a few experts as well as spread over all of them."""
    g = torch.Generator().manual_seed(T * 1000 + E)
    for crowd in (E, 3):
        ids = torch.stack([torch.randperm(E, generator=g)[:k] % crowd for _ in range(T)])
        ids[T - dead:] = E
        ids = ids.to(DEVICE)
        want, got = plan(ids, E, block_m), plan_triton(ids, E, block_m)
        assert got.block_m == want.block_m
        for name in ("order", "tile_expert", "tile_start", "tile_end"):
            a, b = getattr(got, name), getattr(want, name)
            assert a.dtype == b.dtype == torch.int32 and torch.equal(a.cpu(), b.cpu()), (name, crowd)


@pytest.mark.parametrize("T,block_m", [(1, 16), (3, 16), (24, 16), (24, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_grouped_experts_match_the_pair_loop(T, block_m, dtype):
    E, H, I, k = 8, 32, 48, 3
    gate_up, down = _weights(E, H, I, 1, dtype)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(T, H, generator=g, dtype=F64).to(dtype).to(DEVICE)
    router = torch.randn(E, H, generator=g).to(dtype).to(DEVICE)
    valid = torch.ones(T, dtype=torch.bool, device=DEVICE)
    valid[T // 2] = T == 1  # one padded row when there are several
    w, ids = route(x, router, k, True, valid)
    got = experts_triton(x, w, ids, gate_up, down, block_m=block_m)
    ref = _loop64(x.cpu(), w.cpu(), ids.cpu(), gate_up.cpu(), down.cpu())
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got.cpu().to(F64), ref, **tol)
    assert torch.equal(got[~valid].cpu(), torch.zeros_like(got[~valid].cpu()))
    torch.testing.assert_close(experts_torch(x, w, ids, gate_up, down).cpu().to(F64), ref, **tol)


@pytest.mark.parametrize("T,k", [(1, 3), (3, 3), (8, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_decode_gemvs_match_the_pair_loop(T, k, dtype):
    """The decode kernels (a GEMV program per pair and feature block, no tl.dot, so bfloat16
    runs in the CPU interpreter too; down summed over each token's pairs in slot order)
    against float64, with a padded row and, at (8, 8), experts
    shared by several tokens; blocks narrower than the features and K not a block multiple."""
    E, H, I = 8, 40, 24
    gate_up, down = _weights(E, H, I, 3, dtype)
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, H, generator=g, dtype=F64).to(dtype).to(DEVICE)
    router = torch.randn(E, H, generator=g).to(dtype).to(DEVICE)
    valid = torch.ones(T, dtype=torch.bool, device=DEVICE)
    valid[T // 2] = T == 1
    w, ids = route(x, router, k, True, valid)
    got = experts_decode(x, w, ids, gate_up, down, gate_up_blocks=(8, 16, 4), down_blocks=(16, 16, 4),
                         wide_down=False)
    ref = _loop64(x.cpu(), w.cpu(), ids.cpu(), gate_up.cpu(), down.cpu())
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got.cpu().to(F64), ref, **tol)
    assert torch.equal(got[~valid].cpu(), torch.zeros_like(got[~valid].cpu()))
    # The same roundings as the torch reference and the tiled kernels (whose bfloat16
    # tl.dot the CPU interpreter gets wrong): equal up to summation order.
    torch.testing.assert_close(got, experts_torch(x, w, ids, gate_up, down), **tol)
    if dtype == torch.float32 or DEVICE == "cuda":
        torch.testing.assert_close(got, experts_triton(x, w, ids, gate_up, down), **tol)
    # The down kernel that loads a token's pairs together: the same sums, slot order kept.
    wide = experts_decode(x, w, ids, gate_up, down, gate_up_blocks=(8, 16, 4), down_blocks=(16, 16, 4),
                          wide_down=True)
    torch.testing.assert_close(wide.cpu().to(F64), ref, **tol)
    torch.testing.assert_close(wide, got, **tol)
    assert torch.equal(wide[~valid].cpu(), torch.zeros_like(wide[~valid].cpu()))
    # The decoder layer's residual added in the down kernel: the bits of the add apart.
    residual = torch.randn(T, H, generator=g, dtype=F64).to(dtype).to(DEVICE)
    added = experts_decode(x, w, ids, gate_up, down, gate_up_blocks=(8, 16, 4), down_blocks=(16, 16, 4),
                           residual=residual)
    _added(added, residual, wide)
    with pytest.raises(ValueError, match="wide down"):
        experts_decode(x, w, ids, gate_up, down, wide_down=False, residual=residual)
    with pytest.raises(ValueError, match="residual"):
        experts_decode(x, w, ids, gate_up, down, residual=residual[:, 1:])


# (E, H): all experts routed, a power of two with K not a block multiple, and E not a power of
# two (the routing's masked tile): 128 and 300 on the GPU, 300 past 256; under the interpreter,
# which runs a program per token and router row in turn (300 rows: ~20 s), 32 and 40 take the
# same paths.
@pytest.mark.parametrize("E,H", [(8, 40), (128 if DEVICE == "cuda" else 32, 96),
                                 (300 if DEVICE == "cuda" else 40, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_router_gemv_rows_do_not_depend_on_the_batch(E, H, dtype):
    """The decode steps' router GEMV and the shared gate in its launch: the logits of x @ W.T
    (to the model dtype's rounding), a row's bits the same alone and among 5 rows (the block
    of router rows a program takes follows from E alone: on the GPU another block can lay the
    sum over K out otherwise)."""
    g = torch.Generator().manual_seed(E)
    x = torch.randn(5, H, generator=g, dtype=F64).to(dtype).to(DEVICE)
    w = (torch.randn(E, H, generator=g, dtype=F64) * H ** -0.5).to(dtype).to(DEVICE)
    s = (torch.randn(1, H, generator=g, dtype=F64) * H ** -0.5).to(dtype).to(DEVICE)
    logits, gate = router_gemv(x, w, s)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(logits.cpu().to(F64), x.cpu().to(F64) @ w.cpu().to(F64).T, **tol)
    torch.testing.assert_close(gate.cpu().to(F64), x.cpu().to(F64) @ s.cpu().to(F64).T, **tol)
    assert logits.dtype == gate.dtype == dtype and gate.shape == (5, 1)
    alone, gate1 = router_gemv(x[3:4], w, s)
    assert torch.equal(alone, logits[3:4]) and torch.equal(gate1, gate[3:4])
    plain, none = router_gemv(x, w, block_n=2)
    assert none is None
    torch.testing.assert_close(plain, logits, **tol)
    with pytest.raises(ValueError, match="shared gate"):
        router_gemv(x, w, s[:, 1:].contiguous())
    # Routed in the same launch (the token's last program, by tickets): route_rows' weights and
    # ids on these logits to the bit, a padded row routed nowhere, the counters left at zero.
    counts = torch.zeros(8, dtype=torch.int32, device=DEVICE)
    valid = torch.tensor([True, True, False, True, True], device=DEVICE)
    for k, shared in ((min(8, E), s), (2, None)):
        got = router_gemv(x, w, shared, route=(k, True, valid, counts))
        want_w, want_ids = route_rows(got[0], k, True, valid)
        assert torch.equal(got[0], logits) and torch.equal(got[2], want_w) and torch.equal(got[3], want_ids)
        assert (got[3][2] == E).all() and not got[2][2].any() and not counts.any()
    with pytest.raises(ValueError, match="counters"):
        router_gemv(x, w, route=(2, True, None, counts[:4]))
    with pytest.raises(ValueError, match=f"{moe.ROUTE_WARPS} warps"):
        router_gemv(x, w, route=(2, True, None, counts), num_warps=8)


@pytest.mark.parametrize("E,k", [(6, 2), (128, 8), (300 if DEVICE == "cuda" else 40, 10)])
def test_routing_by_ranks_picks_what_the_maxima_pick(monkeypatch, E, k):
    """``ROUTE_RANKS`` (the top k by every expert's rank, one comparison of every two): the ids
    and the weights before renormalisation of the k maxima taken one after another, exact ties
    (a row of equal logits: the lowest indices, in order) and a padded row included; the
    renormalised weights within float32 rounding; and the router launch's routing, by ranks,
    route_rows' by ranks to the bit."""
    g = torch.Generator().manual_seed(E)
    logits = torch.randn(6, E, generator=g)
    logits[1] = 0.5  # every expert tied
    logits[4, : E // 2] = logits[4, E // 2:(E // 2) * 2]  # pairs of ties
    logits = logits.to(DEVICE)
    valid = torch.tensor([True, True, True, False, True, True], device=DEVICE)
    monkeypatch.setattr(moe, "ROUTE_RANKS", False)
    picks = [route_rows(logits, k, renorm, valid) for renorm in (False, True)]
    monkeypatch.setattr(moe, "ROUTE_RANKS", True)
    ranks = [route_rows(logits, k, renorm, valid) for renorm in (False, True)]
    assert torch.equal(ranks[0][1], picks[0][1]) and torch.equal(ranks[1][1], picks[1][1])
    assert ranks[1][1][1].tolist() == list(range(k)) and (ranks[1][1][3] == E).all()
    assert torch.equal(ranks[0][0], picks[0][0])
    torch.testing.assert_close(ranks[1][0], picks[1][0], atol=0, rtol=2.0 ** -22)
    H = 32
    x = torch.randn(6, H, generator=g).to(DEVICE)
    w = (torch.randn(E, H, generator=g) * H ** -0.5).to(DEVICE)
    counts = torch.zeros(8, dtype=torch.int32, device=DEVICE)
    got = router_gemv(x, w, route=(k, True, valid, counts))
    want_w, want_ids = route_rows(got[0], k, True, valid)
    assert torch.equal(got[2], want_w) and torch.equal(got[3], want_ids) and not counts.any()
    with pytest.raises(ValueError, match="ranks=True"):
        router_gemv(x, w, route=(k, True, valid, counts), ranks=False)
    with pytest.raises(ValueError, match=f"top {E + 1} of {E}"):  # more picks than experts: refused
        route_rows(logits, E + 1, True, valid)
    with pytest.raises(ValueError, match=f"top {E + 1} of {E}"):
        router_gemv(x, w, route=(E + 1, True, valid, counts))


@pytest.mark.skipif(DEVICE != "cuda", reason="the tickets' race is the GPU's (the interpreter runs programs in order)")
@pytest.mark.parametrize("ranks", [False, True], ids=["maxima", "ranks"])
def test_routing_in_the_router_launch_under_many_calls_on_the_gpu(monkeypatch, ranks):
    """On the GPU, where the router's programs race for the tickets: over 300 calls of fresh
    logits (60 to 512 experts, 1 to 16 tokens, a padded row, a shared gate or none), every call
    routes as ``route_rows`` on its logits, to the bit, and leaves the counters at zero (top k by
    maxima and by ranks)."""
    monkeypatch.setattr(moe, "ROUTE_RANKS", ranks)
    counts = torch.zeros(64, dtype=torch.int32, device=DEVICE)
    g = torch.Generator().manual_seed(7)
    for i in range(300):
        E, H, T = (60, 128, 256, 512)[i % 4], 256, 1 + i % 16
        k = min(8, E)
        x = torch.randn(T, H, generator=g).to(torch.bfloat16).to(DEVICE)
        w = (torch.randn(E, H, generator=g) * H ** -0.5).to(torch.bfloat16).to(DEVICE)
        s = (torch.randn(1, H, generator=g) * H ** -0.5).to(torch.bfloat16).to(DEVICE) if i % 2 else None
        valid = torch.ones(T, dtype=torch.bool, device=DEVICE)
        valid[i % T] = T == 1
        logits, _, weights, ids = router_gemv(x, w, s, route=(k, True, valid, counts))
        want_w, want_ids = route_rows(logits, k, True, valid)
        assert torch.equal(weights, want_w) and torch.equal(ids, want_ids), i
        assert not counts.any(), i


@pytest.mark.parametrize("T,k,I_s", [(1, 3, 24), (3, 2, 40), (4, 8, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_decode_gemvs_fold_a_gated_shared_expert(T, k, I_s, dtype):
    """A gated shared expert as one more pair of every token (``experts_decode(shared=...)``):
    the routed sum plus sigmoid(gate) * the shared MLP, against float64 and against the
    routed kernels plus the shared expert run apart, with a shared intermediate size equal
    to, wider and narrower than the routed one's; a padded token gets nothing."""
    E, H, I = 8, 40, 24
    gate_up, down = _weights(E, H, I, 5, dtype)
    g = torch.Generator().manual_seed(10 + T)
    s_gate_up = (torch.randn(2 * I_s, H, generator=g, dtype=F64) * H ** -0.5).to(dtype).to(DEVICE)
    s_down = (torch.randn(H, I_s, generator=g, dtype=F64) * I_s ** -0.5).to(dtype).to(DEVICE)
    x = torch.randn(T, H, generator=g, dtype=F64).to(dtype).to(DEVICE)
    router = torch.randn(E, H, generator=g).to(dtype).to(DEVICE)
    gate = (torch.randn(T, 1, generator=g, dtype=F64) * 2).to(dtype).to(DEVICE)
    valid = torch.ones(T, dtype=torch.bool, device=DEVICE)
    valid[T // 2] = T == 1
    w, ids = route(x, router, k, True, valid)
    got = experts_decode(x, w, ids, gate_up, down, shared=(s_gate_up, s_down, gate), gate_up_blocks=(8, 16, 4),
                         down_blocks=(16, 16, 4))
    x64 = x.cpu().to(F64)
    sg, su = (x64 @ s_gate_up.cpu().to(F64).T).chunk(2, dim=-1)
    shared64 = torch.sigmoid(gate.cpu().to(F64)) * ((F.silu(sg) * su) @ s_down.cpu().to(F64).T)
    ref = _loop64(x.cpu(), w.cpu(), ids.cpu(), gate_up.cpu(), down.cpu()) + valid.cpu()[:, None] * shared64
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got.cpu().to(F64), ref, **tol)
    assert torch.equal(got[~valid].cpu(), torch.zeros_like(got[~valid].cpu()))
    # Apart: the routed kernels, then the shared MLP in the model dtype (Transformers' roundings).
    sg, su = F.linear(x, s_gate_up).chunk(2, dim=-1)
    apart = experts_decode(x, w, ids, gate_up, down) + torch.sigmoid(gate) * F.linear(F.silu(sg) * su, s_down)
    torch.testing.assert_close(got[valid], apart[valid], **tol)
    residual = torch.randn(T, H, generator=g, dtype=F64).to(dtype).to(DEVICE)
    added = experts_decode(x, w, ids, gate_up, down, shared=(s_gate_up, s_down, gate), gate_up_blocks=(8, 16, 4),
                           down_blocks=(16, 16, 4), residual=residual)
    _added(added, residual, got)
    with pytest.raises(ValueError, match="wide down"):
        experts_decode(x, w, ids, gate_up, down, shared=(s_gate_up, s_down, gate), wide_down=False)
    with pytest.raises(ValueError, match="expected"):
        experts_decode(x, w, ids, gate_up, down, shared=(s_gate_up, s_down[:, 1:].contiguous(), gate))


@pytest.mark.parametrize("zero_centred", [False, True])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_router_and_experts_take_the_add_and_norm_in_their_loads(dtype, shared, zero_centred):
    """A decode step's add and post-attention norm in the router's and the experts' loads
    (``router_gemv(norm=)``, ``experts_decode(norm=)``): the sum written by the router (to the
    bit), the logits, the routing and the layer's output (with a shared expert folded or none,
    the residual added) those of the norm's own launch before the same kernels, within the
    rounding of the norm's output (the norm in the loads scales the rows by the weight first and
    by the reciprocal RMS after the sums); a token's results the same alone; padded rows routed
    nowhere."""
    from flare.prepare.kernels.gemv import Norm
    from flare.prepare.kernels.rownorm import rms_norm

    E, H, I, T, k = 16, 48, 24, 3, 4
    gate_up, down = _weights(E, H, I, 9, dtype)
    g = torch.Generator().manual_seed(3 + shared + 2 * zero_centred)
    x = torch.randn(T, H, generator=g, dtype=F64).to(dtype).to(DEVICE)
    residual = (torch.randn(T, H, generator=g, dtype=F64) * 3).to(dtype).to(DEVICE)
    nw = (torch.randn(H, generator=g, dtype=F64) * 0.3 + (0 if zero_centred else 1)).to(dtype).to(DEVICE)
    router = (torch.randn(E, H, generator=g, dtype=F64) * H ** -0.5).to(dtype).to(DEVICE)
    s_gate = (torch.randn(1, H, generator=g, dtype=F64) * H ** -0.5).to(dtype).to(DEVICE) if shared else None
    s_gate_up = (torch.randn(2 * I, H, generator=g, dtype=F64) * H ** -0.5).to(dtype).to(DEVICE)
    s_down = (torch.randn(H, I, generator=g, dtype=F64) * I ** -0.5).to(dtype).to(DEVICE)
    valid = torch.tensor([True, False, True], device=DEVICE)
    counts = torch.zeros(8, dtype=torch.int32, device=DEVICE)
    spec = Norm(nw, 1e-6, zero_centred, residual)

    def layer(norm):
        if norm is None:
            h, total = rms_norm(x, nw, 1e-6, zero_centred, residual=residual)
        else:
            h = x
        logits, gate, w, ids, *total_ = router_gemv(h, router, s_gate, route=(k, True, valid, counts), norm=norm)
        if norm is not None:
            total = total_[0]
            h = total
        folded = (s_gate_up, s_down, gate) if shared else None
        out = experts_decode(h, w, ids, gate_up, down, shared=folded, gate_up_blocks=(8, 16, 4),
                             down_blocks=(16, 16, 4), residual=total, norm=norm)
        return logits, w, ids, total, out

    apart, folded = layer(None), layer(spec)
    assert not counts.any()
    _added(folded[3], residual, x)  # the sum, as the norm's launch rounds it
    assert torch.equal(folded[3], apart[3])
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    for got, want in zip(folded[:2] + folded[4:], apart[:2] + apart[4:]):
        torch.testing.assert_close(got.float(), want.float(), **tol)
    # (the same experts where the k-th and the next logit are apart by more than the roundings)
    top = apart[0].float().sort(dim=-1, descending=True).values
    clear = valid & (top[:, k - 1] - top[:, k] > 5e-2)
    assert clear.any() and torch.equal(folded[2][clear], apart[2][clear]) and (folded[2][~valid] == E).all()
    x, residual = x[2:3], residual[2:3]
    valid, spec = valid[2:3], spec._replace(residual=residual)
    alone = layer(spec)
    for got, want in zip(alone, folded):
        assert torch.equal(got, want[2:3])
    with pytest.raises(ValueError, match="residual"):
        router_gemv(x, router, route=(k, True, valid, counts), norm=spec._replace(residual=None))


@pytest.mark.parametrize("N", [1, 24, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_invariant_linear_rows_do_not_depend_on_the_batch(N, dtype):
    """The router's GEMM: against float64, and each row bitwise the same computed alone, among
    3 other rows, or among 129 (a prefill-sized batch with other companions); K not a
    block multiple. N=1 is a shared expert's gate."""
    K = 200
    g = torch.Generator().manual_seed(N)
    x = torch.randn(130, K, generator=g, dtype=F64).to(dtype).to(DEVICE)
    w = (torch.randn(N, K, generator=g, dtype=F64) * K ** -0.5).to(dtype).to(DEVICE)
    out = invariant_linear(x, w)
    assert out.shape == (130, N) and out.dtype == dtype
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.cpu().to(F64), x.cpu().to(F64) @ w.cpu().to(F64).T, **tol)
    row = 5
    assert torch.equal(invariant_linear(x[row:row + 1], w), out[row:row + 1])
    assert torch.equal(invariant_linear(x[3:7], w)[row - 3], out[row])
    shuffled = torch.cat([x[row:row + 1], x[:row], x[row + 1:]])  # other rows, another tile position
    assert torch.equal(invariant_linear(shuffled, w)[0], out[row])


def _tiles(p):
    """(expert, first row, end row) of every used tile, in order."""
    return [(e, a, b) for e, a, b in zip(p.tile_expert.tolist(), p.tile_start.tolist(), p.tile_end.tolist()) if e >= 0]


@pytest.mark.parametrize("T,E,k,bm", [(1, 8, 2, 16), (3, 8, 3, 16), (4, 16, 8, 16), (8, 128, 8, 16), (5, 6, 4, 2),
                                      (16, 8, 8, 16), (8, 512, 10, 16)])
@pytest.mark.parametrize("renorm", [True, False])
def test_fused_route_plan_equals_route_then_plan(T, E, k, bm, renorm):
    """The one-launch decode path (top-k by repeated maxima, order and tiles by pairwise
    comparisons) gives route + plan's ids, order and tiles exactly and their weights to
    float32 rounding, with padded rows and exact ties (a repeated logit row) included;
    (5, 6, 4, 2) puts several tiles in one expert, (16, 8, 8, 16) fills the 128-pair space,
    (8, 512, 10, 16) is Qwen3-Next's routing (top 10 of 512) at a decode batch of 8."""
    g = torch.Generator().manual_seed(T * 31 + E)
    logits = torch.randn(T, E, generator=g).to(DEVICE)
    if T > 2:
        logits[2] = 0.0  # every expert ties: the lowest indices win
    valid = torch.ones(T, dtype=torch.bool, device=DEVICE)
    if T > 1:
        valid[1] = False
    w_ref, ids_ref = route_logits(logits, k, renorm, valid)
    p_ref = plan(ids_ref, E, bm)
    w, ids, p = route_plan(logits, k, renorm, valid, bm)
    assert torch.equal(ids.cpu(), ids_ref.cpu())
    torch.testing.assert_close(w.cpu(), w_ref.cpu(), atol=1e-6, rtol=1e-6)
    assert torch.equal(p.order.cpu(), p_ref.order.cpu())
    assert p.tile_expert.numel() == p_ref.tile_expert.numel()
    assert _tiles(p) == _tiles(p_ref)
    # Routing alone (the decode path): the same ids and weights, no plan.
    w2, ids2, none = route_plan(logits, k, renorm, valid, bm, with_plan=False)
    # (one program per token: the weights to float32 rounding of the batch-wide program's)
    assert none is None and torch.equal(ids2, ids)
    torch.testing.assert_close(w2, w, atol=1e-6, rtol=1e-6)


@pytest.fixture(scope="module")
def routed_260():
    """260 tokens' rows (float64, cast per test) and router logits (128 experts), and
    ``route_rows``' top 8 of all 260 at once."""
    g = torch.Generator().manual_seed(9)
    x64 = torch.randn(260, 64, generator=g, dtype=F64)
    logits = torch.randn(260, 128, generator=g).to(DEVICE)
    return x64, logits, *route_rows(logits, 8, True)


def test_routing_rows_do_not_depend_on_the_batch(routed_260):
    """What a token gets from the routed layer is bitwise the same whatever it is batched
    with (see the next test): routing (128 experts, top 8) at decode batches 1 to 4 and at
    prefill chunks of 16 to 260 rows (any capacity: a cache-on turn prefills its suffix in a
    smaller program than the cache-off turn's prompt). The router logits are float32 for
    every expert dtype, so this runs once."""
    _, logits, w_all, ids_all = routed_260
    w_ref, ids_ref = route_logits(logits, 8, True)
    assert torch.equal(ids_all, ids_ref)  # the reference path's choices, its weights to float32 rounding
    torch.testing.assert_close(w_all, w_ref, atol=1e-6, rtol=1e-6)
    # (one program a token: the batch sizes differ in the grid alone; 130 and the fixture's 260
    # are the chunks past 128)
    for start, T in ((0, 1), (1, 2), (1, 3), (0, 4), (50, 16), (3, 128), (0, 130)):
        w, ids = route_rows(logits[start:start + T], 8, True)
        assert torch.equal(ids, ids_all[start:start + T]) and torch.equal(w, w_all[start:start + T]), T


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_routed_rows_do_not_depend_on_the_batch(dtype, routed_260):
    """... and the GEMVs at batches 1 to 4, the tiled experts at a prefill chunk of 16 rows
    and of 130, on those tokens and their routing. The GPU generation tests (cache on
    against off, a repeated prompt) need this; the H200 showed both failing when routing
    reduced over a batch-wide layout, and torch's routing ops over [T, E] round by T."""
    E, H, I = 128, 64, 32
    gate_up, down = _weights(E, H, I, 5, dtype)
    x64, _, w_all, ids_all = routed_260
    x = x64.to(dtype).to(DEVICE)
    out4 = experts_decode(x[:4], w_all[:4], ids_all[:4], gate_up, down)
    for T in (1, 2, 3):
        assert torch.equal(experts_decode(x[4 - T:4], w_all[4 - T:4], ids_all[4 - T:4], gate_up, down),
                           out4[4 - T:]), T
    if DEVICE == "cpu":
        return  # the interpreter's tl.dot is numpy's matmul, which rounds by a row's place in the tile
    w, ids = w_all[:130], ids_all[:130]
    full = experts_triton(x[:130], w, ids, gate_up, down)
    assert torch.equal(experts_triton(x[50:66], w[50:66], ids[50:66], gate_up, down), full[50:66])


def test_route_rows_masks_padded_rows():
    """Rows of a program's padding (``valid`` false) route to the sentinel with weight 0."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(5, 16, generator=g).to(DEVICE)
    valid = torch.tensor([True, False, True, True, False], device=DEVICE)
    w, ids = route_rows(logits, 3, False, valid)
    w_ref, ids_ref = route_logits(logits, 3, False, valid)
    assert torch.equal(ids, ids_ref) and ids[1].tolist() == [16] * 3 and w[4].tolist() == [0.0] * 3
    torch.testing.assert_close(w, w_ref, atol=1e-6, rtol=1e-6)


def test_fused_route_plan_refuses_large_batches():
    with pytest.raises(ValueError, match="at most"):
        route_plan(torch.zeros(9, 8), 10, True, None, 16)  # 16 x 16 padded pairs


def test_combine_ignores_unwritten_sentinel_rows():
    """Both forms: the torch one (reference path) and the one-launch kernel (tiled path)."""
    y = torch.full((4, 2), float("nan"))
    y[0], y[1], y[2] = 1.0, 2.0, 3.0
    ids = torch.tensor([[0, 1], [2, 4]])  # E = 4: pair 3 is a sentinel, its row never written
    w = torch.tensor([[0.5, 0.5], [1.0, 0.0]])
    assert combine(y, w, ids, 4).tolist() == [[1.5, 1.5], [3.0, 3.0]]
    dev = [t.to(DEVICE) for t in (y, w, ids)]
    assert combine_triton(dev[0], dev[1], dev[2], 4).tolist() == [[1.5, 1.5], [3.0, 3.0]]
