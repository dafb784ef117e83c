"""Capture-safe mixture-of-experts: routing, the expert plan, and grouped expert GEMMs.

A routed layer computes, for each token ``t`` and each of its ``k`` experts ``e``::

    y[t] = sum_j  w[t, j] * down[e_j] @ (act(gate[e_j] @ x[t]) * (up[e_j] @ x[t]))

Transformers' expert loop picks the experts on the host (``nonzero``, a Python loop),
which a CUDA graph cannot hold. Here every shape is static and every decision is read on
the device, so the whole layer is captured once and replayed:

* ``route``: the router's logits in the model dtype and its softmax in float32, as
  Transformers computes them, the top ``k`` by a stable sort (ties go to the lower
  expert index, deterministically), renormalised where the model says so; the weights
  stay float32 (Transformers rounds them to the model dtype) and the weighted sum runs
  in float32. Rows that are not valid (padding of a program's capacity) get no expert: their
  ids are ``E`` (a sentinel) and their weights zero, so they read no expert weights.
* ``invariant_linear``: the router's logits (and a shared expert's one-column gate) by a
  Triton GEMM with fixed tiles and no split of K, so a token's logits do not depend on the
  rows it is batched with. cuBLAS picks its kernel (and how it splits K) by the number of
  rows: a decode step of one slot and of four, or a prefill of 128 and of 256 tokens,
  routed the same token with logits differing in the last bit, enough to change the
  generation (cache on against off, measured on the H200).
* ``router_gemv``: the router's logits in decode-sized steps, and a shared expert's gate in
  the same launch: a GEMV program per token and block of experts, the whole of K in order,
  so a row's logits do not depend on the batch either; ``invariant_linear``'s 16-row tiles
  ran a 256-expert router in 16 programs.
* ``route_rows``: routing as the captured programs run it, one Triton program per token
  (softmax, top k by repeated maxima, renormalisation), so a token's weights do not depend
  on its batch or on the program's capacity: the batch-wide program's softmax changed them
  in the last bit (measured on the H200), and so do torch's softmax and sums over [T, E]
  (``route_logits``, the CPU reference path's) between prefill capacities.
* ``route_plan``: routing and the plan in one program for a batch of at most 128 pairs, the
  order and tiles by comparing every two pairs (kept for its tests and the kernel benchmark;
  the recipe plans with ``plan``).
* ``plan``: the (token, slot) pairs sorted by expert, and a static list of row tiles of
  ``block_m`` pairs, each within one expert (``tile_expert`` = -1 for unused tiles). At
  most ``min(P, cdiv(P, block_m) + E)`` tiles for ``P = T * k`` pairs: a decode step of
  one token has 8 tiles, not one per expert.
* ``grouped_gate_up`` / ``grouped_down``: one program per (tile, block of output
  features) reads its expert's weight rows once for the whole tile (tensor cores,
  ``tl.dot``), gathering the tile's input rows; the first computes the gate and up rows
  together and writes ``act(gate) * up``, the second the expert outputs per pair.
* ``combine``: the weighted sum over each token's ``k`` pairs, in slot order (no atomics:
  the result does not depend on scheduling).
* ``experts_decode``: decode-sized batches (at most ``DECODE_PAIRS`` pairs) skip the plan
  and the tiles: a GEMV program per (pair, block of features) for gate/up, and down GEMVs
  that sum each token's pairs in slot order in place of ``combine`` (all k pairs' rows
  loaded together, ``_decode_down_wide_kernel``). On the H200
  (bench/moe_kernels.py, docs/gpu.md) at one token its experts took 34 µs at the
  30B-A3B layer with the default blocks, against 38 for the tiled path's experts, whose
  16-row tiles hold one row each.
  A gated shared expert (``shared=``) runs in the same two launches as one more pair of
  every token that is not padding.

Weights stay in Transformers' layout: ``gate_up_proj [E, 2I, H]`` (gate rows, then up
rows) and ``down_proj [E, H, I]``; each program reads whole contiguous rows.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch.nn import functional as F

from flare.prepare.kernels.gemm import launch
from flare.prepare.kernels.gemv import _norm_args

try:  # Hopper's programmatic dependent launch (``experts_decode``'s and ``router_gemv``'s ``pdl``)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - a Triton without them: ``pdl`` is refused
    gdc_launch_dependents = gdc_wait = None


def route(x: torch.Tensor, weight: torch.Tensor, top_k: int, renormalize: bool,
          valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 ``[T, k]``, expert ids int64 ``[T, k]``) for hidden rows ``x [T, H]``
    and a router ``weight [E, H]``; rows with ``valid`` False get ids ``E`` and weight 0."""
    return route_logits(F.linear(x, weight), top_k, renormalize, valid)


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, *, block_m: int = 16, block_n: int = 16,
                     block_k: int = 128) -> torch.Tensor:
    """``x @ weight.T`` (``x [T, K]``, ``weight [N, K]``, float32 accumulation, the result in
    x's dtype) where each row's result is the same whatever the other rows and ``T``: the
    tiles are fixed and each program sums the whole of K in order (``gemm.nonsplit_kernel``).
    For small N (the router, a one-column gate), where cuBLAS splits K by the batch size."""
    T, Kd = x.shape
    out = torch.empty((T, weight.shape[0]), dtype=x.dtype, device=x.device)
    launch(x, weight, None, out, (block_m, block_n, min(block_k, max(16, triton.next_power_of_2(Kd))), 4))
    return out


def route_logits(logits: torch.Tensor, top_k: int, renormalize: bool,
                 valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``route`` from the router's logits ``[T, E]``."""
    E = logits.shape[1]
    probs = torch.softmax(logits.float(), dim=-1)
    top, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    top, ids = top[:, :top_k], ids[:, :top_k]
    if renormalize:
        top = top / top.sum(dim=-1, keepdim=True)
    if valid is not None:
        ids = torch.where(valid[:, None], ids, E)
        top = torch.where(valid[:, None], top, 0.0)
    return top.contiguous(), ids.contiguous()


@dataclass(frozen=True)
class Plan:
    """The pairs of a routed batch grouped by expert (every tensor on the device)."""

    order: torch.Tensor  # [P] pair indices (t * k + j) sorted by expert, sentinel pairs last
    tile_expert: torch.Tensor  # [tiles] the expert of each row tile, -1 when unused
    tile_start: torch.Tensor  # [tiles] the tile's first row in ``order``
    tile_end: torch.Tensor  # [tiles] one past the expert's last row in ``order``
    block_m: int


def max_tiles(pairs: int, experts: int, block_m: int) -> int:
    """Row tiles a plan may need: each expert's rows round up to whole tiles, and a
    non-empty expert has at least one pair."""
    return max(1, min(pairs, triton.cdiv(pairs, block_m) + experts))


def plan(ids: torch.Tensor, num_experts: int, block_m: int) -> Plan:
    """Group the pairs of ``ids [T, k]`` (values in ``0..E``, ``E`` = no expert) by expert."""
    flat = ids.reshape(-1).long()
    P = flat.numel()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=ids.device)
    counts = counts.scatter_add(0, flat, torch.ones_like(flat))[:num_experts]
    tiles = (counts + block_m - 1) // block_m
    tiles_end = torch.cumsum(tiles, 0)
    starts = torch.cumsum(counts, 0) - counts
    t = torch.arange(max_tiles(P, num_experts, block_m), device=ids.device)
    e = torch.searchsorted(tiles_end, t, right=True)
    used = e < num_experts
    ec = torch.clamp(e, max=num_experts - 1)
    first_tile = tiles_end[ec] - tiles[ec]
    tile_start = starts[ec] + (t - first_tile) * block_m
    return Plan(order.to(torch.int32), torch.where(used, ec, -1).to(torch.int32), tile_start.to(torch.int32),
                (starts[ec] + counts[ec]).to(torch.int32), block_m)


# Pairs a program of ``plan_triton`` compares with its expert at once, and row tiles a program
# computes.
PLAN_CHUNK = 1024
PLAN_TILES = 16


