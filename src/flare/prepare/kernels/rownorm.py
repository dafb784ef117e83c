"""RMS norms whose prompt rows do not depend on how many rows the program has.

The decoder layers are compiled by Inductor, which turns an RMS norm's mean of squares
into a reduction kernel per program capacity and picks that kernel's blocks and warps by
the capacity's row count (and, for rows longer than 1,024, among candidates by timing
them): a wider block or more warps sum a row in another order, so a prompt token's norm
can round differently in a 32-row program (a follow-up's suffix, prefix cache on) than in
a 512-row one (the same prompt prefilled whole). The linear layers had the same problem
(``gemm.py``).

In prompt programs (``prompt_rows.active()``) the norms of the model take their mean of
squares from ``mean_square``: one Triton program per row, whose block and warps follow
from the row's length only, so every row sums in the same order in every program. The
rest of each norm is elementwise and stays in the compiled graph, where Inductor fuses it
as before. Decode and verify steps keep Inductor's reduction (their rows need not equal a
prefill's), unless ``steps`` (``--step-norms invariant``): Inductor compiles a reduction per
step program too, so at rows over 1,024 values (timed candidates) a decode row's bits could
depend on how many rows its step has (the qwen3-next core's batch-invariance failure on the
H200, gone with this); with ``steps`` (a module's ``flare_step_rows``) those programs take the
whole norm from ``rms_norm``, one launch (the mean of squares as a kernel of its own, the rest
compiled, was two launches and a float32 copy of the input), and a decoder layer's residual add
before its post-attention norm goes into that launch (``flare_add_norm``, called by
``fused.add_norm``); the gated norm takes ``mean_square``.

Norm classes are switched by what their code is (its syntax tree, so comments, layout and
annotations do not count), not their name: a class whose ``_norm``
is Transformers' zero-centred one (Qwen3.5, Qwen3-Next: ``x * rsqrt(mean(x^2) + eps)``,
scaled by ``1 + weight`` in its forward) gets that ``_norm``; a class whose ``forward`` is
Llama's (Llama, Qwen2/3, Qwen3-MoE, Mistral) or the gated one of a Gated DeltaNet gets that
forward with the mean of squares swapped. Any other norm is left as it is and reported.
"""

from __future__ import annotations

import ast
import inspect
import textwrap

import torch
import triton
import triton.language as tl
from torch import nn
from torch.library import triton_op, wrap_triton
from transformers.activations import ACT2FN

from flare.prepare import prompt_rows


MAX_ROW = 16384  # one block a row; norms of longer rows are left to the compiler


@triton.jit
def _mean_square_kernel(x_ptr, out_ptr, N, stride_x, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    n = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + n, mask=n < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + row, tl.sum(x * x, axis=0) / N)


def _warps(n: int) -> int:
    return 4 if n <= 1024 else 8 if n <= 4096 else 16


@triton_op("flare::mean_square", mutates_args=())
def _mean_square_op(x: torch.Tensor) -> torch.Tensor:
    rows, n = x.shape
    out = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows:
        block = triton.next_power_of_2(n)
        wrap_triton(_mean_square_kernel)[(rows,)](x, out, n, x.stride(0), BLOCK=block, num_warps=_warps(block))
    return out


def mean_square(x: torch.Tensor) -> torch.Tensor:
    """``x.float().pow(2).mean(-1, keepdim=True)`` in float32, each row summed in one fixed
    order whatever the number of rows (a custom op: a compiled layer calls it without a
    graph break). Rows up to ``MAX_ROW`` long."""
    n = x.shape[-1]
    if n > MAX_ROW:
        raise ValueError(f"mean_square: rows of {n} exceed {MAX_ROW}")
    return _mean_square_op(_rows2d(x)).reshape(*x.shape[:-1], 1)


