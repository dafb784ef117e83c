"""A decode-step GEMM for a few rows (M <= 8): ``out = x @ w.T``, streaming the weight once.

A decode step's linear layers multiply 1-4 rows by weights of tens to hundreds of MB, so
their time is the weight's bytes over the memory bandwidth. cuBLAS reaches 2.6-4.2 TB/s
there on the H200 inside CUDA graphs and splits K into partial sums that a second kernel
reduces (64 reduce kernels a step at the 8B and 9B shapes, 0.3 ms serialized;
docs/performance.md). This kernel is the candidate that would do both in one launch
(measured by ``bench/gemv.py`` before any program uses it; the first version, reducing
across K at every step, was 1.18-1.49x slower than cuBLAS at one row, docs/gpu.md):

* program (i, s) of a (cdiv(N, BN), SPLIT) grid sums K columns [s * KS, (s + 1) * KS) of
  BN outputs in float32, the rows broadcast against the weight tile (no tensor-core tile,
  so no row padding to 16), either reduced across the BK lanes at every step or (DEFER)
  kept per lane through the loop and reduced once after it;
* with SPLIT > 1 each program stores its partial sums in a float32 workspace and takes a
  ticket from its column tile's counter; the program that takes the last ticket sums the
  SPLIT partials in order 0, 1, ... (the same order whoever arrives last: the result is
  deterministic run to run), writes the output and resets the counter to zero for the
  next call. The counters must be zero before the first call.

A row's sums involve no other row; whether its bits are also the same at every M (the row
block BM changes the register layout of the reduction) is what tests/test_gemv.py checks,
in the interpreter and on the GPU.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton


@triton.jit
def _epilogue(acc, r_ptr, m, n, keep, stride_rm, dtype: tl.constexpr, RESIDUAL: tl.constexpr):
    """The product rounded to the output's dtype; with RESIDUAL, ``residual + product`` rounded
    again, as a decoder layer's separate add of the two (in float32) stores it."""
    y = acc.to(dtype)
    if RESIDUAL:
        r = tl.load(r_ptr + m[:, None] * stride_rm + n[None, :], mask=keep, other=0.0)
        y = (r.to(tl.float32) + y.to(tl.float32)).to(dtype)
    return y


@triton.jit
def _rows(x_at, mask, K, SWIGLU: tl.constexpr, dtype: tl.constexpr):
    """Row inputs at ``x_at``: as they are, or (SWIGLU) from [gate | up] rows of K each,
    silu(gate) * up in float32 rounded once."""
    if SWIGLU:
        g = tl.load(x_at, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_at + K, mask=mask, other=0.0).to(tl.float32)
        x = (g * tl.sigmoid(g) * u).to(dtype)
    else:
        x = tl.load(x_at, mask=mask, other=0.0)
    return x


