"""Capture-safe Triton kernels for Qwen3.5's Gated DeltaNet over per-slot state rows.

The state they update in place (one layer's view of each buffer)::

    conv_state  [rows, conv_dim, W-1]    model dtype   the last W-1 inputs of the causal conv
    state       [rows, Hv, Dk, Dv]       float32       the delta rule's matrix, S[k, v]

A decode row ``i`` owns row ``slots[i]`` when ``live[i]``; a row that is not live
reads and writes no state (its store masks collapse on the device) and outputs
zeros. A prefill chunk is one slot's ``T`` tokens of which the first ``count``
are valid. Slots and counts are read from device tensors and every grid depends
on shapes only, so each launch can be captured once and replayed.

Semantics are the recipe's reference path (Transformers' modules and delta
rule): the convolution rounds its sum to the weight dtype before the SiLU;
``beta = sigmoid(b)`` is rounded to ``b``'s dtype; ``g = -exp(A_log) *
softplus(a + dt_bias)`` and the recurrence run in float32; q and k are
L2-normalised (eps 1e-6) and q is scaled by ``Dk ** -0.5``. Value head ``h``
reads query/key head ``h // (Hv // Hk)`` (Transformers' repeat_interleave).

Launch grids::

    gdn_decode_step       (B, Hv, cdiv(Dv, block_v))   one state tile [Dk, block_v] per program
    gdn_prefill_recurrent (Hv, cdiv(Dv, block_v))      the tile stays in registers over the chunk
    conv1d_decode_step    (B, cdiv(D, block_c))
    conv1d_prefill_chunk  (cdiv(T, block_t), cdiv(D, block_c))   token block 0 also writes the history
    gdn_prefill_gates     (cdiv(T, block_t),)
    gated_rms_norm        (T, H)                           a decode step's output heads, normed and gated

``gdn_prefill_recurrent`` runs a prefill chunk's recurrence token by token: each token's
update is the same arithmetic wherever a chunk starts, so a state is bitwise the same
whether a prompt was prefilled whole or restored from a checkpoint and continued; a
chunked (WY) form rounds differently for every chunk start. The recipe does not use it
yet: on the H200 it takes 5.6x flash-linear-attention's chunked rule at 2,048 tokens
(1.49 ms against 0.27 ms per layer), and with it 6 of 10 turns of the GPU conversation
test were identical cache on and off (3 of 10 with the chunked rule): something else
still rounds by chunk, suspected the prefill GEMMs of different capacities (docs/gpu.md).

The wrappers allocate only their outputs (``torch.empty``) unless ``out`` is given.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_L2_EPS = 1e-6


def _check_shape(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {shape}")


def _output(out: torch.Tensor | None, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    _check_shape("out", out, shape)
    return out


def _rule_geometry(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: torch.Tensor,
                   lead: str) -> tuple[int, int, int, int, int]:
    """(rows or tokens, Hk, Dk, Hv, Dv) of a delta rule's inputs, after checking q, k
    ``[lead, Hk, Dk]``, v ``[lead, Hv, Dv]`` and a float32 state ``[rows, Hv, Dk, Dv]``."""
    n, Hk, Dk = q.shape
    Hv, Dv = v.shape[1], v.shape[2]
    if k.shape != q.shape or v.shape[0] != n or Hv % Hk != 0:
        raise ValueError(f"q {tuple(q.shape)} / k {tuple(k.shape)} / v {tuple(v.shape)}: expected q == k "
                         f"[{lead}, Hk, Dk] and v [{lead}, Hv, Dv] with Hv a multiple of Hk")
    if state.dtype != torch.float32 or state.shape[1:] != (Hv, Dk, Dv):
        raise ValueError(f"state {state.dtype} {tuple(state.shape)}: expected float32 [rows, {Hv}, {Dk}, {Dv}]")
    return n, Hk, Dk, Hv, Dv


@triton.jit
def _softplus(x):
    # torch's softplus (beta 1, threshold 20)
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))


@triton.jit
def _silu_rounded(acc, dtype: tl.constexpr):
    # The reference rounds the convolution to the weight dtype, then applies SiLU.
    y = acc.to(dtype).to(tl.float32)
    return y * tl.sigmoid(y)


@triton.jit
def _rule_step(s, q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, at, hk, hv, kk, vv, k_in, v_in, scale,
               stride_qb, stride_qh, stride_qd, stride_kb, stride_kh, stride_kd, stride_vb, stride_vh, stride_vd,
               stride_ab, stride_ah, stride_bb, stride_bh, EPS: tl.constexpr):
    """One token's gated delta-rule step on a state tile ``s`` [BK, BV] (float32): token row
    ``at``'s q, k (head ``hk``, L2-normalised, q scaled) and v, beta and decay (value head
    ``hv``). Returns (the stepped tile, the output row before any live mask)."""
    q = tl.load(q_ptr + at * stride_qb + hk * stride_qh + kk * stride_qd, mask=k_in, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + at * stride_kb + hk * stride_kh + kk * stride_kd, mask=k_in, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + at * stride_vb + hv * stride_vh + vv * stride_vd, mask=v_in, other=0.0).to(tl.float32)
    q = q / tl.sqrt(tl.sum(q * q, 0) + EPS) * scale
    k = k / tl.sqrt(tl.sum(k * k, 0) + EPS)
    b_raw = tl.load(b_ptr + at * stride_bb + hv * stride_bh)
    beta = tl.sigmoid(b_raw.to(tl.float32)).to(b_raw.dtype).to(tl.float32)
    a = tl.load(a_ptr + at * stride_ab + hv * stride_ah).to(tl.float32)
    g = -tl.exp(tl.load(a_log_ptr + hv).to(tl.float32)) * _softplus(a + tl.load(dt_bias_ptr + hv).to(tl.float32))
    s = s * tl.exp(g)
    delta = (v - tl.sum(s * k[:, None], 0)) * beta
    s = s + k[:, None] * delta[None, :]
    return s, tl.sum(s * q[:, None], 0)


@triton.jit
def _head_tile(GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """A rule program's place (grid: rows, value heads, value blocks): its row, value head and
    key head, and its key and value indices with their bounds."""
    row = tl.program_id(0)
    hv = tl.program_id(1)
    kk = tl.arange(0, BK)
    vv = tl.program_id(2) * BV + tl.arange(0, BV)
    return row, hv, hv // GROUP, kk, vv, kk < DK, vv < DV


@triton.jit
def _decode_step_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, state_ptr, slots_ptr, live_ptr, out_ptr,
    scale,
    stride_qb, stride_qh, stride_qd, stride_kb, stride_kh, stride_kd, stride_vb, stride_vh, stride_vd,
    stride_ab, stride_ah, stride_bb, stride_bh, stride_slot, stride_live,
    stride_ss, stride_sh, stride_sk, stride_sv, stride_ob, stride_oh, stride_od,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    EPS: tl.constexpr,
):
    row, hv, hk, kk, vv, k_in, v_in = _head_tile(GROUP, DK, DV, BK, BV)
    live = tl.load(live_ptr + row * stride_live) != 0
    slot = tl.where(live, tl.load(slots_ptr + row * stride_slot), 0).to(tl.int64)
    # `live` folded into a bound: Triton's interpreter mis-types scalar & tensor masks.
    s_mask = (kk[:, None] < tl.where(live, DK, 0)) & v_in[None, :]

    s_ptrs = state_ptr + slot * stride_ss + hv * stride_sh + kk[:, None] * stride_sk + vv[None, :] * stride_sv
    s, o = _rule_step(tl.load(s_ptrs, mask=s_mask, other=0.0), q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, a_log_ptr,
                      dt_bias_ptr, row, hk, hv, kk, vv, k_in, v_in, scale, stride_qb, stride_qh, stride_qd,
                      stride_kb, stride_kh, stride_kd, stride_vb, stride_vh, stride_vd, stride_ab, stride_ah,
                      stride_bb, stride_bh, EPS)
    o = tl.where(live, o, 0.0)
    tl.store(s_ptrs, s, mask=s_mask)
    tl.store(out_ptr + row * stride_ob + hv * stride_oh + vv * stride_od, o.to(out_ptr.dtype.element_ty), mask=v_in)


def gdn_decode_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                    A_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor, slots: torch.Tensor,
                    live: torch.Tensor, *, out: torch.Tensor | None = None, block_v: int = 32,
                    num_warps: int = 4) -> torch.Tensor:
    """One gated delta-rule step for ``B`` rows, each on its own state row, updated in place.

    q, k ``[B, Hk, Dk]`` and v ``[B, Hv, Dv]`` (any strides, e.g. views of the conv output,
    before L2 normalisation); a, b ``[B, Hv]`` raw gate inputs; A_log, dt_bias ``[Hv]``;
    state ``[rows, Hv, Dk, Dv]`` float32; slots, live ``[B]``. Returns ``[B, Hv, Dv]`` in v's
    dtype (zeros on rows that are not live)."""
    B, Hk, Dk, Hv, Dv = _rule_geometry(q, k, v, state, "B")
    for name, t, shape in (("a", a, (B, Hv)), ("b", b, (B, Hv)), ("A_log", A_log, (Hv,)),
                           ("dt_bias", dt_bias, (Hv,)), ("slots", slots, (B,)), ("live", live, (B,))):
        _check_shape(name, t, shape)
    out = _output(out, (B, Hv, Dv), v)
    if B == 0:
        return out
    block_v = min(block_v, triton.next_power_of_2(Dv))
    _decode_step_kernel[(B, Hv, triton.cdiv(Dv, block_v))](
        q, k, v, a, b, A_log, dt_bias, state, slots, live, out, Dk ** -0.5,
        *q.stride(), *k.stride(), *v.stride(), *a.stride(), *b.stride(), slots.stride(0), live.stride(0),
        *state.stride(), *out.stride(),
        GROUP=Hv // Hk, DK=Dk, DV=Dv, BK=triton.next_power_of_2(Dk), BV=block_v, EPS=_L2_EPS,
        num_warps=num_warps,
    )
    return out


@triton.jit
def _prefill_recurrent_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slot_ptr, count_ptr, out_ptr, T, scale,
    stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
    stride_gt, stride_gh, stride_bt, stride_bh, stride_ss, stride_sh, stride_sk, stride_sv,
    stride_ot, stride_oh, stride_od,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    EPS: tl.constexpr,
):
    hv = tl.program_id(0)
    vb = tl.program_id(1)
    hk = hv // GROUP
    n = tl.minimum(tl.maximum(tl.load(count_ptr), 0), T)
    slot = tl.load(slot_ptr).to(tl.int64)
    kk = tl.arange(0, BK)
    vv = vb * BV + tl.arange(0, BV)
    k_in = kk < DK
    v_in = vv < DV
    s_mask = k_in[:, None] & v_in[None, :]
    s_ptrs = state_ptr + slot * stride_ss + hv * stride_sh + kk[:, None] * stride_sk + vv[None, :] * stride_sv
    s = tl.load(s_ptrs, mask=s_mask, other=0.0)
    # Each token's inputs are loaded one iteration ahead (registers carried round the
    # loop), so their latency overlaps the previous token's update instead of stalling it.
    # (The row after the last is clamped to the chunk's last: read, never used.)
    q_n = tl.load(q_ptr + hk * stride_qh + kk * stride_qd, mask=k_in, other=0.0)
    k_n = tl.load(k_ptr + hk * stride_kh + kk * stride_kd, mask=k_in, other=0.0)
    v_n = tl.load(v_ptr + hv * stride_vh + vv * stride_vd, mask=v_in, other=0.0)
    g_n = tl.load(g_ptr + hv * stride_gh)
    b_n = tl.load(beta_ptr + hv * stride_bh)
    for t in range(0, n):
        q = q_n.to(tl.float32)
        k = k_n.to(tl.float32)
        v = v_n.to(tl.float32)
        g = g_n
        beta = b_n.to(tl.float32)
        nx = tl.minimum(t + 1, T - 1)
        q_n = tl.load(q_ptr + nx * stride_qt + hk * stride_qh + kk * stride_qd, mask=k_in, other=0.0)
        k_n = tl.load(k_ptr + nx * stride_kt + hk * stride_kh + kk * stride_kd, mask=k_in, other=0.0)
        v_n = tl.load(v_ptr + nx * stride_vt + hv * stride_vh + vv * stride_vd, mask=v_in, other=0.0)
        g_n = tl.load(g_ptr + nx * stride_gt + hv * stride_gh)
        b_n = tl.load(beta_ptr + nx * stride_bt + hv * stride_bh)
        q = q / tl.sqrt(tl.sum(q * q, 0) + EPS) * scale
        k = k / tl.sqrt(tl.sum(k * k, 0) + EPS)
        s = s * tl.exp(g)
        delta = (v - tl.sum(s * k[:, None], 0)) * beta
        s = s + k[:, None] * delta[None, :]
        o = tl.sum(s * q[:, None], 0)
        tl.store(out_ptr + t * stride_ot + hv * stride_oh + vv * stride_od, o.to(out_ptr.dtype.element_ty), mask=v_in)
    tl.store(s_ptrs, s, mask=s_mask)
    zero = tl.zeros([BV], tl.float32).to(out_ptr.dtype.element_ty)
    for t in range(n, T):  # tokens past the count: zeros, as the chunk's other outputs
        tl.store(out_ptr + t * stride_ot + hv * stride_oh + vv * stride_od, zero, mask=v_in)


def gdn_prefill_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                          state: torch.Tensor, slot: torch.Tensor, count: torch.Tensor, *,
                          out: torch.Tensor | None = None, block_v: int = 16, num_warps: int = 1) -> torch.Tensor:
    """The gated delta rule over one slot's chunk, token by token, from and into that
    slot's state row (in place).

    q, k ``[T, Hk, Dk]`` and v ``[T, Hv, Dv]`` (any strides, before L2 normalisation);
    g ``[T, Hv]`` float32 and beta ``[T, Hv]`` as ``gdn_prefill_gates`` gives them; state
    ``[rows, Hv, Dk, Dv]`` float32; slot and count: integer device tensors whose first
    element is the slot row and the number of valid tokens. Returns ``[T, Hv, Dv]`` in
    v's dtype, zeros from token ``count`` on."""
    T, Hk, Dk, Hv, Dv = _rule_geometry(q, k, v, state, "T")
    _check_shape("g", g, (T, Hv))
    _check_shape("beta", beta, (T, Hv))
    if slot.numel() < 1 or count.numel() < 1:
        raise ValueError("slot and count must each hold at least one element")
    out = _output(out, (T, Hv, Dv), v)
    if T == 0:
        return out
    block_v = min(block_v, triton.next_power_of_2(Dv))
    _prefill_recurrent_kernel[(Hv, triton.cdiv(Dv, block_v))](
        q, k, v, g, beta, state, slot, count, out, T, Dk ** -0.5,
        *q.stride(), *k.stride(), *v.stride(), *g.stride(), *beta.stride(), *state.stride(), *out.stride(),
        GROUP=Hv // Hk, DK=Dk, DV=Dv, BK=triton.next_power_of_2(Dk), BV=block_v, EPS=_L2_EPS,
        num_warps=num_warps,
    )
    return out