@triton.jit
def _plan_count_kernel(ids_ptr, count_ptr, P, CH: tl.constexpr):
    """Program e: how many of the P pairs route to expert e (e = E: the sentinel)."""
    e = tl.program_id(0)
    n = tl.zeros([CH], tl.int32)
    for p0 in range(0, P, CH):
        p = p0 + tl.arange(0, CH)
        n += (tl.load(ids_ptr + p, mask=p < P, other=-1) == e).to(tl.int32)
    tl.store(count_ptr + e, tl.sum(n, 0))


@triton.jit
def _plan_place_kernel(ids_ptr, count_ptr, order_ptr, tile_expert_ptr, tile_start_ptr, tile_end_ptr, P, E, MT,
                       BM: tl.constexpr, CH: tl.constexpr, BE: tl.constexpr, TB: tl.constexpr):
    """Programs 0..E: expert e's pairs, in pair order, into ``order`` after the pairs of every
    lower expert (a stable sort by expert, the sentinel E last). Program E + 1 + b: the row tiles
    b TB to b TB + TB - 1, as ``plan`` computes them (an unused tile's start and end included)."""
    e = tl.program_id(0)
    x = tl.arange(0, BE)
    counts = tl.load(count_ptr + x, mask=x <= E, other=0)
    if e <= E:
        at = tl.sum(tl.where(x < e, counts, 0), 0)
        for p0 in range(0, P, CH):
            p = p0 + tl.arange(0, CH)
            hot = (tl.load(ids_ptr + p, mask=p < P, other=-1) == e).to(tl.int32)
            tl.store(order_ptr + at + tl.cumsum(hot, 0) - 1, p, mask=hot != 0)
            at += tl.sum(hot, 0)
    else:
        real = x < E
        counts = tl.where(real, counts, 0)
        tiles = (counts + BM - 1) // BM
        tiles_end = tl.cumsum(tiles, 0)
        starts = tl.cumsum(counts, 0) - counts
        t = (e - E - 1) * TB + tl.arange(0, TB)
        # the expert whose tiles hold tile t (searchsorted, right): E past the last
        et = tl.sum(((tiles_end[None, :] <= t[:, None]) & real[None, :]).to(tl.int32), 1)
        ec = tl.minimum(et, E - 1)
        at_ec = x[None, :] == ec[:, None]
        end_ec = tl.sum(tl.where(at_ec, tiles_end[None, :], 0), 1)
        tiles_ec = tl.sum(tl.where(at_ec, tiles[None, :], 0), 1)
        start_ec = tl.sum(tl.where(at_ec, starts[None, :], 0), 1)
        count_ec = tl.sum(tl.where(at_ec, counts[None, :], 0), 1)
        t_in = t < MT
        tl.store(tile_expert_ptr + t, tl.where(et < E, ec, -1), mask=t_in)
        tl.store(tile_start_ptr + t, start_ec + (t - (end_ec - tiles_ec)) * BM, mask=t_in)
        tl.store(tile_end_ptr + t, start_ec + count_ec, mask=t_in)


def plan_triton(ids: torch.Tensor, num_experts: int, block_m: int) -> Plan:
    """``plan`` in two launches (its outputs to the bit): a program per expert counts the
    expert's pairs, then places them in pair order after the lower experts' (the stable sort),
    and programs of 16 row tiles compute the tiles; where ``plan``'s stable sort, scatter, scans
    and searchsorted are some 35-55 launches of torch in a prompt program's layer."""
    flat = ids.reshape(-1)
    P, E = flat.numel(), num_experts
    dev = ids.device
    MT = max_tiles(P, E, block_m)
    count = torch.empty(E + 1, dtype=torch.int32, device=dev)
    order = torch.empty(P, dtype=torch.int32, device=dev)
    tiles = [torch.empty(MT, dtype=torch.int32, device=dev) for _ in range(3)]
    ch = min(PLAN_CHUNK, triton.next_power_of_2(max(P, 16)))
    _plan_count_kernel[(E + 1,)](flat, count, P, CH=ch, num_warps=4)
    _plan_place_kernel[(E + 1 + triton.cdiv(MT, PLAN_TILES),)](
        flat, count, order, *tiles, P, E, MT, BM=block_m, CH=ch, BE=triton.next_power_of_2(E + 1), TB=PLAN_TILES,
        num_warps=4)
    return Plan(order, *tiles, block_m)


# A batch is routed and planned by one program (decode) when its padded pair space,
# next_pow2(T) x next_pow2(k), holds at most this many: the pairwise comparisons are
# [space, space] tiles in registers.
FUSED_PLAN_PAIRS = 128


def fits_route_plan(tokens: int, top_k: int) -> bool:
    return triton.next_power_of_2(tokens) * triton.next_power_of_2(top_k) <= FUSED_PLAN_PAIRS


