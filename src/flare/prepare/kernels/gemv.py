"""A decode-step GEMM for a few rows (M <= 8; 16 with ``dot``): ``out = x @ w.T``, streaming the weight once.

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
  next call. The counters must be zero before the first call: a prepared core keeps them in
  its arena (``TICKET_COUNTERS``, a state buffer the runtime zeroes at start); without
  counters a second launch (``sum_slices_kernel``) adds the slices in the same order.

A row's sums involve no other row; whether its bits are also the same at every M (the row
block BM changes the register layout of the reduction) is what tests/test_gemv.py checks,
in the interpreter and on the GPU. The ``dot`` variant runs one tensor-core tile of
``DOT_ROWS`` rows (``tl.dot``, rows past M zeros) at every M: the same program whatever the
rows, so the same bits by construction. On the H200 it streamed the 9B hybrid's Gated DeltaNet
in_proj at 3.92-3.97 TB/s at one, two and four rows against cuBLAS's 3.54-3.59 (32 columns a
program, K steps of 128, four stages), where the row loop fell to 1.6-2.0 TB/s at four rows
(``bench/results/gemv-2026-12-04-run2.json``, ``-run3.json``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from flare.prepare.kernels.gdn import _silu_rounded


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
def _conv_history(c_ptr, slots_ptr, live_ptr, m, n, m_in, CD, stride_cs, stride_cd, stride_cw, stride_slot,
                  stride_live, CONV_W: tl.constexpr):
    """CONV: each row's slot (where live) and the W - 1 inputs of its causal convolution's history
    for this program's channels (columns under CD), loaded before the K loop so that their latency
    hides behind the weight stream."""
    live = tl.load(live_ptr + m * stride_live, mask=m_in, other=0) != 0
    slot = tl.where(live, tl.load(slots_ptr + m * stride_slot, mask=m_in, other=0), 0).to(tl.int64)
    own = live[:, None] & (n < CD)[None, :]
    at = c_ptr + slot[:, None] * stride_cs + n[None, :].to(tl.int64) * stride_cd
    h0 = tl.load(at, mask=own, other=0.0)
    h1 = tl.load(at + stride_cw, mask=own & (CONV_W > 2), other=0.0)
    h2 = tl.load(at + 2 * stride_cw, mask=own & (CONV_W > 3), other=0.0)
    return live, own, at, h0, h1, h2


@triton.jit
def _conv_epilogue(y, live, own, at, h0, h1, h2, cw_ptr, cb_ptr, n, CD, stride_cw, stride_cwd, stride_cww,
                   CONV_W: tl.constexpr, CONV_BIAS: tl.constexpr):
    """CONV: the product ``y`` (as the projection stores it) of the channels under CD through a
    decode step's causal depthwise convolution and SiLU, their histories shifted in place: the
    arithmetic of ``gdn._conv_step_kernel`` (the taps summed in the same order, the sum rounded to
    the weight's dtype before the SiLU, zeros on rows that are not live), so the same bits; the
    other columns as they are."""
    c_in = n < CD
    x = y.to(at.dtype.element_ty)
    acc = tl.zeros(y.shape, tl.float32)
    if CONV_BIAS:
        acc += tl.load(cb_ptr + n, mask=c_in, other=0.0).to(tl.float32)[None, :]
    acc += tl.load(cw_ptr + n * stride_cwd, mask=c_in, other=0.0).to(tl.float32)[None, :] * h0.to(tl.float32)
    if CONV_W > 2:
        acc += tl.load(cw_ptr + n * stride_cwd + stride_cww, mask=c_in, other=0.0).to(tl.float32)[None, :] \
            * h1.to(tl.float32)
    if CONV_W > 3:
        acc += tl.load(cw_ptr + n * stride_cwd + 2 * stride_cww, mask=c_in, other=0.0).to(tl.float32)[None, :] \
            * h2.to(tl.float32)
    acc += tl.load(cw_ptr + n * stride_cwd + (CONV_W - 1) * stride_cww, mask=c_in,
                   other=0.0).to(tl.float32)[None, :] * x.to(tl.float32)
    tl.debug_barrier()  # every thread's history loads are done before any shift lands
    if CONV_W == 2:
        tl.store(at, x, mask=own)
    elif CONV_W == 3:
        tl.store(at, h1, mask=own)
        tl.store(at + stride_cw, x, mask=own)
    else:
        tl.store(at, h1, mask=own)
        tl.store(at + stride_cw, h2, mask=own)
        tl.store(at + 2 * stride_cw, x, mask=own)
    conv = tl.where(live[:, None], _silu_rounded(acc, cw_ptr.dtype.element_ty), 0.0)
    return tl.where(c_in[None, :], conv.to(y.dtype), y)


@triton.jit
def _norm_dot_loop(x_ptr, w_ptr, nr_ptr, nw_ptr, nt_ptr, m, n, m_in, n_in, N, K, k_lo, k_hi, stride_xm, stride_wn,
                   stride_nr, stride_nt, store, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   PRECISION: tl.constexpr, GLU: tl.constexpr, NORM: tl.constexpr, NORM_ADD: tl.constexpr):
    """NORM: the K loop of the ``dot`` variant with the rows put through an RMS norm in their loads.
    Each step's row tile (with NORM_ADD ``residual + x`` rounded to x's dtype, stored by the
    programs that ``store``: one column tile's) is scaled by the norm's weight, ``x * weight``
    (Llama's form) or ``x * (1 + weight)`` (zero-centred), rounded to x's dtype and multiplied;
    its squares are summed per lane and reduced once after the loop. The rows, residual and norm
    weight of the next step are loaded before this step's arithmetic (they feed arithmetic, not the
    tensor cores directly, so Triton's pipelining leaves them to the loop: loaded where they are
    used, each step waited on its loads, twice the product's time on the H100). Returns (the
    products, GLU's up products, each row's sum of squares); the rows' reciprocal RMS is left to
    the epilogue (``_norm_scale``)."""
    acc = tl.zeros([BM, BN], tl.float32)
    up = tl.zeros([BM, BN], tl.float32)
    sq = tl.zeros([BM, BK], tl.float32)
    kk = k_lo + tl.arange(0, BK)
    at = m[:, None] * stride_xm + kk[None, :]
    mask = m_in[:, None] & (kk < K)[None, :]
    x = tl.load(x_ptr + at, mask=mask, other=0.0)
    r = tl.load(nr_ptr + m[:, None] * stride_nr + kk[None, :], mask=mask, other=0.0) if NORM_ADD else x
    g = tl.load(nw_ptr + kk, mask=kk < K, other=0.0)
    for k0 in range(k_lo, k_hi, BK):
        kk = k0 + tl.arange(0, BK)
        k_in = kk < K
        mask = m_in[:, None] & k_in[None, :]
        nk = kk + BK  # (the next step's columns: masked past K)
        next_mask = m_in[:, None] & (nk < K)[None, :]
        x_next = tl.load(x_ptr + m[:, None] * stride_xm + nk[None, :], mask=next_mask, other=0.0)
        if NORM_ADD:
            r_next = tl.load(nr_ptr + m[:, None] * stride_nr + nk[None, :], mask=next_mask, other=0.0)
        else:
            r_next = x_next
        g_next = tl.load(nw_ptr + nk, mask=nk < K, other=0.0)
        w = tl.load(w_ptr + n[:, None].to(tl.int64) * stride_wn + kk[None, :], mask=n_in[:, None] & k_in[None, :],
                    other=0.0)
        h = x
        if NORM_ADD:
            h = (r.to(tl.float32) + x.to(tl.float32)).to(x.dtype)
            if store:
                tl.store(nt_ptr + m[:, None] * stride_nt + kk[None, :], h, mask=mask)
        hf = h.to(tl.float32)
        sq += hf * hf
        gf = g.to(tl.float32)[None, :]
        if NORM == 1:
            hf = hf * (1.0 + gf)
        else:
            hf = hf * gf
        xs = hf.to(x.dtype)
        acc = tl.dot(xs, tl.trans(w), acc, input_precision=PRECISION)
        if GLU:
            w_up = tl.load(w_ptr + (n[:, None] + N).to(tl.int64) * stride_wn + kk[None, :],
                           mask=n_in[:, None] & k_in[None, :], other=0.0)
            up = tl.dot(xs, tl.trans(w_up), up, input_precision=PRECISION)
        x, r, g = x_next, r_next, g_next
    return acc, up, tl.sum(sq, axis=1)


@triton.jit
def _norm_scale(acc, ss, K, eps):
    """NORM: the products of ``_norm_dot_loop``'s scaled rows times each row's reciprocal RMS,
    ``rsqrt(sum of squares / K + eps)`` (rows past M: zeros stay zeros)."""
    return acc * tl.math.rsqrt(ss / K + eps)[:, None]


# M is never specialised (Triton compiles an integer argument of 1, or one divisible by 16,
# into a binary of its own): one binary for every row count, so the dot variant's "the same
# program at every M" holds for the machine code too.
@triton.jit(do_not_specialize=["M"])
def gemv_kernel(x_ptr, w_ptr, out_ptr, part_ptr, count_ptr, r_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                stride_rm, c_ptr, cw_ptr, cb_ptr, slots_ptr, live_ptr, CD, stride_cs, stride_cd, stride_cw,
                stride_cwd, stride_cww, stride_slot, stride_live, nr_ptr, nw_ptr, nt_ptr, stride_nr, stride_nt, eps,
                ss_ptr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, KS: tl.constexpr,
                SPLIT: tl.constexpr, DEFER: tl.constexpr, SWIGLU: tl.constexpr = False,
                RESIDUAL: tl.constexpr = False, ROWLOOP: tl.constexpr = False, DOT: tl.constexpr = False,
                PRECISION: tl.constexpr = "ieee", TICKETS: tl.constexpr = True, GLU: tl.constexpr = False,
                CONV_W: tl.constexpr = 0, CONV_BIAS: tl.constexpr = False, NORM: tl.constexpr = 0,
                NORM_ADD: tl.constexpr = False):
    pid_n = tl.program_id(0)
    s = tl.program_id(1)
    n = pid_n * BN + tl.arange(0, BN)
    m = tl.arange(0, BM)
    n_in, m_in = n < N, m < M
    if CONV_W > 0:  # (SPLIT 1 only: ``gemv`` checks)
        live, own, at, h0, h1, h2 = _conv_history(c_ptr, slots_ptr, live_ptr, m, n, m_in, CD, stride_cs, stride_cd,
                                                  stride_cw, stride_slot, stride_live, CONV_W)
    acc = tl.zeros([BM, BN], tl.float32)
    up = tl.zeros([BM, BN], tl.float32)  # GLU: the up projection's sums (weight rows N + n)
    lanes = tl.zeros([BM, BN, BK], tl.float32)  # DEFER: a sum per K lane, reduced after the loop
    ss = tl.zeros([BM], tl.float32)  # NORM: each row's sum of squares
    if NORM > 0:  # (DOT, no SWIGLU; a split only with tickets, no GLU: ``gemv`` checks)
        acc, up, ss = _norm_dot_loop(x_ptr, w_ptr, nr_ptr, nw_ptr, nt_ptr, m, n, m_in, n_in, N, K, s * KS,
                                     s * KS + KS, stride_xm, stride_wn, stride_nr, stride_nt, pid_n == 0, BM, BN, BK,
                                     PRECISION, GLU, NORM, NORM_ADD)
    for k0 in range(s * KS, s * KS + KS if NORM == 0 else s * KS, BK):
        kk = k0 + tl.arange(0, BK)
        k_in = kk < K
        w = tl.load(w_ptr + n[:, None].to(tl.int64) * stride_wn + kk[None, :], mask=n_in[:, None] & k_in[None, :],
                    other=0.0)
        if DOT:  # one tensor-core tile of DOT_ROWS rows whatever M (rows past M load zeros)
            x = _rows(x_ptr + m[:, None] * stride_xm + kk[None, :], m_in[:, None] & k_in[None, :], K, SWIGLU,
                      x_ptr.dtype.element_ty)
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
            if GLU:
                w_up = tl.load(w_ptr + (n[:, None] + N).to(tl.int64) * stride_wn + kk[None, :],
                               mask=n_in[:, None] & k_in[None, :], other=0.0)
                up = tl.dot(x, tl.trans(w_up), up, input_precision=PRECISION)
        elif ROWLOOP:  # a row at a time against the weight tile: [BN, BK] products whatever BM
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
    if (NORM > 0) & (SPLIT == 1):
        acc = _norm_scale(acc, ss, K, eps)
        if GLU:
            up = _norm_scale(up, ss, K, eps)
    # NORM with a split: each slice's rows' sum of squares beside its partial sums (a [BM] vector a
    # slice and column tile), the last ticket's program adding them in the same order
    ss_rows = ss_ptr + pid_n.to(tl.int64) * BM + m  # (slice j's at j * ss_slice past these)
    ss_slice = tl.num_programs(0) * BM
    out_at = out_ptr + m[:, None] * stride_om + n[None, :]
    keep = m_in[:, None] & n_in[None, :]
    rows = part_ptr + (m[:, None].to(tl.int64) * N + n[None, :])  # (a split's partial sums)
    if GLU:  # silu(gate) * up from the two products as the projection stores them, rounded once
        g = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
        u = up.to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_at, (g * tl.sigmoid(g) * u).to(out_ptr.dtype.element_ty), mask=keep)
    elif SPLIT == 1:
        y = _epilogue(acc, r_ptr, m, n, keep, stride_rm, out_ptr.dtype.element_ty, RESIDUAL)
        if CONV_W > 0:
            y = _conv_epilogue(y, live, own, at, h0, h1, h2, cw_ptr, cb_ptr, n, CD, stride_cw, stride_cwd, stride_cww,
                               CONV_W, CONV_BIAS)
        tl.store(out_at, y, mask=keep)
    else:
        tl.store(rows + s.to(tl.int64) * BM * N, acc, mask=keep)
        if NORM > 0:
            tl.store(ss_rows + s * ss_slice, ss)
    if (SPLIT > 1) & TICKETS:  # (without tickets ``sum_slices_kernel`` adds the slices after)
        tl.debug_barrier()  # every thread's partial sums are stored before the ticket
        ticket = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT - 1:
            total = tl.zeros([BM, BN], tl.float32)
            for j in range(SPLIT):
                total += tl.load(rows + j * BM * N, mask=keep, other=0.0, cache_modifier=".cg")
            if NORM > 0:
                ss = tl.zeros([BM], tl.float32)
                for j in range(SPLIT):
                    ss += tl.load(ss_rows + j * ss_slice, cache_modifier=".cg")
                total = _norm_scale(total, ss, K, eps)
            tl.store(out_at, _epilogue(total, r_ptr, m, n, keep, stride_rm, out_ptr.dtype.element_ty, RESIDUAL),
                     mask=keep)
            tl.atomic_xchg(count_ptr + pid_n, 0, sem="relaxed", scope="gpu")


@triton.jit
def sum_slices_kernel(part_ptr, out_ptr, r_ptr, N, stride_om, stride_rm, BM: tl.constexpr, SPLIT: tl.constexpr,
                      BLOCK: tl.constexpr, RESIDUAL: tl.constexpr):
    """Program (row, block of columns): the row's SPLIT partial sums added in order 0, 1, ...
    (as the last ticket's program adds them), then ``_epilogue``."""
    m = tl.program_id(0) + tl.arange(0, 1)  # the row, as a block of one for ``_epilogue``
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    keep = n[None, :] < N
    total = tl.zeros([1, BLOCK], tl.float32)
    for j in range(SPLIT):
        total += tl.load(part_ptr + (j * BM + m[:, None]).to(tl.int64) * N + n[None, :], mask=keep, other=0.0)
    tl.store(out_ptr + m[:, None] * stride_om + n[None, :],
             _epilogue(total, r_ptr, m, n, keep, stride_rm, out_ptr.dtype.element_ty, RESIDUAL), mask=keep)


# Columns a program of ``sum_slices_kernel`` adds.
SUM_BLOCK = 1024


# Rows of the tensor-core tile of ``gemv``'s ``dot`` variant: tl.dot's least, and the most
# rows it serves (a 4-slot step of 3 draft tokens verifies 16).
DOT_ROWS = 16


def _block_rows(rows: int, dot: bool) -> int:
    return DOT_ROWS if dot else triton.next_power_of_2(rows)


def fills_slices(k: int, split: int, bk: int) -> bool:
    """Whether K = ``k`` cut into ``split`` slices of whole ``bk`` steps leaves none empty."""
    return split == 1 or (split - 1) * _slice_width(k, split, bk) < k


def _slice_width(k: int, split: int, bk: int) -> int:
    return triton.cdiv(triton.cdiv(k, split), bk) * bk


def partials(rows: int, n: int, split: int, device, dot: bool = False) -> torch.Tensor:
    """The float32 partial sums ``gemv`` with ``split`` slices writes for ``rows`` rows."""
    return torch.empty((split, _block_rows(rows, dot), n), dtype=torch.float32, device=device)


def norm_partials(rows: int, n: int, split: int, bn: int, device) -> torch.Tensor:
    """The float32 sums of squares ``gemv`` with a ``Norm`` and ``split`` slices writes (the dot
    variant's: a slice's, for each column tile and row of its tile)."""
    return torch.empty((split, triton.cdiv(n, bn), _block_rows(rows, True)), dtype=torch.float32, device=device)


def workspace(rows: int, n: int, split: int, bn: int, device, dot: bool = False,
              norm: bool = False) -> tuple[torch.Tensor, ...]:
    """(partial sums, zeroed ticket counters[, with ``norm`` and a split, ``norm_partials``]) for
    ``gemv`` at these sizes."""
    space = partials(rows, n, split, device, dot), torch.zeros(triton.cdiv(n, bn), dtype=torch.int32, device=device)
    return (*space, norm_partials(rows, n, split, bn, device)) if norm and split > 1 else space


class Conv(NamedTuple):
    """A decode step's causal depthwise convolution over the first D outputs of a projection
    (a Gated DeltaNet's q|k|v, then z, b, a): ``state [rows, D, W - 1]`` (this layer's history
    rows, updated in place), ``weight [D, W]``, ``bias [D]`` or None, and each output row's
    ``slots [M]`` and ``live [M]`` (``gdn.conv1d_decode_step``'s arguments). Kernels up to 4 wide."""

    state: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    slots: torch.Tensor
    live: torch.Tensor


def _conv_args(conv: Conv | None, M: int, N: int, out: torch.Tensor) -> tuple:
    """``gemv_kernel``'s convolution arguments after checking them (placeholders without one)."""
    if conv is None:
        # Every constexpr passed, defaults too: Inductor's wrapper of a user Triton kernel
        # (``wrap_triton`` under torch.compile) refuses a call that leaves one out.
        return (out, out, out, out, out, 0, 0, 0, 0, 0, 0, 0, 0), {"CONV_W": 0, "CONV_BIAS": False}
    state, w, bias, slots, live = conv
    D, W = w.shape if w.dim() == 2 else (-1, -1)
    if not (2 <= W <= 4 and D <= N and state.dim() == 3 and tuple(state.shape[1:]) == (D, W - 1)
            and (bias is None or (tuple(bias.shape) == (D,) and bias.stride(0) == 1)) and slots.shape == (M,)
            and live.shape == (M,) and state.dtype == out.dtype and not slots.is_floating_point()
            and live.dtype == torch.bool):
        raise ValueError(f"gemv's convolution: state {tuple(state.shape)} {state.dtype}, weight {tuple(w.shape)}, "
                         f"bias {None if bias is None else tuple(bias.shape)}, slots {tuple(slots.shape)} "
                         f"{slots.dtype}, live {tuple(live.shape)} {live.dtype} for {M} rows of {N} outputs in "
                         f"{out.dtype} (want [rows, D, W - 1] in the outputs' dtype, [D, W] with 2 <= W <= 4 and "
                         f"D <= {N}, [D] contiguous, [{M}] integers, [{M}] bool)")
    return ((state, w, w if bias is None else bias, slots, live, D, *state.stride()[:2], state.stride(2), *w.stride(),
             slots.stride(0), live.stride(0)), {"CONV_W": W, "CONV_BIAS": bias is not None})


class Norm(NamedTuple):
    """An RMS norm of the product's input rows, computed in the GEMV's loads (``dot``; a split only
    with ticket counters): ``weight [K]`` (in x's dtype), ``eps``; ``zero_centred``: scaled by
    ``1 + weight`` (Qwen3.5, Qwen3-Next), otherwise by ``weight`` (Llama). With ``residual`` (x's shape) the
    norm is of ``residual + x`` rounded to x's dtype, a decoder layer's add before its norm, and
    that sum is written to ``total`` (x's shape), the layer's next residual."""

    weight: torch.Tensor
    eps: float
    zero_centred: bool
    residual: torch.Tensor | None = None
    total: torch.Tensor | None = None


def _norm_args(norm: Norm | None, x: torch.Tensor) -> tuple:
    """``gemv_kernel``'s norm arguments after checking them (placeholders without one)."""
    if norm is None:
        return (x, x, x, 0, 0, 0.0), {"NORM": 0, "NORM_ADD": False}
    w, eps, zero_centred, r, total = norm
    M, K = x.shape
    if not (tuple(w.shape) == (K,) and w.stride(0) == 1 and w.dtype == x.dtype and takes_norm(K, x.dtype)
            and (r is None) == (total is None)
            and all(t is None or (tuple(t.shape) == (M, K) and t.stride(1) == 1 and t.dtype == x.dtype)
                    for t in (r, total))
            and (total is None or not any(_shares_memory(total, t) for t in (x, r, w)))):
        raise ValueError(f"gemv's norm: weight {tuple(w.shape)} {w.dtype}, residual "
                         f"{None if r is None else tuple(r.shape)}, total {None if total is None else tuple(total.shape)} "
                         f"for rows {tuple(x.shape)} {x.dtype} (want a contiguous [K] weight in x's dtype, bfloat16 "
                         f"or float32, K at most {NORM_MAX_K}, and residual and total both or neither, [M, K] in x's "
                         f"dtype, unit stride, total apart from every input)")
    r = x if r is None else r
    total = x if total is None else total
    return (r, w, total, r.stride(0), total.stride(0), float(eps)), {"NORM": 1 if zero_centred else 2,
                                                                     "NORM_ADD": norm.residual is not None}


# The longest rows ``Norm`` takes (a decoder's hidden size; rownorm.MAX_ROW's bound).
NORM_MAX_K = 16384
# The dtypes ``Norm`` takes: the loads round ``x * weight`` before the rows' RMS scales it, a
# value float16's range may not hold (bfloat16 has float32's exponent).
NORM_DTYPES = (torch.bfloat16, torch.float32)


def takes_norm(k: int, dtype: torch.dtype) -> bool:
    """Whether ``Norm`` takes rows of ``k`` inputs in ``dtype`` (the weight's and the rows')."""
    return k <= NORM_MAX_K and dtype in NORM_DTYPES


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors lie in one storage (while tracing, where a fake tensor has no address:
    whether they are the same tensor)."""
    try:
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return a is b


def gemv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, tiling: tuple[int, ...],
         space: tuple[torch.Tensor, ...] | None = None, kernel=gemv_kernel,
         swiglu: bool = False, residual: torch.Tensor | None = None, tickets: bool = True,
         sum_kernel=sum_slices_kernel, glu: bool = False, conv: Conv | None = None,
         norm: Norm | None = None) -> torch.Tensor:
    """``out[:M] = x @ w.T`` for ``x [M, K]``, ``w [N, K]`` (unit stride along K); with
    ``swiglu``, ``x [M, 2 K]`` holds a gated MLP's gate and up halves and the product is
    ``(silu(gate) * up) @ w.T``, the activation computed in float32 and rounded to x's dtype
    once, as a compiled MLP's separate activation kernel stores it (one launch fewer).
    ``residual`` ``[M, N]``: the output is ``residual + x @ w.T``, the product rounded to the
    output's dtype before the add and the sum rounded again (a decoder layer's residual add,
    one launch fewer).
    ``tiling``: (BN, BK, SPLIT, warps, stages[, defer[, rowloop[, dot]]]); K is cut into SPLIT slices
    of whole BK steps; ``defer`` 1 keeps a float32 product per K lane through the loop and
    reduces the lanes once at the end (0, the default: reduced at every step). The two sum in
    other orders. ``rowloop`` 1 multiplies the weight tile by one row at a time (a [BN, BK]
    product whatever the rows, where the broadcast holds [BM, BN, BK] in registers: the
    broadcast GEMV took 1.13-1.69x cuBLAS's time at four rows on the H200); its own sums, the
    same for a row at every M. ``dot`` 1 multiplies one tensor-core tile of ``DOT_ROWS`` rows
    (``tl.dot``; rows past M are zeros, M at most ``DOT_ROWS``): the same program at every M, so a
    row's bits are the same at every M by construction; BN and BK at least 16.
    ``tickets`` False: with SPLIT > 1 the slices' partial sums are added in the same order by a
    second launch (``sum_slices_kernel``, which also adds the residual) instead of the last
    ticket's program, so no counters (``space``'s second tensor is never read): what a captured
    program can hold, which cannot keep counters at zero between replays without a buffer of
    its own.
    ``glu``: ``w [2 N, K]`` is a gated MLP's [gate; up] projection and ``out [M, N]`` its activation
    ``silu(x @ gate.T) * (x @ up.T)``: each program multiplies its gate and up columns (two
    tensor-core products a K step; ``dot`` only, no split, no residual), rounds each product to
    the output's dtype as the projection stores it, and computes the activation in float32,
    rounded once (the activation's launch, and the projection's store and load, fewer).
    ``conv``: the first D outputs go through a decode step's causal convolution and SiLU in the
    epilogue, their rows' histories updated in place (``Conv``; no split, glu, activation or
    residual): ``gdn.conv1d_decode_step`` on the product, the same bits, in the same launch.
    ``norm`` (``dot``, no activation in the loads; a split only with ticket counters and no ``glu``,
    its workspace ``workspace(..., norm=True)``): the rows are first put through
    an RMS norm (``Norm``; with its residual, of ``residual + x``, that sum written to its
    ``total``), computed in the loads: each K step's row tile is scaled by the norm's weight and
    rounded, its squares summed, and the product scaled by each row's reciprocal RMS at the end,
    the same value as the norm's kernel before the GEMV in another rounding order (the normalised
    row is never rounded; the scaled one is). With a split each slice also stores its rows' sums
    of squares over its columns, and the last ticket's program adds them in slice order as it adds
    the partial products, then scales (another summation order than without a split, fixed). A
    row's bits do not depend on the other rows. The norm's launch, and its output's store and load,
    go.
    ``space``: ``workspace(M, N, SPLIT, BN, dot=dot, norm=norm is not None)`` (made here when
    None). ``kernel``, ``sum_kernel``: the plain Triton kernels eagerly, or their ``wrap_triton``
    forms inside a custom op."""
    if x.stride(-1) != 1 or w.stride(-1) != 1:
        raise ValueError("gemv needs rows and weight with unit stride along K")
    M, K = x.shape
    N = w.shape[0]
    if swiglu:
        if K != 2 * w.shape[1]:
            raise ValueError(f"gemv with swiglu takes [gate | up] rows of 2 x {w.shape[1]} columns, got {K}")
        K = w.shape[1]
    bn, bk, split, warps, stages = tiling[:5]
    defer = bool(tiling[5]) if len(tiling) > 5 else False
    rowloop = bool(tiling[6]) if len(tiling) > 6 else False
    dot = bool(tiling[7]) if len(tiling) > 7 else False
    if glu:
        if not dot or split != 1 or swiglu or residual is not None or N % 2:
            raise ValueError("gemv's glu epilogue takes the dot variant without a split, the activation in the loads "
                             f"or a residual, over [gate; up] rows of even count (got {N} rows)")
        N //= 2
    r = x if residual is None else residual
    if residual is not None and (tuple(residual.shape) != (M, N) or residual.stride(-1) != 1):
        raise ValueError(f"gemv's residual must be [M, N] = {(M, N)} with unit stride, got {tuple(residual.shape)}")
    if conv is not None and (split != 1 or glu or swiglu or residual is not None):
        raise ValueError("gemv's convolution epilogue takes no split, glu, activation in the loads or residual")
    conv_args, conv_flags = _conv_args(conv, M, N, out)
    if norm is not None and not (dot and not swiglu and (split == 1 or (tickets and not glu))):
        raise ValueError("gemv's norm in the loads takes the dot variant, without the activation in the loads, and a "
                         "split only with ticket counters and no glu")
    norm_args, norm_flags = _norm_args(norm, x)
    if defer + rowloop + dot > 1:
        raise ValueError("gemv's defer, rowloop and dot are variants of the product: one at most")
    if dot and (M > DOT_ROWS or bn < 16 or bk < 16):
        raise ValueError(f"gemv's dot variant takes at most {DOT_ROWS} rows and BN, BK of 16 or more: "
                         f"{M} rows, BN {bn}, BK {bk}")
    ks = _slice_width(K, split, bk)
    if not fills_slices(K, split, bk):
        raise ValueError(f"K = {K} does not fill {split} slices of {ks} columns")
    part, count, *rest = space if space is not None else workspace(M, N, split, bn, x.device, dot, norm is not None)
    bm = _block_rows(M, dot)
    ss = rest[0] if rest else part  # (NORM with a split: its slices' sums of squares)
    if norm is not None and split > 1 and (not rest or tuple(ss.shape) != (split, triton.cdiv(N, bn), bm)
                                           or ss.dtype != torch.float32 or not ss.is_contiguous()):
        raise ValueError(f"gemv's norm with a split needs a contiguous float32 [{split}, {triton.cdiv(N, bn)}, {bm}] "
                         "workspace for its sums of squares (``workspace(..., norm=True)``)")
    if out.stride(-1) != 1 or out.shape[0] < M or out.shape[1] != N:
        raise ValueError(f"gemv writes {M} x {N} outputs with unit stride, got {tuple(out.shape)}")
    if split > 1 and (tuple(part.shape) != (split, bm, N) or (tickets and count.numel() < triton.cdiv(N, bn))):
        raise ValueError(f"gemv's workspace is for other sizes: {tuple(part.shape)}, {count.numel()} counters")
    kernel[(triton.cdiv(N, bn), split)](
        x, w, out, part, count, r, M, N, K, x.stride(0), w.stride(0), out.stride(0), r.stride(0), *conv_args, *norm_args,
        ss, BM=bm, BN=bn, BK=bk, KS=ks, SPLIT=split, DEFER=defer, SWIGLU=swiglu, RESIDUAL=residual is not None,
        ROWLOOP=rowloop, DOT=dot, PRECISION="ieee" if x.dtype == torch.float32 else "tf32", TICKETS=tickets,
        GLU=glu, **conv_flags, **norm_flags, num_warps=warps, num_stages=stages)
    if split > 1 and not tickets:
        block = min(SUM_BLOCK, triton.next_power_of_2(N))
        sum_kernel[(M, triton.cdiv(N, block))](part, out, r, N, out.stride(0), r.stride(0), BM=bm, SPLIT=split,
                                               BLOCK=block, RESIDUAL=residual is not None, num_warps=4)
    return out


# -- as a decode step's linear layer ----------------------------------------------------


# Rows a decode step's GEMV takes at most, but for the dot variant (``DOT_ROWS``): the broadcast
# kernel holds a [rows, BN, BK] product block in registers (a program of 64 rows already reaches
# Triton's largest block at BN 8, BK 2,048).
GEMV_MAX_ROWS = 8


class GemvTiling(NamedTuple):
    """A tiling of ``gemv`` for a decode step's linear layer: lanes reduced at every step, or with
    ``defer`` 1 once after the loop; with ``rowloop`` 1 a row at a time against the weight tile;
    with ``dot`` 1 one tensor-core tile of ``DOT_ROWS`` rows; ``stages``: Triton's software
    pipelining of the K loop (1: none); ``split``: K in that many slices, their partial sums
    (float32, in memory the captured program allocates) added in order by the last program of
    each column tile (with the core's ticket counters) or a second launch, which also add the
    residual (``gemv_linear``); ``glu`` 1 (``dot`` without a split): the weight is a gated MLP's
    [gate; up] projection and the product its activation (``gemv(..., glu=True)``)."""

    bn: int
    bk: int
    warps: int
    defer: int = 0
    rowloop: int = 0
    dot: int = 0
    stages: int = 1
    split: int = 1
    glu: int = 0

    @property
    def max_rows(self) -> int:
        """The most rows a step may give this tiling."""
        return DOT_ROWS if self.dot else GEMV_MAX_ROWS

    def fits(self, k: int) -> bool:
        """Whether K = ``k`` fills every slice of the split (``gemv`` refuses an empty one)."""
        return fills_slices(k, self.split, self.bk)


# Ticket counters a prepared core keeps for the split GEMVs of its steps (an int32 state buffer
# of the arena, zeroed by the runtime at start; every call leaves its counters at zero again):
# enough for N / BN column tiles of any decoder weight.
TICKET_COUNTERS = 16384


def ticket_counters(device) -> torch.Tensor:
    """Zeroed counters for ``gemv_linear(..., tickets=)`` outside a prepared core (timings, tests)."""
    return torch.zeros(TICKET_COUNTERS, dtype=torch.int32, device=device)


def _check_tickets(tickets: torch.Tensor, weight: torch.Tensor, tiling: GemvTiling, who: str) -> None:
    """Raises unless ``tickets`` are int32 counters enough for the column tiles of ``weight``."""
    if tickets.dtype != torch.int32 or tickets.numel() < triton.cdiv(weight.shape[0], tiling.bn):
        raise ValueError(f"{who}'s tickets: {tickets.numel()} {tickets.dtype} counters for "
                         f"{triton.cdiv(weight.shape[0], tiling.bn)} column tiles")


# The ops say they mutate nothing (``gemv_linear``'s and, with a split, ``gemv_norm_linear``'s):
# with ``tickets`` they increment counters that the call's last programs set back to zero, so a
# call leaves every tensor it was given as it found it (calls run one after another on the
# program's stream; none runs beside another with the same counters). Inductor splits a triton_op
# into its kernels and sees the atomics on the counters anyway; a tracer that kept the op whole
# (torch.export) would have only the stream's order to keep two calls apart. (Declaring the
# mutation may make Inductor copy the counters around each call: not measured yet.)


@triton_op("flare::gemv_linear", mutates_args=())
def _gemv_op(x: torch.Tensor, weight: torch.Tensor, tiling: list[int], swiglu: bool = False,
             residual: torch.Tensor | None = None, tickets: torch.Tensor | None = None) -> torch.Tensor:
    t = GemvTiling(*tiling)
    out = torch.empty((x.shape[0], weight.shape[0] // (2 if t.glu else 1)), dtype=x.dtype, device=x.device)
    # Without a split ``out`` stands in for the partial sums, never read; with one the partial
    # sums are memory of the program (every element read is written first), added in order by
    # the last program of each column tile to take a ticket (``tickets``: counters that stay in
    # the arena between replays) or, without counters, by a second launch.
    part = out if t.split == 1 else partials(x.shape[0], weight.shape[0], t.split, x.device, bool(t.dot))
    gemv(x, weight, out, (t.bn, t.bk, t.split, t.warps, t.stages, t.defer, t.rowloop, t.dot),
         space=(part, out if tickets is None else tickets), kernel=wrap_triton(gemv_kernel), swiglu=swiglu,
         residual=residual, tickets=tickets is not None and t.split > 1, sum_kernel=wrap_triton(sum_slices_kernel),
         glu=bool(t.glu))
    return out


def gemv_linear(x: torch.Tensor, weight: torch.Tensor, tiling: GemvTiling, swiglu: bool = False,
                residual: torch.Tensor | None = None, tickets: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight)`` (no bias) by ``gemv`` with ``tiling``, as a custom op (a compiled
    layer calls it without a graph break), for at most ``tiling.max_rows`` rows. ``swiglu``: ``x``
    is a gated MLP's [gate | up] projection and the product is its down projection of
    ``silu(gate) * up``; ``residual`` (the output's shape): added to the product (``gemv``).
    ``tickets``: zeroed int32 counters (``TICKET_COUNTERS``; ``ticket_counters`` or the core's
    state buffer) for a split tiling's last programs to add the slices, in one launch; without
    them a second launch adds them (the same bits). A tiling with ``glu`` 1: ``weight`` is a gated
    MLP's [gate; up] projection and the output its activation ``silu(gate) * up`` (``gemv``)."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    if rows.shape[0] > tiling.max_rows:
        raise ValueError(f"gemv_linear with {tiling} takes at most {tiling.max_rows} rows, not {rows.shape[0]}")
    if residual is not None:
        residual = residual.reshape(-1, residual.shape[-1]).contiguous()
    if tiling.split == 1:
        tickets = None  # (no slices to add)
    if tickets is not None:
        _check_tickets(tickets, weight, tiling, "gemv_linear")
    out = _gemv_op(rows, weight, list(tiling), swiglu, residual, tickets)
    return out.reshape(*x.shape[:-1], out.shape[-1])


@triton_op("flare::gemv_norm_linear", mutates_args=())
def _gemv_norm_op(x: torch.Tensor, weight: torch.Tensor, tiling: list[int], norm_weight: torch.Tensor, eps: float,
                  zero_centred: bool, residual: torch.Tensor | None = None,
                  tickets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    t = GemvTiling(*tiling)
    if t.split > 1 and tickets is None:
        raise ValueError(f"gemv_norm_linear's op: a split tiling {t} needs ticket counters")
    out = torch.empty((x.shape[0], weight.shape[0] // (2 if t.glu else 1)), dtype=x.dtype, device=x.device)
    total = torch.empty_like(x) if residual is not None else x.new_empty((0,))
    # (a split's partial sums and sums of squares: memory of the program, as ``_gemv_op``'s)
    space = (out, out) if t.split == 1 else (partials(x.shape[0], out.shape[1], t.split, x.device, True), tickets,
                                              norm_partials(x.shape[0], out.shape[1], t.split, t.bn, x.device))
    gemv(x, weight, out, (t.bn, t.bk, t.split, t.warps, t.stages, t.defer, t.rowloop, t.dot), space=space,
         kernel=wrap_triton(gemv_kernel), glu=bool(t.glu),
         norm=Norm(norm_weight, eps, zero_centred, residual, total if residual is not None else None))
    return out, total


def gemv_norm_linear(x: torch.Tensor, weight: torch.Tensor, tiling: GemvTiling, norm: Norm,
                     tickets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``F.linear(norm(x), weight)`` (``glu`` 1: its gated activation) by ``gemv`` on ``tiling``
    (``dot``; a split, without ``glu``, with ``tickets``: zeroed int32 counters as ``gemv_linear``
    takes them) with the RMS norm computed in its loads (``Norm``, its ``total`` left out:
    allocated here), as a custom op; returns (output, ``residual + x`` where the norm has a
    residual, else None): one launch where the norm (with the add) and the GEMV were two."""
    if not tiling.dot:
        raise ValueError(f"gemv_norm_linear takes a dot tiling, not {tiling}")
    if tiling.split != 1 and tiling.glu:
        raise ValueError(f"gemv_norm_linear's glu takes no split: {tiling}")
    if tiling.split != 1 and tickets is None:
        raise ValueError(f"gemv_norm_linear's split {tiling} needs ticket counters")
    if tiling.split > 1:
        _check_tickets(tickets, weight, tiling, "gemv_norm_linear")
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    if rows.shape[0] > tiling.max_rows:
        raise ValueError(f"gemv_norm_linear with {tiling} takes at most {tiling.max_rows} rows, not {rows.shape[0]}")
    residual = None if norm.residual is None else norm.residual.reshape(rows.shape).contiguous()
    out, total = _gemv_norm_op(rows, weight, list(tiling), norm.weight, norm.eps, norm.zero_centred, residual,
                               tickets if tiling.split > 1 else None)
    return out.reshape(*x.shape[:-1], out.shape[-1]), None if residual is None else total.reshape(x.shape)


def gemv_conv_linear(x: torch.Tensor, weight: torch.Tensor, tiling: GemvTiling, conv: Conv,
                     norm: Norm | None = None) -> torch.Tensor:
    """``F.linear(x, weight)`` by ``gemv`` with ``tiling`` (no split, no ``glu``) with a decode
    step's causal convolution over its first D outputs in the epilogue (``Conv``; its history rows
    updated in place): one launch where the projection and ``gdn.conv1d_decode_step`` were two,
    the same bits. ``norm`` (without a residual; a ``dot`` tiling): of ``norm(x)``, the norm in the
    loads (``gemv``). Called eagerly (it writes state rows: a compiled graph must not trace it)."""
    if tiling.split != 1 or tiling.glu:
        raise ValueError(f"gemv_conv_linear takes a tiling without a split or glu, not {tiling}")
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    if rows.shape[0] > tiling.max_rows:
        raise ValueError(f"gemv_conv_linear with {tiling} takes at most {tiling.max_rows} rows, not {rows.shape[0]}")
    out = torch.empty((rows.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    if norm is not None and norm.residual is not None:
        raise ValueError("gemv_conv_linear's norm takes no residual")
    return gemv(rows, weight, out, (tiling.bn, tiling.bk, 1, tiling.warps, tiling.stages, tiling.defer,
                                    tiling.rowloop, tiling.dot), space=(out, out), conv=conv, norm=norm)