@triton.jit
def _conv_step_kernel(
    x_ptr, state_ptr, w_ptr, bias_ptr, slots_ptr, live_ptr, out_ptr, D,
    stride_xb, stride_xd, stride_ss, stride_sd, stride_sw, stride_wd, stride_ww,
    stride_ob, stride_od, stride_slot, stride_live,
    W: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_C: tl.constexpr,
):
    row = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_in = c < D
    live = tl.load(live_ptr + row * stride_live) != 0
    slot = tl.where(live, tl.load(slots_ptr + row * stride_slot), 0).to(tl.int64)
    s_mask = c < tl.where(live, D, 0)
    hist = state_ptr + slot * stride_ss + c * stride_sd
    x = tl.load(x_ptr + row * stride_xb + c * stride_xd, mask=c_in, other=0.0).to(state_ptr.dtype.element_ty)

    acc = tl.zeros([BLOCK_C], tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + c, mask=c_in, other=0.0).to(tl.float32)
    for j in tl.static_range(W - 1):
        h = tl.load(hist + j * stride_sw, mask=s_mask, other=0.0)
        acc += tl.load(w_ptr + c * stride_wd + j * stride_ww, mask=c_in, other=0.0).to(tl.float32) * h.to(tl.float32)
    acc += tl.load(w_ptr + c * stride_wd + (W - 1) * stride_ww, mask=c_in, other=0.0).to(tl.float32) * x.to(tl.float32)
    # Shift the history left by one: each channel's loads and stores stay in one thread
    # (1-D vectors of one layout), so the in-place shift needs no barrier.
    for j in tl.static_range(W - 2):
        tl.store(hist + j * stride_sw, tl.load(hist + (j + 1) * stride_sw, mask=s_mask, other=0.0), mask=s_mask)
    tl.store(hist + (W - 2) * stride_sw, x, mask=s_mask)
    y = tl.where(live, _silu_rounded(acc, w_ptr.dtype.element_ty), 0.0)
    tl.store(out_ptr + row * stride_ob + c * stride_od, y.to(out_ptr.dtype.element_ty), mask=c_in)