@triton.jit
def gemv_kernel(x_ptr, w_ptr, out_ptr, part_ptr, count_ptr, r_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                stride_rm, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, KS: tl.constexpr,
                SPLIT: tl.constexpr, DEFER: tl.constexpr, SWIGLU: tl.constexpr = False,
                RESIDUAL: tl.constexpr = False, ROWLOOP: tl.constexpr = False):
    pid_n = tl.program_id(0)
    s = tl.program_id(1)
    n = pid_n * BN + tl.arange(0, BN)
    m = tl.arange(0, BM)
    n_in, m_in = n < N, m < M
    acc = tl.zeros([BM, BN], tl.float32)
    lanes = tl.zeros([BM, BN, BK], tl.float32)  # DEFER: a sum per K lane, reduced after the loop
    for k0 in range(s * KS, s * KS + KS, BK):
        kk = k0 + tl.arange(0, BK)
        k_in = kk < K
        w = tl.load(w_ptr + n[:, None].to(tl.int64) * stride_wn + kk[None, :], mask=n_in[:, None] & k_in[None, :],
                    other=0.0)
        if ROWLOOP:  # a row at a time against the weight tile: [BN, BK] products whatever BM
            wf = w.to(tl.float32)
            for r in tl.static_range(BM):
                # the row's bound folded into K's (the interpreter mis-types scalar & tensor masks)
                x = _rows(x_ptr + r * stride_xm + kk, kk < tl.where(r < M, K, 0), K, SWIGLU,
                          x_ptr.dtype.element_ty)
                part = tl.sum(x.to(tl.float32)[None, :] * wf, axis=1)
                acc = tl.where(m[:, None] == r, acc + part[None, :], acc)
        else:
            x = _rows(x_ptr + m[:, None] * stride_xm + kk[None, :], m_in[:, None] & k_in[None, :], K, SWIGLU,
                      x_ptr.dtype.element_ty)
            products = x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
            if DEFER:
                lanes += products
            else:
                acc += tl.sum(products, axis=2)
    if DEFER:
        acc = tl.sum(lanes, axis=2)
    out_at = out_ptr + m[:, None] * stride_om + n[None, :]
    keep = m_in[:, None] & n_in[None, :]
    if SPLIT == 1:
        tl.store(out_at, _epilogue(acc, r_ptr, m, n, keep, stride_rm, out_ptr.dtype.element_ty, RESIDUAL), mask=keep)
    else:
        rows = part_ptr + (m[:, None] * N + n[None, :]).to(tl.int64)
        tl.store(rows + s * BM * N, acc, mask=keep)
        tl.debug_barrier()  # every thread's partial sums are stored before the ticket
        ticket = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT - 1:
            total = tl.zeros([BM, BN], tl.float32)
            for j in range(SPLIT):
                total += tl.load(rows + j * BM * N, mask=keep, other=0.0, cache_modifier=".cg")
            tl.store(out_at, _epilogue(total, r_ptr, m, n, keep, stride_rm, out_ptr.dtype.element_ty, RESIDUAL),
                     mask=keep)
            tl.atomic_xchg(count_ptr + pid_n, 0, sem="relaxed", scope="gpu")