@triton.jit
def _scaled(xn, w, DTYPE: tl.constexpr, ZERO_CENTRED: tl.constexpr):
    """A normalised float32 row ``xn`` scaled by its norm's weight ``w`` (float32): by ``1 + w``
    (ZERO_CENTRED, Qwen3.5's), or as Llama's, ``xn`` rounded to DTYPE first: what ``rms_norm``
    and ``qk_norm_rotary`` both compute, so their bits agree by construction."""
    if ZERO_CENTRED:
        y = xn * (1.0 + w)
    else:
        y = xn.to(DTYPE).to(tl.float32) * w
    return y


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, sum_ptr, N, stride_x, stride_r, stride_o, stride_s, eps,
                     BLOCK: tl.constexpr, ADD: tl.constexpr, ZERO_CENTRED: tl.constexpr):
    """One row a program: (ADD) ``x = residual + x`` rounded to x's dtype and stored, then the
    RMS norm of x with its mean of squares summed as ``_mean_square_kernel`` sums it; scaled
    by ``1 + weight`` in float32 (ZERO_CENTRED) or, as Llama's, rounded to x's dtype first and
    then scaled by the weight."""
    row = tl.program_id(0).to(tl.int64)
    n = tl.arange(0, BLOCK)
    keep = n < N
    x = tl.load(x_ptr + row * stride_x + n, mask=keep, other=0.0)
    if ADD:
        r = tl.load(r_ptr + row * stride_r + n, mask=keep, other=0.0)
        x = (r.to(tl.float32) + x.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_s + n, x, mask=keep)
    xf = x.to(tl.float32)
    w = tl.load(w_ptr + n, mask=keep, other=0.0).to(tl.float32)
    y = _scaled(xf * tl.math.rsqrt(tl.sum(xf * xf, axis=0) / N + eps), w, x_ptr.dtype.element_ty, ZERO_CENTRED)
    tl.store(out_ptr + row * stride_o + n, y.to(out_ptr.dtype.element_ty), mask=keep)


def _launch_norm(x, residual, weight, eps, zero_centred, out, total):
    rows, n = x.shape
    if rows:
        block = triton.next_power_of_2(n)
        r = x if residual is None else residual
        s = out if total is None else total
        wrap_triton(_rms_norm_kernel)[(rows,)](x, r, weight, out, s, n, x.stride(0), r.stride(0), out.stride(0),
                                               s.stride(0), eps, BLOCK=block, ADD=residual is not None,
                                               ZERO_CENTRED=zero_centred, num_warps=_warps(block))


def _out_dtype(x: torch.Tensor, weight: torch.Tensor, zero_centred: bool) -> torch.dtype:
    return x.dtype if zero_centred else torch.promote_types(x.dtype, weight.dtype)


@triton_op("flare::rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=_out_dtype(x, weight, zero_centred), device=x.device)
    _launch_norm(x, None, weight, eps, zero_centred, out, None)
    return out


@triton_op("flare::add_rms_norm", mutates_args=())
def _add_rms_norm_op(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float,
                     zero_centred: bool) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.empty(x.shape, dtype=_out_dtype(x, weight, zero_centred), device=x.device)
    total = torch.empty_like(x)
    _launch_norm(x, residual, weight, eps, zero_centred, out, total)
    return out, total


def _rows2d(x: torch.Tensor) -> torch.Tensor:
    """``x``'s rows as [rows, n]: a view where one exists (the kernel takes a row stride; the
    per-head q norm's rows are a strided view of the projection), copied only where the rows'
    values are not contiguous."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A whole RMS norm in one launch, each row in one program whatever the number of rows
    (a custom op): (normalised x, None), or with ``residual`` (of x's shape and dtype) the norm
    of ``residual + x`` and that sum, as a decoder layer's add before its norm (one launch where
    the add, the mean of squares and the scaling were three). ``zero_centred``: Qwen3.5's
    ``(x * rsqrt) * (1 + weight)`` in float32; otherwise Llama's ``weight * (x * rsqrt)`` with
    the normalised x rounded to x's dtype first. Rows up to ``MAX_ROW`` long."""
    n = x.shape[-1]
    if n > MAX_ROW or weight.shape != (n,):
        raise ValueError(f"rms_norm: rows of {n} (at most {MAX_ROW}) with a weight of {tuple(weight.shape)}")
    if residual is None:
        return _rms_norm_op(_rows2d(x), weight, eps, zero_centred).reshape(x.shape), None
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"rms_norm: residual {tuple(residual.shape)} {residual.dtype} for x "
                         f"{tuple(x.shape)} {x.dtype}")
    out, total = _add_rms_norm_op(_rows2d(residual), _rows2d(x), weight, eps, zero_centred)
    return out.reshape(x.shape), total.reshape(x.shape)