def _conv_weight(weight: torch.Tensor, D: int) -> torch.Tensor:
    w = weight.squeeze(1) if weight.dim() == 3 else weight  # nn.Conv1d's [D, 1, W]
    if w.dim() != 2 or w.shape[0] != D or w.shape[1] < 2:
        raise ValueError(f"conv weight has shape {tuple(weight.shape)}, expected [{D}, 1, W] or [{D}, W] with W >= 2")
    return w


def _conv_args(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               out: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight as [D, W] and the output, after checking every shape against x [N, D]."""
    if x.dim() != 2:
        raise ValueError(f"x has shape {tuple(x.shape)}, expected [tokens or rows, channels]")
    D = x.shape[1]
    w = _conv_weight(weight, D)
    if conv_state.dim() != 3 or conv_state.shape[1:] != (D, w.shape[1] - 1):
        raise ValueError(f"conv_state has shape {tuple(conv_state.shape)}, expected [rows, {D}, {w.shape[1] - 1}]")
    if bias is not None:
        _check_shape("conv bias", bias, (D,))
    return w, _output(out, tuple(x.shape), x)


def conv1d_decode_step(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       slots: torch.Tensor, live: torch.Tensor, *, out: torch.Tensor | None = None,
                       block_c: int = 256, num_warps: int = 4) -> torch.Tensor:
    """Causal depthwise conv + SiLU of one new input per row; the history shifts in place.

    x ``[B, D]``; conv_state ``[rows, D, W-1]``; weight ``[D, 1, W]``; bias ``[D]`` or None;
    slots, live ``[B]``. Returns ``[B, D]`` in x's dtype (zeros on rows that are not live,
    whose history is left untouched)."""
    w, out = _conv_args(x, conv_state, weight, bias, out)
    B, D = x.shape
    _check_shape("slots", slots, (B,))
    _check_shape("live", live, (B,))
    if B == 0:
        return out
    block_c = min(block_c, triton.next_power_of_2(D))
    _conv_step_kernel[(B, triton.cdiv(D, block_c))](
        x, conv_state, w, bias if bias is not None else w, slots, live, out, D,
        *x.stride(), *conv_state.stride(), *w.stride(), *out.stride(), slots.stride(0), live.stride(0),
        W=w.shape[1], HAS_BIAS=bias is not None, BLOCK_C=block_c, num_warps=num_warps,
    )
    return out


@triton.jit
def _conv_chunk_kernel(
    x_ptr, state_ptr, w_ptr, bias_ptr, slot_ptr, count_ptr, out_ptr, T, D,
    stride_xt, stride_xd, stride_ss, stride_sd, stride_sw, stride_wd, stride_ww, stride_ot, stride_od,
    W: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    tb = tl.program_id(0)
    t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_in = c < D
    n = tl.minimum(tl.maximum(tl.load(count_ptr), 0), T)
    hist = state_ptr + tl.load(slot_ptr).to(tl.int64) * stride_ss + c * stride_sd
    dtype = state_ptr.dtype.element_ty

    acc = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + c, mask=c_in, other=0.0).to(tl.float32)[None, :]
    for j in tl.static_range(W):
        p = t + (j - (W - 1))  # input position; p < 0 reads the history (token block 0 only)
        xv = tl.load(x_ptr + p[:, None] * stride_xt + c[None, :] * stride_xd,
                     mask=((p >= 0) & (p < T))[:, None] & c_in[None, :], other=0.0).to(dtype)
        hv = tl.load(hist[None, :] + (p + (W - 1))[:, None] * stride_sw,
                     mask=(p < 0)[:, None] & c_in[None, :], other=0.0)
        val = tl.where((p >= 0)[:, None], xv, hv).to(tl.float32)
        acc += tl.load(w_ptr + c * stride_wd + j * stride_ww, mask=c_in, other=0.0).to(tl.float32)[None, :] * val
    y = tl.where((t < n)[:, None], _silu_rounded(acc, w_ptr.dtype.element_ty), 0.0)
    tl.store(out_ptr + t[:, None] * stride_ot + c[None, :] * stride_od, y.to(out_ptr.dtype.element_ty),
             mask=(t < T)[:, None] & c_in[None, :])

    if tb == 0:
        # The new history is the last W-1 inputs of (history ++ x[:n]). Only this program
        # reads the old history (BLOCK_T >= W-1); the barrier orders the tile's reads above,
        # made by other threads of the program, before the writes below. Below, a channel's
        # loads and stores stay in one thread, and column i is written only after every
        # column it could still need (n + i' >= i' > i) has been read.
        tl.debug_barrier()
        # (Names differ from the tile loop's: Triton keeps one type per name across blocks.)
        for i in tl.static_range(W - 1):
            src = n - (W - 1) + i
            new = tl.load(x_ptr + tl.maximum(src, 0) * stride_xt + c * stride_xd,
                          mask=c < tl.where(src >= 0, D, 0), other=0.0).to(dtype)
            old = tl.load(hist + (src + (W - 1)) * stride_sw, mask=c < tl.where(src < 0, D, 0), other=0.0)
            tl.store(hist + i * stride_sw, tl.where(src >= 0, new, old), mask=c_in)


def conv1d_prefill_chunk(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         slot: torch.Tensor, count: torch.Tensor, *, out: torch.Tensor | None = None,
                         block_t: int = 32, block_c: int = 128, num_warps: int = 4) -> torch.Tensor:
    """Causal depthwise conv + SiLU over one slot's chunk, continuing that slot's history.

    x ``[T, D]`` (token-major, any strides); conv_state ``[rows, D, W-1]``; slot and count:
    integer device tensors whose first element is the slot row and the number of valid
    tokens. Returns ``[T, D]`` in x's dtype, zeros from token ``count`` on; the slot's
    history becomes the last W-1 inputs of (history ++ x[:count])."""
    w, out = _conv_args(x, conv_state, weight, bias, out)
    T, D = x.shape
    if slot.numel() < 1 or count.numel() < 1:
        raise ValueError("slot and count must each hold at least one element")
    if block_t < w.shape[1] - 1:
        raise ValueError(f"block_t {block_t} is below the history length {w.shape[1] - 1}")
    if T == 0:
        return out
    block_c = min(block_c, triton.next_power_of_2(D))
    _conv_chunk_kernel[(triton.cdiv(T, block_t), triton.cdiv(D, block_c))](
        x, conv_state, w, bias if bias is not None else w, slot, count, out, T, D,
        *x.stride(), *conv_state.stride(), *w.stride(), *out.stride(),
        W=w.shape[1], HAS_BIAS=bias is not None, BLOCK_T=block_t, BLOCK_C=block_c, num_warps=num_warps,
    )
    return out


@triton.jit
def _gates_kernel(
    a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, count_ptr, g_ptr, beta_ptr, T, H,
    stride_at, stride_ah, stride_bt, stride_bh, stride_gt, stride_gh, stride_et, stride_eh,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.arange(0, BLOCK_H)
    h_in = h < H
    mask = (t < T)[:, None] & h_in[None, :]
    valid = (t < tl.load(count_ptr))[:, None]
    a = tl.load(a_ptr + t[:, None] * stride_at + h[None, :] * stride_ah, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + t[:, None] * stride_bt + h[None, :] * stride_bh, mask=mask, other=0.0)
    A = tl.exp(tl.load(a_log_ptr + h, mask=h_in, other=0.0).to(tl.float32))
    g = -A[None, :] * _softplus(a + tl.load(dt_bias_ptr + h, mask=h_in, other=0.0).to(tl.float32)[None, :])
    beta = tl.sigmoid(b.to(tl.float32)).to(b.dtype)
    # Invalid tokens get zero decay and zero beta: the recurrence passes through them.
    tl.store(g_ptr + t[:, None] * stride_gt + h[None, :] * stride_gh, tl.where(valid, g, 0.0), mask=mask)
    tl.store(beta_ptr + t[:, None] * stride_et + h[None, :] * stride_eh,
             tl.where(valid, beta.to(tl.float32), 0.0).to(beta_ptr.dtype.element_ty), mask=mask)


def gdn_prefill_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                      count: torch.Tensor, *, g_out: torch.Tensor | None = None,
                      beta_out: torch.Tensor | None = None, block_t: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """``g = -exp(A_log) * softplus(a + dt_bias)`` (float32) and ``beta = sigmoid(b)`` (b's dtype)
    for a chunk's ``[T, Hv]`` gate inputs; both are zero from token ``count[0]`` on."""
    if a.dim() != 2 or b.shape != a.shape:
        raise ValueError(f"a {tuple(a.shape)} / b {tuple(b.shape)}: expected both [T, Hv]")
    T, H = a.shape
    _check_shape("A_log", A_log, (H,))
    _check_shape("dt_bias", dt_bias, (H,))
    g = torch.empty((T, H), dtype=torch.float32, device=a.device) if g_out is None else g_out
    beta = _output(beta_out, (T, H), b)
    _check_shape("g_out", g, (T, H))
    if T == 0:
        return g, beta
    _gates_kernel[(triton.cdiv(T, block_t),)](
        a, b, A_log, dt_bias, count, g, beta, T, H, *a.stride(), *b.stride(), *g.stride(), *beta.stride(),
        BLOCK_T=block_t, BLOCK_H=triton.next_power_of_2(H), num_warps=4,
    )
    return g, beta


@triton.jit
def _gated_norm_kernel(x_ptr, z_ptr, w_ptr, out_ptr, D, stride_xt, stride_xh, stride_zt, stride_zh, stride_ot,
                       stride_oh, eps, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK)
    d_in = d < D
    x = tl.load(x_ptr + t * stride_xt + h * stride_xh + d, mask=d_in, other=0.0)
    dtype = x.dtype
    xf = x.to(tl.float32)
    normed = (xf * tl.rsqrt(tl.sum(xf * xf, axis=0) / D + eps)).to(dtype)
    scaled = (tl.load(w_ptr + d, mask=d_in, other=0.0).to(tl.float32) * normed.to(tl.float32)).to(dtype)
    z = tl.load(z_ptr + t * stride_zt + h * stride_zh + d, mask=d_in, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, (scaled.to(tl.float32) * (z * tl.sigmoid(z))).to(dtype),
             mask=d_in)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Transformers' gated RMS norm of a Gated DeltaNet's output (``Qwen3_5RMSNormGated``,
    ``Qwen3NextRMSNormGated`` with a SiLU gate) over heads ``x [T, H, D]``, gate ``z [T, H, D]``
    (any strides but unit along D: a view of the input projection), weight ``[D]``, in one launch
    of a program a head: in float32 ``x * rsqrt(mean(x^2) + eps)`` rounded to x's dtype, times
    the weight (rounded), times ``silu(z)``, rounded, as the module's casts do. Compiled, the
    module is a reduction and a pointwise kernel before the few-row GEMV (a custom op), one
    kernel before cuBLAS. The weight in x's dtype (the module's product rounds to it then).
    Returns ``[T, H, D]`` (contiguous)."""
    if x.dim() != 3 or z.shape != x.shape or weight.shape != (x.shape[2],) or weight.dtype != x.dtype:
        raise ValueError(f"x {tuple(x.shape)} / z {tuple(z.shape)} / weight {tuple(weight.shape)} {weight.dtype}: "
                         f"expected [T, H, D], [T, H, D] and [D] in x's dtype {x.dtype}")
    if x.stride(2) != 1 or z.stride(2) != 1:
        raise ValueError("gated_rms_norm takes heads with unit stride")
    out = _output(None, tuple(x.shape), x)
    T, H, D = x.shape
    if T * H:
        block = triton.next_power_of_2(D)
        _gated_norm_kernel[(T, H)](x, z, weight, out, D, x.stride(0), x.stride(1), z.stride(0), z.stride(1),
                                   out.stride(0), out.stride(1), eps, BLOCK=block, num_warps=1 if block <= 256 else 4)
    return out


# -- verify programs: W positions of each row in one launch ---------------------------------

@triton.jit
def _verify_conv_kernel(
    x_ptr, state_ptr, w_ptr, bias_ptr, slots_ptr, valid_ptr, out_ptr, steps_ptr, D, WIDTH,
    stride_xb, stride_xd, stride_ss, stride_sd, stride_sw, stride_wd, stride_ww,
    stride_ob, stride_od, stride_slot, stride_valid,
    stride_pb, stride_pj, stride_pd, stride_pw,
    W: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_C: tl.constexpr,
):
    row = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_in = c < D
    slot = tl.load(slots_ptr + row * stride_slot).to(tl.int64)
    hist = state_ptr + slot * stride_ss + c * stride_sd
    steps = steps_ptr + row * stride_pb + c * stride_pd
    w_last = tl.load(w_ptr + c * stride_wd + (W - 1) * stride_ww, mask=c_in, other=0.0).to(tl.float32)
    # The history in registers, oldest first (W - 1 <= 3 taps: Qwen3.5's kernel is 4 wide).
    h0 = tl.load(hist, mask=c_in, other=0.0)
    h1 = tl.load(hist + 1 * stride_sw, mask=c_in & (W > 2), other=0.0)
    h2 = tl.load(hist + 2 * stride_sw, mask=c_in & (W > 3), other=0.0)
    for j in range(WIDTH):
        at = row * WIDTH + j
        live = tl.load(valid_ptr + at * stride_valid) != 0
        x = tl.load(x_ptr + at * stride_xb + c * stride_xd, mask=c_in, other=0.0).to(state_ptr.dtype.element_ty)
        acc = tl.zeros([BLOCK_C], tl.float32)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + c, mask=c_in, other=0.0).to(tl.float32)
        acc += tl.load(w_ptr + c * stride_wd, mask=c_in, other=0.0).to(tl.float32) * h0.to(tl.float32)
        if W > 2:
            acc += tl.load(w_ptr + c * stride_wd + stride_ww, mask=c_in, other=0.0).to(tl.float32) * h1.to(tl.float32)
        if W > 3:
            acc += (tl.load(w_ptr + c * stride_wd + 2 * stride_ww, mask=c_in, other=0.0).to(tl.float32)
                    * h2.to(tl.float32))
        acc += w_last * x.to(tl.float32)
        # A position past the row's drafts leaves the history as it is and outputs zeros.
        if W == 2:
            h0 = tl.where(live, x, h0)
        elif W == 3:
            h0, h1 = tl.where(live, h1, h0), tl.where(live, x, h1)
        else:
            h0, h1, h2 = tl.where(live, h1, h0), tl.where(live, h2, h1), tl.where(live, x, h2)
        tl.store(steps + j * stride_pj, h0, mask=c_in)
        if W > 2:
            tl.store(steps + j * stride_pj + stride_pw, h1, mask=c_in)
        if W > 3:
            tl.store(steps + j * stride_pj + 2 * stride_pw, h2, mask=c_in)
        y = tl.where(live, _silu_rounded(acc, w_ptr.dtype.element_ty), 0.0)
        tl.store(out_ptr + at * stride_ob + c * stride_od, y.to(out_ptr.dtype.element_ty), mask=c_in)


def conv1d_verify_steps(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        slots: torch.Tensor, valid: torch.Tensor, steps: torch.Tensor, *,
                        out: torch.Tensor | None = None, block_c: int = 256, num_warps: int = 4) -> torch.Tensor:
    """``conv1d_decode_step`` over the W positions of each of B rows in one launch, from the
    row's slot history, which is left untouched: x ``[B * W, D]`` (row b's positions at
    b * W ..); slots ``[B]``; valid ``[B * W]`` (a position that is not valid leaves the
    history as it is and outputs zeros); ``steps [B, W, D, K-1]`` receives the history after
    each position. The same arithmetic as W decode steps in a row. Kernels up to 4 wide."""
    w, out = _conv_args(x, conv_state, weight, bias, out)
    N, D = x.shape
    B = slots.shape[0]
    if B == 0 or N % B:
        raise ValueError(f"x has {N} rows, not a multiple of the {B} rows' slots")
    width = N // B
    if w.shape[1] > 4:
        raise ValueError(f"conv1d_verify_steps: kernels up to 4 wide, not {w.shape[1]}")
    _check_shape("valid", valid, (N,))
    _check_shape("steps", steps, (B, width, D, w.shape[1] - 1))
    block_c = min(block_c, triton.next_power_of_2(D))
    _verify_conv_kernel[(B, triton.cdiv(D, block_c))](
        x, conv_state, w, bias if bias is not None else w, slots, valid, out, steps, D, width,
        *x.stride(), *conv_state.stride(), *w.stride(), *out.stride(), slots.stride(0), valid.stride(0),
        *steps.stride(), W=w.shape[1], HAS_BIAS=bias is not None, BLOCK_C=block_c, num_warps=num_warps,
    )
    return out


@triton.jit
def _verify_rule_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, state_ptr, slots_ptr, valid_ptr, out_ptr, steps_ptr,
    scale, WIDTH,
    stride_qb, stride_qh, stride_qd, stride_kb, stride_kh, stride_kd, stride_vb, stride_vh, stride_vd,
    stride_ab, stride_ah, stride_bb, stride_bh, stride_slot, stride_valid,
    stride_ss, stride_sh, stride_sk, stride_sv, stride_ob, stride_oh, stride_od,
    stride_pb, stride_pj, stride_ph, stride_pk, stride_pv,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    EPS: tl.constexpr,
):
    row, hv, hk, kk, vv, k_in, v_in = _head_tile(GROUP, DK, DV, BK, BV)
    slot = tl.load(slots_ptr + row * stride_slot).to(tl.int64)
    s_mask = k_in[:, None] & v_in[None, :]
    s = tl.load(state_ptr + slot * stride_ss + hv * stride_sh + kk[:, None] * stride_sk + vv[None, :] * stride_sv,
                mask=s_mask, other=0.0)
    for j in range(WIDTH):
        at = row * WIDTH + j
        live = tl.load(valid_ptr + at * stride_valid) != 0
        stepped, o = _rule_step(s, q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, at, hk, hv, kk, vv,
                                k_in, v_in, scale, stride_qb, stride_qh, stride_qd, stride_kb, stride_kh, stride_kd,
                                stride_vb, stride_vh, stride_vd, stride_ab, stride_ah, stride_bb, stride_bh, EPS)
        o = tl.where(live, o, 0.0)
        # A position past the row's drafts leaves the state as it is.
        s = tl.where(live, stepped, s)
        tl.store(steps_ptr + row * stride_pb + j * stride_pj + hv * stride_ph + kk[:, None] * stride_pk
                 + vv[None, :] * stride_pv, s, mask=s_mask)
        tl.store(out_ptr + at * stride_ob + hv * stride_oh + vv * stride_od, o.to(out_ptr.dtype.element_ty),
                 mask=v_in)


def gdn_verify_steps(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                     A_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor, slots: torch.Tensor,
                     valid: torch.Tensor, steps: torch.Tensor, *, out: torch.Tensor | None = None, block_v: int = 32,
                     num_warps: int = 4) -> torch.Tensor:
    """``gdn_decode_step`` over the W positions of each of B rows in one launch, from the
    row's slot state, which is left untouched: q, k ``[B * W, Hk, Dk]``, v ``[B * W, Hv, Dv]``,
    a, b ``[B * W, Hv]`` (row b's positions at b * W ..); slots ``[B]``; valid ``[B * W]`` (a
    position that is not valid leaves the state as it is and outputs zeros); ``steps [B, W,
    Hv, Dk, Dv]`` float32 receives the state after each position. The same arithmetic as W
    decode steps in a row (the state stays in registers between them: float32 either way)."""
    N, Hk, Dk, Hv, Dv = _rule_geometry(q, k, v, state, "B * W")
    B = slots.shape[0]
    if B == 0 or N % B:
        raise ValueError(f"q has {N} rows, not a multiple of the {B} rows' slots")
    width = N // B
    for name, t, shape in (("a", a, (N, Hv)), ("b", b, (N, Hv)), ("A_log", A_log, (Hv,)),
                           ("dt_bias", dt_bias, (Hv,)), ("valid", valid, (N,)),
                           ("steps", steps, (B, width, Hv, Dk, Dv))):
        _check_shape(name, t, shape)
    out = _output(out, (N, Hv, Dv), v)
    block_v = min(block_v, triton.next_power_of_2(Dv))
    _verify_rule_kernel[(B, Hv, triton.cdiv(Dv, block_v))](
        q, k, v, a, b, A_log, dt_bias, state, slots, valid, out, steps, Dk ** -0.5, width,
        *q.stride(), *k.stride(), *v.stride(), *a.stride(), *b.stride(), slots.stride(0), valid.stride(0),
        *state.stride(), *out.stride(), *steps.stride(),
        GROUP=Hv // Hk, DK=Dk, DV=Dv, BK=triton.next_power_of_2(Dk), BV=block_v, EPS=_L2_EPS,
        num_warps=num_warps,
    )
    return out