def workspace(rows: int, n: int, split: int, bn: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial sums, zeroed ticket counters) for ``gemv`` at these sizes."""
    bm = triton.next_power_of_2(rows)
    return (torch.empty((split, bm, n), dtype=torch.float32, device=device),
            torch.zeros(triton.cdiv(n, bn), dtype=torch.int32, device=device))


def gemv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, tiling: tuple[int, ...],
         space: tuple[torch.Tensor, torch.Tensor] | None = None, kernel=gemv_kernel,
         swiglu: bool = False, residual: torch.Tensor | None = None) -> torch.Tensor:
    """``out[:M] = x @ w.T`` for ``x [M, K]``, ``w [N, K]`` (unit stride along K); with
    ``swiglu``, ``x [M, 2 K]`` holds a gated MLP's gate and up halves and the product is
    ``(silu(gate) * up) @ w.T``, the activation computed in float32 and rounded to x's dtype
    once, as a compiled MLP's separate activation kernel stores it (one launch fewer).
    ``residual`` ``[M, N]``: the output is ``residual + x @ w.T``, the product rounded to the
    output's dtype before the add and the sum rounded again (a decoder layer's residual add,
    one launch fewer).
    ``tiling``: (BN, BK, SPLIT, warps, stages[, defer[, rowloop]]); K is cut into SPLIT slices
    of whole BK steps; ``defer`` 1 keeps a float32 product per K lane through the loop and
    reduces the lanes once at the end (0, the default: reduced at every step). The two sum in
    other orders. ``rowloop`` 1 multiplies the weight tile by one row at a time (a [BN, BK]
    product whatever the rows, where the broadcast holds [BM, BN, BK] in registers: the
    broadcast GEMV took 1.13-1.69x cuBLAS's time at four rows on the H200); its own sums, the
    same for a row at every M.
    ``space``: ``workspace(M, N, SPLIT, BN)`` (made here when None). ``kernel``: the plain
    Triton kernel eagerly, or its ``wrap_triton`` form inside a custom op."""
    if x.stride(-1) != 1 or w.stride(-1) != 1:
        raise ValueError("gemv needs rows and weight with unit stride along K")
    M, K = x.shape
    N = w.shape[0]
    if swiglu:
        if K != 2 * w.shape[1]:
            raise ValueError(f"gemv with swiglu takes [gate | up] rows of 2 x {w.shape[1]} columns, got {K}")
        K = w.shape[1]
    bn, bk, split, warps, stages = tiling[:5]
    r = x if residual is None else residual
    if residual is not None and (tuple(residual.shape) != (M, N) or residual.stride(-1) != 1):
        raise ValueError(f"gemv's residual must be [M, N] = {(M, N)} with unit stride, got {tuple(residual.shape)}")
    defer = bool(tiling[5]) if len(tiling) > 5 else False
    rowloop = bool(tiling[6]) if len(tiling) > 6 else False
    if defer and rowloop:
        raise ValueError("gemv keeps K lanes through the loop (defer) with the rows broadcast only, not a row loop")
    ks = triton.cdiv(triton.cdiv(K, split), bk) * bk
    if split > 1 and (split - 1) * ks >= K:
        raise ValueError(f"K = {K} does not fill {split} slices of {ks} columns")
    part, count = space if space is not None else workspace(M, N, split, bn, x.device)
    bm = triton.next_power_of_2(M)
    if out.stride(-1) != 1 or out.shape[0] < M or out.shape[1] != N:
        raise ValueError(f"gemv writes {M} x {N} outputs with unit stride, got {tuple(out.shape)}")
    if split > 1 and (tuple(part.shape) != (split, bm, N) or count.numel() < triton.cdiv(N, bn)):
        raise ValueError(f"gemv's workspace is for other sizes: {tuple(part.shape)}, {count.numel()} counters")
    kernel[(triton.cdiv(N, bn), split)](
        x, w, out, part, count, r, M, N, K, x.stride(0), w.stride(0), out.stride(0), r.stride(0),
        BM=bm, BN=bn, BK=bk, KS=ks, SPLIT=split, DEFER=defer, SWIGLU=swiglu, RESIDUAL=residual is not None,
        ROWLOOP=rowloop, num_warps=warps, num_stages=stages)
    return out


# -- as a decode step's linear layer ----------------------------------------------------


# Rows a decode step's GEMV takes at most: the kernel holds a [rows, BN, BK] product block in
# registers (a program of 64 rows already reaches Triton's largest block at BN 8, BK 2,048).
GEMV_MAX_ROWS = 8


class GemvTiling(NamedTuple):
    """A tiling of ``gemv`` for a decode step's linear layer: no split of K (so no workspace
    and no counters in the captured program); lanes reduced at every step, or with ``defer``
    1 once after the loop; with ``rowloop`` 1 a row at a time against the weight tile."""

    bn: int
    bk: int
    warps: int
    defer: int = 0
    rowloop: int = 0


@triton_op("flare::gemv_linear", mutates_args=())
def _gemv_op(x: torch.Tensor, weight: torch.Tensor, tiling: list[int], swiglu: bool = False,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    t = GemvTiling(*tiling)
    # No split: the partial sums and counters are never read, so ``out`` stands in for both
    # (no workspace allocated, no counters zeroed in a captured program).
    gemv(x, weight, out, (t.bn, t.bk, 1, t.warps, 1, t.defer, t.rowloop), space=(out, out),
         kernel=wrap_triton(gemv_kernel), swiglu=swiglu, residual=residual)
    return out


def gemv_linear(x: torch.Tensor, weight: torch.Tensor, tiling: GemvTiling, swiglu: bool = False,
                residual: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight)`` (no bias) by ``gemv`` with ``tiling``, as a custom op (a compiled
    layer calls it without a graph break), for at most ``GEMV_MAX_ROWS`` rows. ``swiglu``: ``x``
    is a gated MLP's [gate | up] projection and the product is its down projection of
    ``silu(gate) * up``; ``residual`` (the output's shape): added to the product (``gemv``)."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    if rows.shape[0] > GEMV_MAX_ROWS:
        raise ValueError(f"gemv_linear takes at most {GEMV_MAX_ROWS} rows, not {rows.shape[0]}")
    if residual is not None:
        residual = residual.reshape(-1, residual.shape[-1]).contiguous()
    return _gemv_op(rows, weight, list(tiling), swiglu, residual).reshape(*x.shape[:-1], weight.shape[0])