@triton.jit
def _top_k(logits_ptr, t, t_in, T, E, stride_lt, stride_le, K: tl.constexpr, RENORM: tl.constexpr,
           BT: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr, CG: tl.constexpr, RANKS: tl.constexpr = False):
    """Rows ``t``'s softmax over E experts, then (weights [BT, BK] float32, ids [BT, BK] int32) of
    the top K by repeated maxima (ties to the lower index), renormalised with RENORM. ``CG``: the
    logits were stored by other programs of this launch (read past L1, as the GEMV's ticket path
    reads the slices). ``RANKS``: the top K by every expert's rank among the row's keys (one
    comparison of every two, then one masked sum a slot) instead of K maxima one after another:
    the same ids and weights before the renormalisation (whose sum may round otherwise)."""
    e = tl.arange(0, BE)
    x = tl.load(logits_ptr + t[:, None] * stride_lt + e[None, :] * stride_le, mask=t_in[:, None] & (e[None, :] < E),
                other=0.0, cache_modifier=".cg" if CG else "").to(tl.float32)
    x = tl.where(e[None, :] < E, x, float("-inf"))  # rows past T stay finite (their results are not stored)
    m = tl.max(x, 1)
    ex = tl.exp(x - m[:, None])
    prob = ex / tl.sum(ex, 1)[:, None]
    prob = tl.where(e[None, :] < E, prob, -1.0)
    # One reduction a pick: a key of the probability's bits (a probability's bits order as it
    # does; -1, out of range, below them all) over the complement of the index, whose maximum is
    # the largest probability at its lowest index.
    key = (prob.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (BE - 1 - e)[None, :].to(tl.int64)
    j = tl.arange(0, BK)
    if RANKS:
        # Keys are distinct: an expert's rank is the number of the row's keys above its own.
        rank = tl.sum((key[:, None, :] > key[:, :, None]).to(tl.int32), 2)  # [BT, BE]
        hit = (rank[:, None, :] == j[None, :, None]) & (j[None, :, None] < K)  # [BT, BK, BE]: one expert a slot
        top = tl.sum(tl.where(hit, prob[:, None, :], 0.0), 2)
        sel = tl.sum(tl.where(hit, e[None, None, :], 0), 2)
    else:
        top = tl.zeros([BT, BK], tl.float32)
        sel = tl.zeros([BT, BK], tl.int32)
        for i in tl.static_range(K):
            best = tl.max(key, 1)
            v = (best >> 32).to(tl.int32).to(tl.float32, bitcast=True)
            idx = BE - 1 - (best & 0xFFFFFFFF).to(tl.int32)
            top = tl.where(j[None, :] == i, v[:, None], top)
            sel = tl.where(j[None, :] == i, idx[:, None], sel)
            key = tl.where(e[None, :] == idx[:, None], -1 << 62, key)
    if RENORM:
        top = top / tl.sum(tl.where(j[None, :] < K, top, 0.0), 1)[:, None]
    return top, sel


@triton.jit
def _route_plan_kernel(
    logits_ptr, valid_ptr, w_ptr, ids_ptr, order_ptr, tile_expert_ptr, tile_start_ptr, tile_end_ptr,
    T, E, stride_lt, stride_le,
    K: tl.constexpr, RENORM: tl.constexpr, BM: tl.constexpr, BT: tl.constexpr, BE: tl.constexpr,
    BK: tl.constexpr, BP: tl.constexpr, MT: tl.constexpr, PLAN: tl.constexpr, RANKS: tl.constexpr = False,
):
    """``route`` then ``plan`` for a small batch in one program: softmax, top-k by repeated
    maxima or by ranks (``RANKS``; ties to the lower index either way), renormalisation, and the pairs' order and row tiles
    from comparisons between every two pairs (no sort, no scatter of shared addresses)."""
    # One program for a planned batch; one per token when routing alone (BT = 1), so that a
    # token's softmax reduces over the same register layout whatever its batch.
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    t_in = t < T
    live = t_in & (tl.load(valid_ptr + t, mask=t_in, other=0) != 0)
    j = tl.arange(0, BK)
    if PLAN:
        top, sel = _top_k(logits_ptr, t, t_in, T, E, stride_lt, stride_le, K, RENORM, BT, BE, BK, False)
    else:
        # One token: a padded row (most rows of a short prefill chunk) routes nowhere without
        # computing the softmax it would discard.
        top = tl.zeros([BT, BK], tl.float32)
        sel = tl.zeros([BT, BK], tl.int32)
        if tl.max(live.to(tl.int32), 0) > 0:
            top, sel = _top_k(logits_ptr, t, t_in, T, E, stride_lt, stride_le, K, RENORM, BT, BE, BK, False, RANKS)
    sel = tl.where(live[:, None], sel, E)
    top = tl.where(live[:, None], top, 0.0)
    out_mask = t_in[:, None] & (j[None, :] < K)
    tl.store(w_ptr + t[:, None] * K + j[None, :], top, mask=out_mask)
    tl.store(ids_ptr + t[:, None] * K + j[None, :], sel.to(tl.int64), mask=out_mask)

    if PLAN:  # the plan (skipped for decode's expert GEMVs, which need none)
        # The pairs, flattened in a padded space q = t * BK + j; real pair index t * K + j.
        ids = tl.reshape(tl.where(out_mask, sel, E + 1), [BP])  # padding sorts after the sentinel
        qi = tl.arange(0, BP)
        real = (qi // BK < T) & (qi % BK < K)
        pair = (qi // BK) * K + qi % BK
        a_id = ids[:, None]
        b_id = ids[None, :]
        before = (b_id < a_id) | ((b_id == a_id) & (qi[None, :] < qi[:, None]))  # [p, q]: q sorts before p
        rank = tl.sum(before.to(tl.int32), 1)
        tl.store(order_ptr + rank, pair.to(tl.int32), mask=real)
        start = tl.sum((b_id < a_id).to(tl.int32), 1)  # the first row of p's expert
        count = tl.sum((b_id == a_id).to(tl.int32), 1)
        head = real & (ids < E) & ((rank - start) % BM == 0)  # p starts a tile of its expert
        tile = tl.sum((head[None, :] & (rank[None, :] < rank[:, None])).to(tl.int32), 1)
        # Tile slot s takes the pair that starts it (at most one): a masked reduction per slot.
        s = tl.arange(0, MT)
        hit = head[None, :] & (tile[None, :] == s[:, None])
        any_hit = tl.sum(hit.to(tl.int32), 1) > 0
        tl.store(tile_expert_ptr + s, tl.where(any_hit, tl.max(tl.where(hit, ids[None, :], -1), 1), -1))
        tl.store(tile_start_ptr + s, tl.max(tl.where(hit, rank[None, :], 0), 1))
        tl.store(tile_end_ptr + s, tl.max(tl.where(hit, (start + count)[None, :], 0), 1))


def route_plan(logits: torch.Tensor, top_k: int, renormalize: bool, valid: torch.Tensor | None,
               block_m: int, *, with_plan: bool = True) -> tuple[torch.Tensor, torch.Tensor, Plan | None]:
    """``route`` and ``plan`` in one launch from the router's logits ``[T, E]`` (when
    ``fits_route_plan``): the same ids, order and used tiles, weights to float32 rounding.
    ``with_plan=False`` is ``route_rows`` (no plan, any T)."""
    if not with_plan:
        return (*route_rows(logits, top_k, renormalize, valid), None)
    T, E = logits.shape
    P = T * top_k
    if not fits_route_plan(T, top_k):
        raise ValueError(f"{T} tokens x top {top_k}: route_plan serves a padded pair space of at most "
                         f"{FUSED_PLAN_PAIRS} (use route and plan)")
    dev = logits.device
    if valid is None:
        valid = torch.ones(T, dtype=torch.bool, device=dev)
    weights = torch.empty((T, top_k), dtype=torch.float32, device=dev)
    ids = torch.empty((T, top_k), dtype=torch.long, device=dev)
    MT = max_tiles(P, E, block_m)
    order = torch.empty(P, dtype=torch.int32, device=dev)
    tiles = [torch.empty(triton.next_power_of_2(MT), dtype=torch.int32, device=dev) for _ in range(3)]
    BT, BK = triton.next_power_of_2(T), triton.next_power_of_2(top_k)
    _route_plan_kernel[(1,)](
        logits, valid, weights, ids, order, *tiles, T, E, *logits.stride(),
        K=top_k, RENORM=renormalize, BM=block_m, BT=BT, BE=triton.next_power_of_2(E), BK=BK, BP=BT * BK,
        MT=triton.next_power_of_2(MT), PLAN=True, num_warps=8 if BT * BK > 64 else 4,
    )
    return weights, ids, Plan(order, tiles[0][:MT], tiles[1][:MT], tiles[2][:MT], block_m)


# Warps of a token's routing program (``route_rows``, and the router GEMV's launch that routes in
# its last program): the softmax's and the top-k's reductions follow their register layout, so
# the two must agree for a token's weights to be the same bits in decode steps and prompt chunks.
ROUTE_WARPS = 4
# Whether a token's routing program takes the top k by ranks (``_top_k``'s RANKS) rather than k
# maxima one after another; route_rows and a routing router share it, as they share the warps.
ROUTE_RANKS = False


def route_rows(logits: torch.Tensor, top_k: int, renormalize: bool,
               valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``route`` from the router's logits ``[T, E]`` with one program per token, for any T:
    a token's softmax, top-k and renormalisation reduce over the same register layout
    whatever it is batched with, so a row's weights are bitwise the same in a decode step
    and in a prefill chunk of any capacity (the ids agree with ``route_logits``, the
    weights to float32 rounding)."""
    T, E = logits.shape
    if not 0 < top_k <= E:
        raise ValueError(f"route_rows: top {top_k} of {E} experts")
    dev = logits.device
    if valid is None:
        valid = torch.ones(T, dtype=torch.bool, device=dev)
    weights = torch.empty((T, top_k), dtype=torch.float32, device=dev)
    ids = torch.empty((T, top_k), dtype=torch.long, device=dev)
    BK = triton.next_power_of_2(top_k)
    _route_plan_kernel[(T,)](  # the plan's four outputs are never touched with PLAN=False
        logits, valid, weights, ids, ids, ids, ids, ids, T, E, *logits.stride(),
        K=top_k, RENORM=renormalize, BM=16, BT=1, BE=triton.next_power_of_2(E), BK=BK, BP=BK, MT=1, PLAN=False,
        RANKS=ROUTE_RANKS, num_warps=ROUTE_WARPS,
    )
    return weights, ids


@triton.jit
def _grouped_kernel(
    a_ptr, w_ptr, out_ptr, order_ptr, tile_expert_ptr, tile_start_ptr, tile_end_ptr,
    N, K, ROW_DIV,
    stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_om, stride_on,
    GATE_UP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    nb = tl.program_id(1)
    e = tl.load(tile_expert_ptr + tile)
    if e >= 0:
        rows = tl.load(tile_start_ptr + tile) + tl.arange(0, BM)
        in_tile = rows < tl.load(tile_end_ptr + tile)
        pair = tl.load(order_ptr + rows, mask=in_tile, other=0)
        src = pair // ROW_DIV  # gate/up: the pair's token row of x; down: the pair's own row
        n = nb * BN + tl.arange(0, BN)
        n_in = n < N
        w_rows = w_ptr + e.to(tl.int64) * stride_we
        acc = tl.zeros([BM, BN], tl.float32)
        acc_up = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + tl.arange(0, BK)
            k_in = kk < K
            a = tl.load(a_ptr + src[:, None].to(tl.int64) * stride_am + kk[None, :] * stride_ak,
                        mask=in_tile[:, None] & k_in[None, :], other=0.0)
            w = tl.load(w_rows + n[None, :] * stride_wn + kk[:, None] * stride_wk,
                        mask=n_in[None, :] & k_in[:, None], other=0.0)
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
            if GATE_UP:  # the up rows follow the N gate rows
                wu = tl.load(w_rows + (n[None, :] + N) * stride_wn + kk[:, None] * stride_wk,
                             mask=n_in[None, :] & k_in[:, None], other=0.0)
                acc_up = tl.dot(a, wu, acc_up, input_precision=PRECISION)
        dtype = out_ptr.dtype.element_ty
        if GATE_UP:
            # Transformers rounds each projection to the model dtype, then act(gate) * up.
            g = acc.to(dtype).to(tl.float32)
            act = (g * tl.sigmoid(g)).to(dtype).to(tl.float32)
            res = act * acc_up.to(dtype).to(tl.float32)
        else:
            res = acc
        tl.store(out_ptr + pair[:, None].to(tl.int64) * stride_om + n[None, :] * stride_on, res.to(dtype),
                 mask=in_tile[:, None] & n_in[None, :])


def _blocks(block_m: int, n: int, k: int, block_n: int, block_k: int) -> tuple[int, int, int]:
    return block_m, min(block_n, max(16, triton.next_power_of_2(n))), min(block_k, max(16, triton.next_power_of_2(k)))


def _launch(a, w, out, p: Plan, n: int, row_div: int, gate_up: bool, block_n: int, block_k: int,
            num_warps: int) -> torch.Tensor:
    K = a.shape[1]
    BM, BN, BK = _blocks(p.block_m, n, K, block_n, block_k)
    grid = (p.tile_expert.numel(), triton.cdiv(n, BN))
    _grouped_kernel[grid](
        a, w, out, p.order, p.tile_expert, p.tile_start, p.tile_end, n, K, row_div,
        *a.stride(), *w.stride(), *out.stride(),
        GATE_UP=gate_up, BM=BM, BN=BN, BK=BK, num_warps=num_warps,
        # float32 (tests, the CPU interpreter) stays float32; TF32 would round the inputs
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
    )
    return out


def grouped_gate_up(x: torch.Tensor, gate_up: torch.Tensor, p: Plan, top_k: int, *, block_n: int = 64,
                    block_k: int = 64, num_warps: int = 4) -> torch.Tensor:
    """``act(gate[e] @ x[t]) * (up[e] @ x[t])`` for every planned pair, ``[P, I]`` in x's
    dtype (rows of sentinel pairs are left unwritten). x ``[T, H]``; gate_up ``[E, 2I, H]``."""
    E, two_i, H = gate_up.shape
    if x.dim() != 2 or x.shape[1] != H or two_i % 2:
        raise ValueError(f"x {tuple(x.shape)} / gate_up {tuple(gate_up.shape)}: expected [T, H] and [E, 2I, H]")
    out = torch.empty((p.order.numel(), two_i // 2), dtype=x.dtype, device=x.device)
    return _launch(x, gate_up, out, p, two_i // 2, top_k, True, block_n, block_k, num_warps)


def grouped_down(h: torch.Tensor, down: torch.Tensor, p: Plan, *, block_n: int = 64, block_k: int = 64,
                 num_warps: int = 4) -> torch.Tensor:
    """``down[e] @ h[pair]`` for every planned pair, ``[P, H]`` (sentinel rows unwritten).
    h ``[P, I]``; down ``[E, H, I]``."""
    E, H, I = down.shape
    if h.dim() != 2 or h.shape[1] != I:
        raise ValueError(f"h {tuple(h.shape)} / down {tuple(down.shape)}: expected [P, I] and [E, H, I]")
    out = torch.empty((h.shape[0], H), dtype=h.dtype, device=h.device)
    return _launch(h, down, out, p, H, 1, False, block_n, block_k, num_warps)


def combine(y: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``sum_j weights[t, j] * y[t * k + j]`` in float32, slot by slot in order (the order
    the decode kernel sums in), as ``[T, H]`` in y's dtype; sentinel pairs (never written)
    count zero."""
    T, k = ids.shape
    yy = y.view(T, k, -1)
    out = torch.zeros((T, y.shape[-1]), dtype=torch.float32, device=y.device)
    for j in range(k):
        out = out + torch.where((ids[:, j] < num_experts)[:, None], yy[:, j].float() * weights[:, j, None], 0.0)
    return out.to(y.dtype)


@triton.jit
def _combine_kernel(y_ptr, ids_ptr, weights_ptr, out_ptr, E, N, stride_yp, stride_ot, TOPK: tl.constexpr,
                    BN: tl.constexpr):
    t = tl.program_id(0)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    n_in = n < N
    total = tl.zeros([BN], tl.float32)
    for j in tl.static_range(TOPK):
        e = tl.load(ids_ptr + t * TOPK + j)
        if e < E:
            y = tl.load(y_ptr + (t * TOPK + j).to(tl.int64) * stride_yp + n, mask=n_in, other=0.0)
            total += y.to(tl.float32) * tl.load(weights_ptr + t * TOPK + j)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + n, total.to(out_ptr.dtype.element_ty), mask=n_in)


def combine_triton(y: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``combine`` in one launch (the torch form is 4 k small kernels)."""
    T, k = ids.shape
    H = y.shape[-1]
    out = torch.empty((T, H), dtype=y.dtype, device=y.device)
    _combine_kernel[(T, triton.cdiv(H, 512))](y, ids.contiguous(), weights.contiguous(), out, num_experts, H,
                                              y.stride(0), out.stride(0), TOPK=k, BN=512)
    return out


# Decode-sized batches (at most this many pairs) run the expert GEMVs below instead of the
# tiled GEMMs: one program per (pair, block of output features) reading only its expert's
# rows, no row tiles to pad, and the down projection summing each token's pairs in place.
DECODE_PAIRS = 64


def dependent_launch(device: torch.device) -> bool:
    """Whether the decode kernels can be launched dependent on ``device`` (``pdl``): Hopper's
    programmatic dependent launch, compute capability 9.0 or later, compiled (not Triton's
    interpreter) and a Triton with ``gdc_wait``."""
    return (device.type == "cuda" and gdc_wait is not None and os.environ.get("TRITON_INTERPRET") != "1"
            and torch.cuda.get_device_capability(device) >= (9, 0))


def _check_pdl(pdl: bool, x: torch.Tensor) -> None:
    if pdl and not dependent_launch(x.device):
        raise ValueError(f"a dependent launch (pdl) needs compiled Triton on a GPU of compute capability 9.0 or "
                         f"later, not {x.device}")


def _pdl_launch(pdl: bool) -> dict:
    """The launch's keywords: the kernel's ``PDL`` and Triton's launch attribute."""
    return {"PDL": True, "launch_pdl": True} if pdl else {}


@triton.jit
def _gemv_rows(x_row_ptr, w_rows_ptr, n, n_in, K, stride_wn, BN: tl.constexpr, BK: tl.constexpr):
    """float32 ``w[n, :] @ x`` for a block of weight rows (K contiguous), reduced once at the end."""
    acc = tl.zeros([BN, BK], tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + tl.arange(0, BK)
        k_in = kk < K
        xv = tl.load(x_row_ptr + kk, mask=k_in, other=0.0).to(tl.float32)
        w = tl.load(w_rows_ptr + n[:, None].to(tl.int64) * stride_wn + kk[None, :],
                    mask=n_in[:, None] & k_in[None, :], other=0.0)
        acc += w.to(tl.float32) * xv[None, :]
    return tl.sum(acc, 1)


@triton.jit
def _gemv_rows_norm(x_row_ptr, r_row_ptr, nw_ptr, t_row_ptr, store, w_rows_ptr, n, n_in, K, stride_wn,
                    BN: tl.constexpr, BK: tl.constexpr, ADD: tl.constexpr, ZERO_CENTRED: tl.constexpr):
    """``_gemv_rows`` of an RMS-normed row, the norm in the loads as ``gemv._norm_dot_loop`` takes
    it: the row h (with ADD ``residual + x`` rounded to x's dtype, stored to ``t_row_ptr`` by a
    program that ``store``s) scaled by the norm's weight (``h * w``, or ``h * (1 + w)`` zero-centred)
    and rounded to its dtype, times the weight rows; returns (those sums, the row's sum of squares):
    the norm's reciprocal RMS multiplies the sums after (``_norm_scale``)."""
    acc = tl.zeros([BN, BK], tl.float32)
    sq = tl.zeros([BK], tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + tl.arange(0, BK)
        k_in = kk < K
        h = tl.load(x_row_ptr + kk, mask=k_in, other=0.0)
        if ADD:
            r = tl.load(r_row_ptr + kk, mask=k_in, other=0.0)
            h = (r.to(tl.float32) + h.to(tl.float32)).to(h.dtype)
            if store:
                tl.store(t_row_ptr + kk, h, mask=k_in)
        hf = h.to(tl.float32)
        sq += hf * hf
        g = tl.load(nw_ptr + kk, mask=k_in, other=0.0).to(tl.float32)
        xv = (hf * (1.0 + g) if ZERO_CENTRED else hf * g).to(h.dtype).to(tl.float32)
        w = tl.load(w_rows_ptr + n[:, None].to(tl.int64) * stride_wn + kk[None, :],
                    mask=n_in[:, None] & k_in[None, :], other=0.0)
        acc += w.to(tl.float32) * xv[None, :]
    return tl.sum(acc, 1), tl.sum(sq, 0)


@triton.jit
def _rows_product(x_row, r_row, nw_ptr, t_row, store, w_rows_ptr, n, n_in, K, stride_wn, eps, BN: tl.constexpr,
                  BK: tl.constexpr, NORM: tl.constexpr, ADD: tl.constexpr):
    """``w[n, :] @ x`` for a block of weight rows: of the row as it is (NORM 0, ``_gemv_rows``) or
    of its RMS norm (``_gemv_rows_norm``; NORM 1 zero-centred, 2 Llama's), scaled by the reciprocal
    RMS after the sums."""
    if NORM > 0:
        y, ss = _gemv_rows_norm(x_row, r_row, nw_ptr, t_row, store, w_rows_ptr, n, n_in, K, stride_wn, BN, BK,
                                ADD, NORM == 1)
        y = y * tl.math.rsqrt(ss / K + eps)
    else:
        y = _gemv_rows(x_row, w_rows_ptr, n, n_in, K, stride_wn, BN, BK)
    return y


@triton.jit
def _dependent():
    """The start of a kernel launched dependent (Hopper's programmatic dependent launch, ``pdl``):
    wait until the kernel before it has completed and its writes are visible, then let the
    kernel after it launch, whose programs become resident and issue the loads that need nothing
    of this kernel's (its weights) while this one runs. Waiting before letting the next launch
    keeps the chain transitive: a kernel that passed its wait knows every earlier kernel complete,
    so the next one may read, before its own wait, what the kernels before this one wrote
    (``_decode_down_wide_kernel`` reads the router's ids so)."""
    gdc_wait()
    gdc_launch_dependents()


@triton.jit
def _router_gemv_kernel(x_ptr, w_ptr, s_ptr, out_ptr, g_ptr, valid_ptr, rw_ptr, ids_ptr, count_ptr, N, K, stride_xt,
                        stride_wn, stride_ot, stride_gt, r_ptr, nw_ptr, t_ptr, stride_rt, stride_tt, eps,
                        BN: tl.constexpr, BK: tl.constexpr, HAS_S: tl.constexpr,
                        ROUTE: tl.constexpr, TOPK: tl.constexpr, RENORM: tl.constexpr, BE: tl.constexpr,
                        BKK: tl.constexpr, NORM: tl.constexpr = 0, RANKS: tl.constexpr = False,
                        PDL: tl.constexpr = False):
    """Program (token, block of BN router rows): the logits of those experts for the token, the
    whole of K in order (``_gemv_rows``), so a token's logits do not depend on its batch. With
    ``HAS_S`` the program past the last block computes the shared expert's one-column gate.
    ``ROUTE``: each program then takes a ticket from the token's counter; the last one routes
    the token as ``route_rows``' program does (``_top_k`` over the logits the others stored, the
    same layout: one row, ``ROUTE_WARPS`` warps), writes its weights and ids, and zeroes the counter.
    ``NORM`` (1 zero-centred, 2 Llama's): the rows are the RMS norm (weight ``nw_ptr``) of
    ``residual + x`` (``r_ptr``), a decoder layer's add and post-attention norm in the loads
    (``_gemv_rows_norm``); program (t, 0) stores the sum to ``t_ptr``, the experts' input and the
    layer's next residual. ``PDL``: launched dependent (``_dependent``)."""
    if PDL:
        _dependent()
    t = tl.program_id(0)
    b = tl.program_id(1)
    x_row = x_ptr + t.to(tl.int64) * stride_xt
    r_row = r_ptr + t.to(tl.int64) * stride_rt
    t_row = t_ptr + t.to(tl.int64) * stride_tt
    dtype = out_ptr.dtype.element_ty
    if b * BN < N:
        n = b * BN + tl.arange(0, BN)
        n_in = n < N
        y = _rows_product(x_row, r_row, nw_ptr, t_row, b == 0, w_ptr, n, n_in, K, stride_wn, eps, BN, BK, NORM, True)
        tl.store(out_ptr + t.to(tl.int64) * stride_ot + n, y.to(dtype), mask=n_in)
    else:
        if HAS_S:
            n = tl.arange(0, BN)
            n_in = n < 1
            y = _rows_product(x_row, r_row, nw_ptr, t_row, False, s_ptr, n, n_in, K, K, eps, BN, BK, NORM, True)
            tl.store(g_ptr + t.to(tl.int64) * stride_gt + n, y.to(dtype), mask=n_in)
    if ROUTE:
        tl.debug_barrier()  # every thread's logits are stored before the ticket
        ticket = tl.atomic_add(count_ptr + t, 1, sem="acq_rel", scope="gpu")
        if ticket == tl.num_programs(1) - 1:
            tl.store(count_ptr + t, 0)
            rows = t + tl.arange(0, 1)
            live = tl.load(valid_ptr + rows) != 0
            j = tl.arange(0, BKK)
            top = tl.zeros([1, BKK], tl.float32)
            sel = tl.zeros([1, BKK], tl.int32)
            if tl.max(live.to(tl.int32), 0) > 0:  # a padded row routes nowhere
                top, sel = _top_k(out_ptr, rows, rows >= 0, t + 1, N, stride_ot, 1, TOPK, RENORM, 1, BE, BKK, True,
                                  RANKS)
            sel = tl.where(live[:, None], sel, N)
            top = tl.where(live[:, None], top, 0.0)
            at = rows[:, None] * TOPK + j[None, :]
            tl.store(rw_ptr + at, top, mask=j[None, :] < TOPK)
            tl.store(ids_ptr + at, sel.to(tl.int64), mask=j[None, :] < TOPK)


def router_gemv(x: torch.Tensor, weight: torch.Tensor, shared_gate: torch.Tensor | None = None,
                *, block_n: int | None = None, block_k: int = 512, num_warps: int | None = None,
                route: tuple[int, bool, torch.Tensor | None, torch.Tensor] | None = None,
                norm=None, exact: bool = True, ranks: bool | None = None, pdl: bool = False) -> tuple:
    """The router's logits ``x @ weight.T`` (``[T, E]``, float32 sums, the model dtype out) for a
    decode-sized batch, and a shared expert's gate logits ``x @ shared_gate.T`` (``[T, 1]``;
    None without one) in the same launch. One program per token and block of router rows,
    each summing the whole of K in a fixed order: a token's logits are the same bits in a
    decode step of any batch size. ``invariant_linear`` (prompt programs: 16-row tensor-core
    tiles) runs a 256-expert router in 16 programs for a decode step, 10 µs a layer on the
    H200 for 0.5-1 MB of weights; here a program per router row (``block_n`` rows, default 1:
    the fastest block of every geometry and batch of ``moe-kernels-decode-2026-12-04*.json``, 3.0
    against 3.7 µs for E / 64 rows at one token of Qwen3.5-35B-A3B's router, 3.6 against 5.4 for
    Qwen3-Next's; routing in the launch, on an H100, 7.8 against 9.2 µs for 4 rows a program,
    ``moe-kernels-decode-2026-12-05-h100.json``). The roundings differ from
    ``invariant_linear``'s only in summation order.

    ``route`` = (top k, renormalise, valid rows or None, ticket counters: zeroed int32, at least
    T, left zeroed): the token's last program also routes it, the weights and ids of
    ``route_rows`` on these logits to the bit (returned after the logits and gate), without
    ``route_rows``' launch: with ``route_rows``' warps and top k (``ROUTE_WARPS``, ``ROUTE_RANKS``;
    ``exact`` False lets a benchmark route with other warps or ``ranks``, whose softmax or
    renormalisation may then round otherwise).

    ``norm``: a ``gemv.Norm`` with a residual (the decoder layer's post-attention norm and the add
    before it, ``Norm.residual`` of x's shape and dtype): the router takes the norm of
    ``residual + x`` in its loads and writes that sum (returned last: the experts' input, which
    ``experts_decode`` normalises with the same ``norm`` in its loads, and their residual).

    ``pdl``: launched dependent (``dependent_launch``: Hopper's programmatic dependent launch; the
    kernel waits for the launch before it first, then lets the next launch start)."""
    T, Kd = x.shape
    _check_pdl(pdl, x)
    E = weight.shape[0]
    # (gemv's norm arguments: the router requires the residual, and writes the sum to ``total``)
    nargs, flags = _norm_args(None if norm is None else norm._replace(total=torch.empty_like(x)), x)
    if x.stride(-1) != 1 or not weight.is_contiguous():
        raise ValueError("router_gemv needs rows with unit stride and a contiguous router")
    num_warps = num_warps or (ROUTE_WARPS if route is not None else 4)
    ranks = ROUTE_RANKS if ranks is None else ranks
    if route is not None and exact and (num_warps, ranks) != (ROUTE_WARPS, ROUTE_RANKS):  # (route_rows' bits)
        raise ValueError(f"router_gemv routes with {ROUTE_WARPS} warps and ranks={ROUTE_RANKS}, as route_rows "
                         f"does, not {num_warps} and {ranks}")
    if shared_gate is not None and (shared_gate.shape != (1, Kd) or not shared_gate.is_contiguous()):
        raise ValueError(f"shared gate {tuple(shared_gate.shape)}: expected a contiguous [1, {Kd}]")
    bn = block_n or 1
    out = torch.empty((T, E), dtype=x.dtype, device=x.device)
    gate = torch.empty((T, 1), dtype=x.dtype, device=x.device) if shared_gate is not None else None
    blocks = triton.cdiv(E, bn) + (shared_gate is not None)
    top_k, renorm, valid, counts = route if route is not None else (1, False, None, None)
    if route is not None and not 0 < top_k <= E:
        raise ValueError(f"router_gemv's route: top {top_k} of {E} experts")
    if route is not None:
        if counts.dtype != torch.int32 or counts.numel() < T:
            raise ValueError(f"router_gemv's route: {counts.numel()} {counts.dtype} counters for {T} tokens")
        if valid is None:
            valid = torch.ones(T, dtype=torch.bool, device=x.device)
        weights = torch.empty((T, top_k), dtype=torch.float32, device=x.device)
        ids = torch.empty((T, top_k), dtype=torch.long, device=x.device)
    _router_gemv_kernel[(T, blocks)](
        x, weight, shared_gate if shared_gate is not None else weight, out, gate if gate is not None else out,
        *((valid, weights, ids, counts) if route is not None else (out, out, out, out)),
        E, Kd, x.stride(0), weight.stride(0), out.stride(0), gate.stride(0) if gate is not None else 0, *nargs,
        BN=bn, BK=min(block_k, triton.next_power_of_2(Kd)), HAS_S=shared_gate is not None, ROUTE=route is not None,
        TOPK=top_k, RENORM=renorm, BE=triton.next_power_of_2(E), BKK=triton.next_power_of_2(top_k),
        NORM=flags["NORM"], RANKS=ranks, num_warps=num_warps, **_pdl_launch(pdl))
    outs = (out, gate) if route is None else (out, gate, weights, ids)
    return outs if norm is None else (*outs, nargs[2])


@triton.jit
def _decode_gate_up_kernel(x_ptr, w_ptr, s_ptr, ids_ptr, out_ptr, E, N, NS, K, TOPK, ROWS, stride_xt, stride_we,
                           stride_wn, stride_om, nw_ptr, eps, BN: tl.constexpr, BK: tl.constexpr,
                           NORM: tl.constexpr = 0, PDL: tl.constexpr = False):
    """Program (pair, block of features): pair ``t * ROWS + j`` is token t's slot j; with a
    shared expert (``ROWS = TOPK + 1``) slot TOPK is the shared expert's pair (weights
    ``s_ptr``, ``NS`` features), computed for tokens whose first slot is routed (not padding).
    ``NORM``: the rows are the RMS norm (weight ``nw_ptr``) of x, in the loads. ``PDL``: launched
    dependent (``_dependent``; its rows are the router's picks: nothing to load before the wait)."""
    if PDL:
        _dependent()
    pair = tl.program_id(0)
    t = pair // ROWS
    j = pair % ROWS
    shared = j >= TOPK
    # The shared pair reads the token's first id: a padded token (sentinel ids) skips it too.
    e = tl.load(ids_ptr + t * TOPK + tl.where(shared, 0, j))
    w_rows = w_ptr + e.to(tl.int64) * stride_we
    n_rows = N
    if shared:
        w_rows = s_ptr
        n_rows = NS
    # A block past this pair's features (the shared expert's intermediate differs) does nothing.
    if (e < E) & (tl.program_id(1) * BN < n_rows):
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        n_in = n < n_rows
        x_row = x_ptr + t.to(tl.int64) * stride_xt
        dtype = out_ptr.dtype.element_ty
        # Transformers rounds each projection to the model dtype, then act(gate) * up.
        # (The gate and up tiles loaded in one loop were no faster on an H100:
        # ``moe-kernels-decode-2026-12-05-h100.json``.)
        # (NORM: x is the RMS norm's input, in the loads as the router takes it: ``_rows_product``)
        g = _rows_product(x_row, x_row, nw_ptr, x_row, False, w_rows, n, n_in, K, stride_wn, eps, BN, BK, NORM,
                          False).to(dtype).to(tl.float32)
        u = _rows_product(x_row, x_row, nw_ptr, x_row, False, w_rows + n_rows * stride_wn, n, n_in, K, stride_wn, eps,
                          BN, BK, NORM, False).to(dtype).to(tl.float32)
        act = (g * tl.sigmoid(g)).to(dtype).to(tl.float32)
        tl.store(out_ptr + pair.to(tl.int64) * stride_om + n, (act * u).to(dtype), mask=n_in)


@triton.jit
def _decode_down_kernel(h_ptr, w_ptr, ids_ptr, weights_ptr, out_ptr, E, N, K, stride_hp, stride_we, stride_wn,
                        stride_ot, TOPK: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    t = tl.program_id(0)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    n_in = n < N
    dtype = out_ptr.dtype.element_ty
    total = tl.zeros([BN], tl.float32)
    for j in tl.static_range(TOPK):  # slot order, as ``combine``
        e = tl.load(ids_ptr + t * TOPK + j)
        if e < E:
            y = _gemv_rows(h_ptr + (t * TOPK + j).to(tl.int64) * stride_hp, w_ptr + e.to(tl.int64) * stride_we,
                           n, n_in, K, stride_wn, BN, BK)
            total += y.to(dtype).to(tl.float32) * tl.load(weights_ptr + t * TOPK + j)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + n, total.to(dtype), mask=n_in)


@triton.jit
def _down_wide_tiles(w_rows, s_ptr, n, n_in, live, kk, K, s_width, stride_wn, stride_sn, BN: tl.constexpr,
                     BK: tl.constexpr, SHARED: tl.constexpr):
    """One step's weight tiles of ``_decode_down_wide_kernel``: [k, BN, BK] of the token's experts
    and [BN, BK] of its shared expert (zeros without one)."""
    w = tl.load(w_rows[:, None, None] + n[None, :, None].to(tl.int64) * stride_wn + kk[None, None, :],
                mask=live[:, None, None] & n_in[None, :, None] & (kk < K)[None, None, :], other=0.0)
    if SHARED:
        ws = tl.load(s_ptr + n[:, None].to(tl.int64) * stride_sn + kk[None, :],
                     mask=n_in[:, None] & (kk < s_width)[None, :], other=0.0)
    else:
        ws = tl.zeros([BN, BK], w.dtype)
    return w, ws


@triton.jit
def _down_wide_step(acc, acc_s, w, ws, h_rows, h_s, live, kk, K, s_width, SHARED: tl.constexpr):
    """``acc += w * h`` (and the shared pair's) for one step of K."""
    hv = tl.load(h_rows[:, None] + kk[None, :], mask=live[:, None] & (kk < K)[None, :], other=0.0)
    acc += w.to(tl.float32) * hv.to(tl.float32)[:, None, :]
    if SHARED:
        hs = tl.load(h_s + kk, mask=kk < s_width, other=0.0)
        acc_s += ws.to(tl.float32) * hs.to(tl.float32)[None, :]
    return acc, acc_s


@triton.jit
def _decode_down_wide_kernel(h_ptr, w_ptr, s_ptr, g_ptr, ids_ptr, weights_ptr, r_ptr, out_ptr, E, N, K, KS, KMAX,
                             ROWS, stride_hp, stride_we, stride_wn, stride_sn, stride_g, stride_rt, stride_ot,
                             TOPK: tl.constexpr, KP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                             SHARED: tl.constexpr, RESIDUAL: tl.constexpr, PDL: tl.constexpr = False):
    """``_decode_down_kernel`` with the token's k pairs loaded together: one [k, BN, BK] tile of
    their experts' rows per step of the reduction instead of k tiles one after another (a
    reduction only I wide leaves a program few loads in flight otherwise). Each pair's GEMV
    is reduced as there; the pairs are then summed in slot order (a masked sum picks row j
    exactly: it adds zeros). ``SHARED``: the token's shared-expert pair (h row
    ``t * ROWS + TOPK``, down rows ``s_ptr``, ``KS`` wide) is reduced beside them, rounded to
    the model dtype as its down projection, and added last, weighted by sigmoid(gate logit).
    ``RESIDUAL``: the decoder layer's residual row is added to the output rounded to the model
    dtype, in float32, rounded again: the bits of the add as a kernel of its own.
    ``PDL``: launched dependent (``_dependent``): the first step's weight tiles are loaded before
    the wait, while the gate/up launch runs, their rows picked by the router's ids, which that
    launch waited for before letting this one launch (read through L2: ``.cg``)."""
    t = tl.program_id(0)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    n_in = n < N
    j = tl.arange(0, KP)
    if PDL:
        # Before the wait: the router has completed (the gate/up launch waited for it before it let this
        # one launch); ``.cg`` reads its ids from L2, where its stores are, not a line another kernel
        # left in this SM's L1.
        e = tl.load(ids_ptr + t * TOPK + j, mask=j < TOPK, other=E, cache_modifier=".cg")
        s_live = tl.load(ids_ptr + t * TOPK, cache_modifier=".cg") < E
    else:
        e = tl.load(ids_ptr + t * TOPK + j, mask=j < TOPK, other=E)
        # The shared pair of a token whose first slot is routed (a padded token has none).
        s_live = tl.load(ids_ptr + t * TOPK) < E
    live = e < E  # sentinel pairs (id E) and the padding to KP read nothing
    h_rows = h_ptr + (t * ROWS + j).to(tl.int64) * stride_hp
    w_rows = w_ptr + tl.where(live, e, 0).to(tl.int64) * stride_we
    s_width = tl.where(s_live, KS, 0)  # a padded token's shared pair reads nothing
    h_s = h_ptr + (t * ROWS + TOPK).to(tl.int64) * stride_hp
    kk = tl.arange(0, BK)
    w, ws = _down_wide_tiles(w_rows, s_ptr, n, n_in, live, kk, K, s_width, stride_wn, stride_sn, BN, BK, SHARED)
    if PDL:
        _dependent()
    acc = tl.zeros([KP, BN, BK], tl.float32)
    acc_s = tl.zeros([BN, BK], tl.float32)
    acc, acc_s = _down_wide_step(acc, acc_s, w, ws, h_rows, h_s, live, kk, K, s_width, SHARED)
    for k0 in range(BK, KMAX, BK):
        kk = k0 + tl.arange(0, BK)
        w, ws = _down_wide_tiles(w_rows, s_ptr, n, n_in, live, kk, K, s_width, stride_wn, stride_sn, BN, BK, SHARED)
        acc, acc_s = _down_wide_step(acc, acc_s, w, ws, h_rows, h_s, live, kk, K, s_width, SHARED)
    dtype = out_ptr.dtype.element_ty
    y = tl.sum(acc, 2).to(dtype).to(tl.float32) * tl.load(weights_ptr + t * TOPK + j, mask=live, other=0.0)[:, None]
    total = tl.zeros([BN], tl.float32)
    for s in tl.static_range(TOPK):  # slot order, as ``combine``
        total += tl.sum(tl.where(j[:, None] == s, y, 0.0), 0)
    if SHARED:
        gate = tl.load(g_ptr + t.to(tl.int64) * stride_g).to(tl.float32)
        total += tl.sum(acc_s, 1).to(dtype).to(tl.float32) * tl.where(s_live, tl.sigmoid(gate), 0.0)
    if RESIDUAL:
        r = tl.load(r_ptr + t.to(tl.int64) * stride_rt + n, mask=n_in, other=0.0)
        total = total.to(dtype).to(tl.float32) + r.to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + n, total.to(dtype), mask=n_in)


def experts_decode(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
                   down: torch.Tensor, *, shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                   gate_up_blocks: tuple[int, int, int] = (16, 512, 4),
                   down_blocks: tuple[int, int, int] | None = None, wide_down: bool = True,
                   residual: torch.Tensor | None = None, norm=None, pdl: bool = False) -> torch.Tensor:
    """The routed experts of a decode-sized batch (``x [T, H]``, ``T * k <= DECODE_PAIRS``) in
    two launches: gate/up GEMVs per pair, then down GEMVs summed over each token's pairs in
    slot order. The same roundings as ``experts_triton`` and ``experts_torch``; sentinel
    pairs (id ``E``) read nothing. Blocks are (rows, K columns, warps) per program.
    ``wide_down`` (default): the down kernel that loads a token's pairs together
    (``_decode_down_wide_kernel``; its rows are a program's rows of every pair); off, the
    one that reads them pair after pair (``_decode_down_kernel``, blocks (4, 512, 4) then).
    On the H200 (``bench/results/moe-kernels-decode-wide-2026-12-02.json``, both expert
    launches): 28.0 against 34.5 µs at one token of the Qwen3-30B-A3B layer, 80.9 against
    89.4 at four; 22.2 against 25.2 and 62.7 against 65.2 for Qwen3.5-35B-A3B. The wide
    down kernel's default blocks (``down_blocks`` None): 8 rows of 128 columns, on 4 warps with
    a shared expert folded in and 8 without. With the shared pair 4 warps won every case of
    ``moe-kernels-decode-2026-12-04b.json`` (Qwen3-Next's layer 52.98 -> 42.68 µs at one token
    and 155.3 -> 108.2 at four: 8 warps of 162 registers a thread left one program an SM;
    Qwen3.5-35B-A3B's 33.67 -> 33.32 and 79.66 -> 74.80); without it 8 warps stay, faster at
    one token for Qwen3-30B-A3B (28.0 against 29.6 µs, ``moe-kernels-decode-2026-12-04.json``)
    and Qwen3.5-35B-A3B (22.2 against 23.3).

    ``shared`` = (gate_up ``[2 I_s, H]``, down ``[H, I_s]``, gate logits ``[T, 1]``): a gated
    shared expert runs in the same two launches as one more pair of every token that is not
    padding, ``sigmoid(gate) * down @ (act(gate_up_g @ x) * (gate_up_u @ x))``, its
    projections rounded to x's dtype as Transformers' MLP rounds them and added after the
    routed pairs in float32 (Transformers adds two model-dtype tensors). Run apart, the
    shared expert's GEMMs and elementwise kernels were some 6 launches a layer on the H200
    (``docs/gpu.md``); wide down only.

    ``residual`` (``[T, H]``, x's dtype): the decoder layer's residual, added in the down kernel
    (``residual + out`` to the same bits, a launch fewer a layer); wide down only.

    ``norm`` (a ``gemv.Norm``; its residual is not read): the experts' input is the RMS norm of
    x, taken in the gate/up kernel's loads (``router_gemv``'s ``norm`` wrote x, the sum before it:
    the decoder layer's post-attention norm is no launch of its own).

    ``pdl``: both launches dependent (``dependent_launch``): the gate/up launch waits for the launch
    before it (the router's) first; the down launch loads its first weight tiles before it waits
    for the gate/up launch. The same bits either way."""
    T, k = ids.shape
    _check_pdl(pdl, x)
    if pdl and not wide_down:
        raise ValueError("experts_decode launches dependent only with the wide down kernel")
    E, two_i, H = gate_up.shape
    I = two_i // 2
    if ids.numel() > DECODE_PAIRS:
        raise ValueError(f"{T} tokens x top {k}: experts_decode serves at most {DECODE_PAIRS} pairs")
    if not (x.is_contiguous() and gate_up.is_contiguous() and down.is_contiguous() and ids.is_contiguous()):
        raise ValueError("experts_decode needs contiguous x, ids and expert weights")
    rows, I_s = k, I
    s_gate_up, s_down, s_gate = gate_up, down, x  # stand-ins when there is no shared expert: never read
    if shared is not None:
        s_gate_up, s_down, s_gate = shared
        I_s = s_gate_up.shape[0] // 2
        if not wide_down:
            raise ValueError("a shared expert runs only with the wide down kernel")
        if s_gate_up.shape != (2 * I_s, H) or s_down.shape != (H, I_s) or s_gate.shape != (T, 1):
            raise ValueError(f"shared expert gate_up {tuple(s_gate_up.shape)}, down {tuple(s_down.shape)}, gate "
                             f"{tuple(s_gate.shape)}: expected [2 I_s, {H}], [{H}, I_s] and [{T}, 1]")
        if not (s_gate_up.is_contiguous() and s_down.is_contiguous()) or s_gate_up.dtype != gate_up.dtype:
            raise ValueError("the shared expert's weights must be contiguous and of the experts' dtype")
        rows = k + 1
    if residual is not None:
        if not wide_down:
            raise ValueError("a residual is added only by the wide down kernel")
        if residual.shape != (T, H) or residual.dtype != x.dtype or residual.stride(-1) != 1:
            raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype}: expected [{T}, {H}] {x.dtype} rows "
                             f"with unit stride")
    width = max(I, I_s)
    h = torch.empty((T * rows, width), dtype=x.dtype, device=x.device)
    bn, bk, warps = gate_up_blocks
    # (gemv's norm arguments without the add: the sum is x; only the weight and eps are read)
    (_, nw, _, _, _, eps), flags = _norm_args(None if norm is None else norm._replace(residual=None, total=None), x)
    _decode_gate_up_kernel[(T * rows, triton.cdiv(width, bn))](
        x, gate_up, s_gate_up, ids, h, E, I, I_s, H, k, rows, x.stride(0), gate_up.stride(0), gate_up.stride(1),
        h.stride(0), nw, eps, BN=bn, BK=min(bk, triton.next_power_of_2(H)), NORM=flags["NORM"], num_warps=warps,
        **_pdl_launch(pdl))
    out = torch.empty((T, H), dtype=x.dtype, device=x.device)
    bn, bk, warps = down_blocks or ((8, 128, 4) if shared is not None else (8, 128, 8))
    if wide_down:
        r = residual if residual is not None else out  # (a stand-in, never read without RESIDUAL)
        _decode_down_wide_kernel[(T, triton.cdiv(H, bn))](
            h, down, s_down, s_gate, ids, weights.contiguous(), r, out, E, H, I, I_s, width, rows, h.stride(0),
            down.stride(0), down.stride(1), s_down.stride(0), s_gate.stride(0), r.stride(0), out.stride(0), TOPK=k,
            KP=triton.next_power_of_2(k), BN=bn, BK=min(bk, triton.next_power_of_2(width)), num_warps=warps,
            SHARED=shared is not None, RESIDUAL=residual is not None, **_pdl_launch(pdl))
    else:
        _decode_down_kernel[(T, triton.cdiv(H, bn))](
            h, down, ids, weights.contiguous(), out, E, H, I, h.stride(0), down.stride(0), down.stride(1),
            out.stride(0), TOPK=k, BN=bn, BK=min(bk, triton.next_power_of_2(I)), num_warps=warps)
    return out


# Rows per tile of the grouped GEMMs, the same for every batch: Triton's MMA instruction (and
# so a row's rounding) follows the tile's rows, and a prompt token must compute the same
# whether its chunk ran on prefill.16 or prefill.2048. Small chunks pad their tiles; they
# read each routed expert once either way.
BLOCK_M = 64


def experts_triton(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
                   down: torch.Tensor, *, block_m: int | None = None, p: Plan | None = None) -> torch.Tensor:
    """The routed experts of ``x [T, H]`` with the Triton grouped GEMMs, over ``p`` (planned
    here when not given, with ``block_m`` rows per tile)."""
    T, k = ids.shape
    p = p or plan_triton(ids, gate_up.shape[0], block_m or BLOCK_M)
    h = grouped_gate_up(x, gate_up, p, k)
    return combine_triton(grouped_down(h, down, p), weights, ids, gate_up.shape[0])


def experts_torch(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
                  down: torch.Tensor) -> torch.Tensor:
    """The reference: expert by expert over the pairs routed to it, with torch ops, in the
    same roundings (projections to x's dtype, act(gate) * up in x's dtype, each pair's
    output in x's dtype, the weighted sum in float32 slot by slot)."""
    E = gate_up.shape[0]
    T, k = ids.shape
    flat = ids.reshape(-1)
    y = torch.zeros((T * k, x.shape[1]), dtype=x.dtype, device=x.device)
    for e in torch.unique(flat[flat < E]).tolist():
        pairs = (flat == e).nonzero()[:, 0]
        g, u = F.linear(x[pairs // k], gate_up[e]).chunk(2, dim=-1)
        y[pairs] = F.linear(F.silu(g) * u, down[e])
    return combine(y, weights, ids, E)