@triton.jit
def _qk_norm_rotary_kernel(q_ptr, k_ptr, v_ptr, wq_ptr, wk_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, vo_ptr, slot_ptr,
                           HQ, HK, R, pool_rows, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                           stride_ct, stride_st, stride_cp, stride_co, stride_ch, eps,
                           D: tl.constexpr, ZERO_CENTRED: tl.constexpr, PAGE: tl.constexpr,
                           NORM: tl.constexpr = True):
    """Program (token, head) over the token's query heads then its key heads: the head's RMS norm
    as ``_rms_norm_kernel`` computes a row (rounded to the output dtype), then the rotary embedding
    of its first R dims (``fused.rotary_without_cat``: dim d with its partner d +- R/2, the rest
    passed through) on those rounded values, in float32, rounded once: the per-head q/k norms and
    the rotary of an attention layer in one launch. The partner's normalised value is computed
    again from its own load (the same elementwise arithmetic, so the same bits).

    ``PAGE`` > 0: the keys go to the page pool instead of a tensor, and programs past the key
    heads copy the value heads there (``ko_ptr``/``vo_ptr`` the layer's key and value pages,
    token t's row at ``slot_ptr[t]``, as ``kv_write._write_kv_kernel`` writes them: a row whose
    slot is negative or past the pool writes nothing), so the write of the keys and values is no
    launch of its own. ``NORM`` False: the heads as they are (an attention without q/k norms,
    Llama's), rotated and written."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    n = tl.arange(0, D)
    dtype = qo_ptr.dtype.element_ty
    dst = tl.zeros([], tl.int64)
    ok = h >= 0
    if PAGE > 0:
        if h >= HQ:
            dst = tl.load(slot_ptr + t).to(tl.int64)
            ok = (dst >= 0) & (dst < pool_rows)
    page_row = (dst // PAGE) * stride_cp + (dst % PAGE) * stride_co if PAGE > 0 else dst
    if h < HQ + HK:
        is_q = h < HQ
        if is_q:
            x_row = q_ptr + t * stride_qt + h * stride_qh
            w_ptr = wq_ptr
            o_row = qo_ptr + (t * HQ + h) * D
        else:
            hk = h - HQ
            x_row = k_ptr + t * stride_kt + hk * stride_kh
            w_ptr = wk_ptr
            o_row = ko_ptr + page_row + hk * stride_ch if PAGE > 0 else ko_ptr + (t * HK + hk) * D
        half = R // 2
        partner = tl.where(n < half, n + half, tl.where(n < R, n - half, n))
        xf = tl.load(x_row + n).to(tl.float32)
        xp = tl.load(x_row + partner).to(tl.float32)
        if NORM:
            inv = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / D + eps)
            w = tl.load(w_ptr + n).to(tl.float32)
            wp = tl.load(w_ptr + partner).to(tl.float32)
            y = _scaled(xf * inv, w, dtype, ZERO_CENTRED).to(dtype).to(tl.float32)
            yp = _scaled(xp * inv, wp, dtype, ZERO_CENTRED).to(dtype).to(tl.float32)
        else:
            y, yp = xf, xp
        rot = n < R
        c = tl.load(cos_ptr + t * stride_ct + n, mask=rot, other=1.0).to(tl.float32)
        sn = tl.load(sin_ptr + t * stride_st + n, mask=rot, other=0.0).to(tl.float32)
        sign = tl.where(n < half, -1.0, 1.0)
        out = tl.where(rot, y * c + yp * sign * sn, y).to(dtype)
        if ok:  # (a padded row writes no key)
            tl.store(o_row + n, out.to(o_row.dtype.element_ty))
    else:  # (PAGE > 0) a value head, copied as it is
        hv = h - HQ - HK
        if ok:
            val = tl.load(v_ptr + t * stride_vt + hv * stride_vh + n)
            tl.store(vo_ptr + page_row + hv * stride_ch + n, val.to(vo_ptr.dtype.element_ty))


def _launch_qk_norm_rotary(q, k, v, wq, wk, cos, sin, eps, zero_centred, qo, ko, vo, slots, pool_rows, page):
    """``_qk_norm_rotary_kernel`` over ``q [T, Hq, D]``, ``k``/``v [T, Hk, D]``: ``page`` 0 writes
    the keys to ``ko`` (``[T, Hk, D]``, v unread), otherwise the keys and values to the pages
    ``ko``/``vo`` (``[P, page, Hk, D]``) at ``slots``."""
    tokens, hq, d = q.shape
    hk = k.shape[1]
    if tokens:
        cache = (ko.stride(0), ko.stride(1), ko.stride(2)) if page else (0, 0, 0)
        wrap_triton(_qk_norm_rotary_kernel)[(tokens, hq + (2 * hk if page else hk))](
            q, k, v, q if wq is None else wq, q if wk is None else wk, cos, sin, qo, ko, vo, slots, hq, hk,
            cos.shape[-1], pool_rows, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            cos.stride(0), sin.stride(0), *cache, eps, D=d,
            ZERO_CENTRED=zero_centred, PAGE=page, NORM=wq is not None, num_warps=_warps(d))


@triton_op("flare::qk_norm_rotary", mutates_args=())
def _qk_norm_rotary_op(q: torch.Tensor, k: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor, eps: float, zero_centred: bool) -> tuple[torch.Tensor, torch.Tensor]:
    qo = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    ko = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    _launch_qk_norm_rotary(q, k, k, wq, wk, cos, sin, eps, zero_centred, qo, ko, ko, cos, 0, 0)
    return qo, ko


def qk_norm_rotary(q_norm: nn.Module | None, k_norm: nn.Module | None, q: torch.Tensor, k: torch.Tensor,
                   cos: torch.Tensor, sin: torch.Tensor,
                   pages=None) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor | None:
    """An attention layer's per-head q and k norms and its rotary embedding in one launch, in a
    decode or verify step whose norms are row-invariant single launches (``_one_launch``, the
    same form for both, no forward hook, weights in the heads' dtype): ``q [B, T, Hq, D]`` and
    ``k [B, T, Hk, D]`` (the projection's views: unit stride within a head), ``cos``/``sin``
    ``[B, T, R]`` (R even, at most D; Transformers' ``rotate_half`` pairs). Returns the normalised,
    rotated q and k, contiguous ``[B, T, H, D]``; None where it does not apply
    (``qk_norm_rotary_applies``: the layer then runs the norms and the rotary as written: four
    launches for Qwen3.5's gated attention, two for Qwen3's, whose norms Inductor fuses with the
    rotary).

    ``pages``: ``(v, batch, layer)``, the values ``[B, T, Hk, D]`` (unit stride within a head) and
    the ``attention.PagedBatch`` whose pool layer ``layer`` takes the keys and the values at its
    ``slot_mapping`` in the same launch (``attention.flare_paged_attention``, outside the compiled
    graph); returns the rotated q alone then, or None where the values or the pool do not fit.
    Without it, a custom op that compiled code calls. Norms None (an attention without q/k norms,
    Llama's): the rotary and the write of the pages alone (``pages`` only), in a decode or verify
    step (not in a prompt program's rows)."""
    views = _qk_views(q_norm, k_norm, q, k, cos, sin)
    if views is None or (q_norm is None and pages is None):
        return None
    qv, kv, cv, sv = views
    eps, zero = (q_norm._eps(), bool(q_norm._ZERO_CENTRED)) if q_norm is not None else (0.0, False)
    wq, wk = (q_norm.weight, k_norm.weight) if q_norm is not None else (None, None)
    if pages is None:
        qo, ko = _qk_norm_rotary_op(qv, kv, wq, wk, cv, sv, eps, zero)
        return qo.view(q.shape), ko.view(k.shape)
    v, batch, layer = pages
    pool = batch.kv
    if (v.shape != k.shape or v.dtype != k.dtype or v.stride(-1) != 1 or pool.shape[-2:] != k.shape[2:]
            or pool.dtype != k.dtype or batch.slot_mapping.shape != (qv.shape[0],)
            or batch.slot_mapping.stride(0) != 1 or not 0 <= layer < pool.shape[0]):
        return None  # (the kernel stores the keys as it stores q: pages of the heads' dtype)
    try:
        vv = v.view(kv.shape)
    except RuntimeError:
        return None
    qo = torch.empty(qv.shape, dtype=q.dtype, device=q.device)
    _launch_qk_norm_rotary(qv, kv, vv, wq, wk, cv, sv, eps, zero, qo, pool[layer, 0], pool[layer, 1],
                           batch.slot_mapping, pool.shape[2] * pool.shape[3], pool.shape[3])
    return qo.view(q.shape)


def qk_norm_rotary_applies(q_norm: nn.Module | None, k_norm: nn.Module | None, q: torch.Tensor, k: torch.Tensor,
                           cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether ``qk_norm_rotary`` takes these (no launch)."""
    return _qk_views(q_norm, k_norm, q, k, cos, sin) is not None


def _qk_views(q_norm, k_norm, q, k, cos, sin):
    """``qk_norm_rotary``'s checks: q, k, cos and sin with the tokens as one index, or None."""
    from flare.prepare.recipes.fused import hooked

    d = q.shape[-1]
    if q_norm is None and k_norm is None:  # (no q/k norms: in a decode or verify step, not a prompt's)
        if prompt_rows.active():
            return None
    elif not (isinstance(q_norm, _Rows) and isinstance(k_norm, _Rows) and q_norm._one_launch()
              and k_norm._one_launch() and q_norm._ZERO_CENTRED == k_norm._ZERO_CENTRED
              and not hooked(q_norm) and not hooked(k_norm) and q_norm._eps() == k_norm._eps()
              and q_norm.weight.shape == (d,) and k_norm.weight.shape == (d,)
              and q_norm.weight.dtype == q.dtype and k_norm.weight.dtype == q.dtype):
        return None
    if (q.dim() != 4 or k.dim() != 4 or k.shape[-1] != d or q.shape[:2] != k.shape[:2] or d & (d - 1)
            or d > MAX_ROW or q.stride(-1) != 1 or k.stride(-1) != 1 or q.dtype != k.dtype):
        return None
    r = cos.shape[-1]
    if cos.shape != sin.shape or cos.shape[:-1] != q.shape[:2] or r % 2 or r > d or cos.stride(-1) != 1 \
            or sin.stride(-1) != 1 or cos.dtype != q.dtype or sin.dtype != q.dtype:
        return None  # (float32 cos/sin would promote the layer's own rotary to float32)
    b, t = q.shape[:2]
    try:  # tokens as one index (a view: B is 1 in Flare's programs)
        return (q.view(b * t, q.shape[2], d), k.view(b * t, k.shape[2], d), cos.view(b * t, r),
                sin.view(b * t, r))
    except RuntimeError:
        return None


class _Rows:
    flare_step_rows = False  # decode and verify steps too (``make_norms_row_invariant(steps=True)``)
    _ZERO_CENTRED: bool | None = None  # how ``rms_norm`` computes this class's norm; None: it does not
    # (mixer, projection) that takes this norm in its loads (``flare_deferred_norm``): a plain
    # attribute, out of the module tree (``fused.link_input_norm``)
    _flare_consumer: tuple | None = None

    def _invariant(self) -> bool:
        return self.flare_step_rows or prompt_rows.active()

    def _one_launch(self) -> bool:
        """Whether this call is a decode or verify step's (``flare_step_rows``) and the norm is
        one ``rms_norm`` launch (where it would be two: the mean of squares, then the rest
        compiled)."""
        return self._ZERO_CENTRED is not None and self.flare_step_rows and not prompt_rows.active()

    def _eps(self) -> float:
        return self.eps if self._ZERO_CENTRED else self.variance_epsilon

    def _step_norm(self, x: torch.Tensor) -> torch.Tensor:
        """This norm of ``x`` in one ``rms_norm`` launch (a step's: ``_one_launch``)."""
        return rms_norm(x, self.weight, self._eps(), self._ZERO_CENTRED)[0]

    def flare_gemv_norm(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """This norm (of ``residual + x`` with ``residual``) as a ``gemv.Norm`` for the next GEMV's
        loads in a step (``_one_launch``; ``fused.add_norm_mlp``), where the GEMV can take it (the
        weight in x's dtype, bfloat16 or float32, the residual of x's shape and dtype:
        ``gemv.takes_norm``); None elsewhere."""
        from flare.prepare.kernels.gemv import Norm, takes_norm

        if (not self._one_launch() or self.weight.dtype != x.dtype or not takes_norm(x.shape[-1], x.dtype)
                or (residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype))):
            return None
        return Norm(self.weight, self._eps(), self._ZERO_CENTRED, residual)

    def flare_deferred_norm(self, x: torch.Tensor):
        """This norm of ``x`` as a ``gemv.Norm`` where the one projection that consumes its output
        in a step takes it in its loads (``fused.input_norm_projections``: a decoder layer's input
        norm before its attention's q/k/v or its Gated DeltaNet's input projection, linked by
        ``gemm.choose_step_gemms`` where that family won, the projection's ``flare_norm_rows``
        holding the count; a split GEMV only with the core's ticket counters, ``flare_tickets``),
        with no forward hook on the norm, the mixer or the projection; None elsewhere. Both sides
        ask this with the same rows: the layer then passes ``x`` on as it is (``fused.input_norm``)
        and the projection applies the norm (``gemm._RowInvariant.flare_input_norm``)."""
        from flare.prepare.kernels.gemv import GemvTiling
        from flare.prepare.recipes.fused import hooked

        consumer = self._flare_consumer
        if consumer is None:
            return None
        mixer, proj = consumer
        rows = x.numel() // x.shape[-1]
        tiling = proj.flare_step_tiling.get(rows)
        if (rows not in proj.flare_norm_rows or not isinstance(tiling, GemvTiling) or not tiling.dot
                or (tiling.split != 1 and proj.flare_tickets is None) or tiling.glu or hooked(self) or hooked(mixer)
                or hooked(proj)):
            return None
        return self.flare_gemv_norm(x)

    def flare_add_norm(self, residual: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(this norm of ``residual + x``, the sum) in one launch in a step (``_one_launch``);
        None elsewhere (``fused.add_norm`` then adds and calls the norm)."""
        if not self._one_launch() or residual.shape != x.shape or residual.dtype != x.dtype:
            return None
        return rms_norm(x, self.weight, self._eps(), self._ZERO_CENTRED, residual=residual)


class _ZeroCentred(_Rows):
    """Transformers' zero-centred ``_norm`` with the mean of squares from ``mean_square`` in
    prompt programs."""

    def _norm(self, x):
        if not self._invariant():
            return super()._norm(x)
        return x * torch.rsqrt(mean_square(x) + self.eps)

    def forward(self, x):
        if self._one_launch():  # (a class whose forward is ``_ZERO_CENTRED_FORWARD``: ``_mixin``)
            return self._step_norm(x)
        return super().forward(x)


class _Scaled(_Rows):
    """Llama's RMS norm with the mean of squares from ``mean_square`` in prompt programs."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if not self._invariant():
            return super().forward(hidden_states)
        if self._one_launch():
            return self._step_norm(hidden_states)
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        hidden_states = hidden_states * torch.rsqrt(mean_square(hidden_states) + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class _Gated(_Rows):
    """A Gated DeltaNet's gated RMS norm with the mean of squares from ``mean_square`` in
    prompt programs."""

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if not self._invariant():
            return super().forward(hidden_states, gate)
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        hidden_states = hidden_states * torch.rsqrt(mean_square(hidden_states) + self.variance_epsilon)
        hidden_states = self.weight * hidden_states.to(input_dtype)
        hidden_states = hidden_states * ACT2FN[self.activation](gate.to(torch.float32))
        return hidden_states.to(input_dtype)


# The Transformers code each mixin stands for, with ``variance`` the mean of squares it swaps.
_ZERO_CENTRED_NORM = '''
def _norm(self, x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
'''
_ZERO_CENTRED_FORWARD = '''
def forward(self, x):
    output = self._norm(x.float())
    output = output * (1.0 + self.weight.float())
    return output.type_as(x)
'''
_SCALED_FORWARD = '''
def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)
'''
_GATED_FORWARD = '''
def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    # Norm before gate
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    hidden_states = self.weight * hidden_states.to(input_dtype)
    hidden_states = hidden_states * ACT2FN[self.activation](gate.to(torch.float32))

    return hidden_states.to(input_dtype)
'''


def _shape(source: str) -> str | None:
    """A function's code without what does not change what it computes: comments, layout,
    docstring and type annotations (the syntax tree, so Transformers versions that differ
    only there match)."""
    try:
        fn = ast.parse(textwrap.dedent(source)).body[0]
    except (SyntaxError, IndexError):
        return None
    if not isinstance(fn, ast.FunctionDef):
        return None
    if fn.body and isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant):
        fn.body = fn.body[1:]
    fn.returns = None
    for arg in (*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs):
        arg.annotation = None
    fn.decorator_list = []
    return ast.dump(fn)


def _code(fn) -> str | None:
    try:
        return _shape(inspect.getsource(fn))
    except (OSError, TypeError):
        return None


def _mixin(cls: type) -> type | None:
    """The mixin whose Transformers code ``cls`` runs, or None."""
    if _code(getattr(cls, "_norm", None)) == _shape(_ZERO_CENTRED_NORM):
        return _ZeroCentred
    forward = _code(cls.forward)
    if forward == _shape(_SCALED_FORWARD):
        return _Scaled
    if forward == _shape(_GATED_FORWARD):
        return _Gated
    return None


def is_gated_norm(module: nn.Module) -> bool:
    """Whether ``module`` computes Transformers' gated RMS norm with a SiLU gate (its code is
    ``_GATED_FORWARD``, switched here or not), which ``gdn.gated_rms_norm`` reproduces."""
    return ((isinstance(module, _Gated) or _mixin(type(module)) is _Gated)
            and getattr(module, "activation", None) == "silu")


_CLASSES: dict[type, type] = {}


def make_norms_row_invariant(model: nn.Module, steps: bool = False) -> tuple[dict[str, int], list[str]]:
    """Switch every RMS norm of ``model`` whose code is one of the three above (module
    docstring) and whose rows are at most ``MAX_ROW`` long, for prompt programs and, with
    ``steps``, decode and verify steps too; returns ({class name: modules switched}, names of
    the norm classes left as they are)."""
    switched: dict[str, int] = {}
    left: set[str] = set()
    for module in model.modules():
        cls = type(module)
        if cls in _CLASSES.values():  # switched before (for prompt programs, or steps too)
            if steps:
                module.flare_step_rows = True
            continue
        if "RMSNorm" not in cls.__name__:
            continue
        mixin = _mixin(cls)
        weight = getattr(module, "weight", None)
        if mixin is None or weight is None or weight.shape[-1] > MAX_ROW:
            left.add(cls.__name__)
            continue
        if cls not in _CLASSES:
            # One launch for the whole norm in steps where ``rms_norm`` computes what the class does.
            one = mixin is _Scaled or mixin is _ZeroCentred and _code(cls.forward) == _shape(_ZERO_CENTRED_FORWARD)
            members = {"_ZERO_CENTRED": mixin is _ZeroCentred} if one else {}
            _CLASSES[cls] = type(f"RowInvariant{cls.__name__}", (mixin, cls), members)
        module.__class__ = _CLASSES[cls]
        if steps:
            module.flare_step_rows = True
        switched[cls.__name__] = switched.get(cls.__name__, 0) + 1
    return switched, sorted(left)
