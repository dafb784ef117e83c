"""Linear layers whose rows do not depend on how many rows the program has.

A prompt's tokens reach the model through prefill programs of several capacities: with
the prefix cache on, a follow-up turn prefills only its suffix, in a smaller program than
the same prompt prefilled whole with the cache off. For the two to generate the same
tokens, every row must be computed the same way in each. cuBLAS picks its GEMM kernel by
the shapes, and for few rows where K is large against N it splits K and reduces the
partial sums afterwards: on the H200, Llama-8B's down_proj (14,336 -> 4,096) splits at
16-256 rows, an o_proj of 4,096 -> 2,048 at 16-64 rows, and a split row's bits differ
from an unsplit one's. Every unsplit tiling (cuBLAS at many rows; Triton at any tile
size, warp count or K step tried) gives the same bits: each output is one float32
accumulation over K in order (bench/results/gemm-row-invariance-2026-12-02.json).

So, at preparation on a GPU, each linear layer of the decoder is tried at the row counts
of the programs that run prompt rows (prefill, pack, score): where ``F.linear`` differs
from ``nonsplit_linear`` on random data, that layer computes those programs with
``nonsplit_linear`` (a Triton GEMM that sums the whole of K in order in each program);
elsewhere it keeps cuBLAS. Decode and verify steps are untouched (their rows need not
equal a prefill's, and split-K is what makes small-batch GEMMs fast); a pack program's
decode rows are rows of a prompt program and take the unsplit GEMM with its prompt rows. The choice is made per
layer and row count once, and compiled into each program's graph.
"""

from __future__ import annotations

import functools
import itertools
from typing import Iterable, NamedTuple

import torch
import triton
import triton.language as tl
from torch import nn
from torch.library import triton_op, wrap_triton
from triton.runtime.errors import OutOfResources
from torch.nn import functional as F

from flare.prepare import prompt_rows
from flare.prepare.kernels.gemv import (Conv, GemvTiling, Norm, gemv_conv_linear, gemv_linear, gemv_norm_linear,
                                        ticket_counters)


@triton.jit
def nonsplit_kernel(x_ptr, w_ptr, b_ptr, out_ptr, T, N, K, stride_xt, stride_wn, stride_ot,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr,
                    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr = False, EVEN_N: tl.constexpr = False):
    """``out = x @ w.T (+ b)``, float32 accumulation over the whole of K in order in one
    program (no split to reduce), the bias added in float32 before the one rounding.
    ``EVEN_K`` (K a multiple of BK) and ``EVEN_N`` (N of BN): the loads need no mask on K,
    and the weight's none at all (the same values loaded: the same bits)."""
    m = tl.program_id(0) * BM + tl.arange(0, BM)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    m_in, n_in = m < T, n < N
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + tl.arange(0, BK)
        k_in = kk < K
        x_at = x_ptr + m[:, None].to(tl.int64) * stride_xt + kk[None, :]
        w_at = w_ptr + n[None, :].to(tl.int64) * stride_wn + kk[:, None]
        if EVEN_K:
            a = tl.load(x_at, mask=m_in[:, None], other=0.0)
            if EVEN_N:
                w = tl.load(w_at)
            else:
                w = tl.load(w_at, mask=n_in[None, :], other=0.0)
        else:
            a = tl.load(x_at, mask=m_in[:, None] & k_in[None, :], other=0.0)
            w = tl.load(w_at, mask=n_in[None, :] & k_in[:, None], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n_in, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + m[:, None].to(tl.int64) * stride_ot + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_in[:, None] & n_in[None, :])


def tiles(rows: int, k: int, *, block_m: int | None = None, block_n: int | None = None,
          block_k: int | None = None) -> tuple[int, int, int, int]:
    """(BM, BN, BK, warps): narrow tiles for few rows (more programs to stream the weight),
    wide ones for many. Any tiling gives the same bits; only the time differs."""
    bm, bn, bk, warps = (16, 64, 128, 4) if rows <= 64 else (64, 128, 64, 4)
    return (block_m or bm, block_n or bn, min(block_k or bk, max(16, triton.next_power_of_2(k))), warps)


def launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
           tiling: tuple[int, ...], kernel=nonsplit_kernel) -> None:
    """Run the kernel over rows ``x [T, K]`` into ``out [T, N]`` (``kernel``: the plain
    Triton kernel eagerly, or its ``wrap_triton`` form inside a custom op). ``tiling``: (BM,
    BN, BK, warps) or with a fifth, the software pipeline's stages (Triton's default 3)."""
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("nonsplit_linear needs rows with unit stride")
    T, K = x.shape
    N = weight.shape[0]
    bm, bn, bk, warps, *rest = tiling
    kernel[(triton.cdiv(T, bm), triton.cdiv(N, bn))](
        x, weight, bias if bias is not None else weight, out, T, N, K, x.stride(0), weight.stride(0), out.stride(0),
        BM=bm, BN=bn, BK=bk, PRECISION="ieee" if x.dtype == torch.float32 else "tf32", HAS_BIAS=bias is not None,
        EVEN_K=K % bk == 0, EVEN_N=N % bn == 0, num_warps=warps, num_stages=rest[0] if rest else 3)


@triton_op("flare::nonsplit_linear", mutates_args=())
def _nonsplit_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tiling: list[int]) -> torch.Tensor:
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    launch(x, weight, bias, out, tuple(tiling) if tiling else tiles(x.shape[0], x.shape[1]),
           wrap_triton(nonsplit_kernel))
    return out


def nonsplit_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    tiling: tuple[int, ...] | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` whose rows are the same bits whatever the number of
    rows (a custom op, so a compiled layer calls it without a graph break). ``tiling``
    (BM, BN, BK, warps) overrides ``tiles``' choice: the bits stay the same, the time not."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    return _nonsplit_op(rows, weight, bias, list(tiling or ())).reshape(*x.shape[:-1], weight.shape[0])


# -- which programs, which layers ---------------------------------------------------

def _random_operands(weight: torch.Tensor, bias: torch.Tensor | None, rows: int,
                     seed: int = 0) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """A random weight and bias (None without one) of the layer's shapes, dtypes and device, and
    ``rows`` random rows for them: times and bit patterns do not depend on the values."""
    g = torch.Generator(device=weight.device).manual_seed(seed)
    n, k = weight.shape
    w = torch.randn((n, k), generator=g, device=weight.device, dtype=weight.dtype) * k ** -0.5
    b = None if bias is None else torch.randn(n, generator=g, device=weight.device, dtype=bias.dtype)
    return w, b, torch.randn((rows, k), generator=g, device=weight.device, dtype=weight.dtype)


def split_rows(weight: torch.Tensor, bias: torch.Tensor | None, row_counts: Iterable[int],
               remedy: str = "--split-prompt-gemms") -> frozenset[int]:
    """The row counts at which ``F.linear`` over a weight of this shape, dtype and device
    gives other bits than ``nonsplit_linear`` (random data: cuBLAS picks its kernel by the
    shapes, never by the values). Raises if ``nonsplit_linear`` itself differs between row
    counts (its tilings for few and many rows must agree: measured on the H200, checked
    here on the device at hand). A float32 layer with a bias counts as split everywhere:
    compiled, Inductor adds such a bias after the GEMM's rounding, which the eager
    comparison here would not see (half-precision layers keep the fused bias)."""
    counts = sorted(set(row_counts))
    if not counts:
        return frozenset()
    n, k = weight.shape
    dt = weight.dtype
    w, b, x = _random_operands(weight, bias, counts[-1])
    ref = nonsplit_linear(x, w, b)
    for c in counts:
        if not torch.equal(nonsplit_linear(x[:c], w, b), ref[:c]):
            raise RuntimeError(f"the unsplit GEMM's rows differ between {c} and {counts[-1]} rows ({n} x {k}, {dt}): "
                               f"its tilings do not agree on this device (use {remedy})")
    if dt == torch.float32 and bias is not None:
        return frozenset(counts)
    return frozenset(c for c in counts if not torch.equal(F.linear(x[:c], w, b), ref[:c]))


class _RowInvariant:
    """Mixed into a linear layer's class: prompt rows at a row count in
    ``flare_split_rows`` go through ``nonsplit_linear``; the rows of other programs at a
    row count in ``flare_step_tiling`` go through it with that tiling, or through
    ``gemv_linear`` for a ``GemvTiling`` (where it measured faster than cuBLAS:
    ``choose_step_gemms``); everything else as before."""

    flare_split_rows: frozenset[int] = frozenset()
    flare_split_tiling: dict[int, tuple[int, ...]] = {}  # the unsplit GEMM's tiling where timed faster
    flare_step_tiling: dict[int, tuple[int, ...]] = {}
    # the core's GEMV ticket counters (``gemv_linear``, ``gemv_norm_linear`` with a split)
    flare_tickets: torch.Tensor | None = None
    flare_conv_rows: frozenset[int] = frozenset()  # decode counts whose convolution this GEMV takes
    # step counts whose norm before it this GEMV takes: a GLU's add and norm (``fused.add_norm_mlp``), or
    # a decoder layer's input norm (``flare_input_norm``)
    flare_norm_rows: frozenset[int] = frozenset()
    _flare_input_norm: nn.Module | None = None  # that input norm: a plain attribute (``fused.link_input_norm``)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if prompt_rows.active():
            if rows in self.flare_split_rows:
                return nonsplit_linear(x, self.weight, self.bias, self.flare_split_tiling.get(rows))
        elif rows in self.flare_step_tiling:
            tiling = self.flare_step_tiling[rows]
            if isinstance(tiling, GemvTiling):  # (called as a linear layer, a GLU tiling's plain product)
                norm = self.flare_input_norm(x)
                if norm is not None:  # (the decoder layer passed its input norm's input on)
                    return gemv_norm_linear(x, self.weight, tiling, norm, tickets=self.flare_tickets)[0]
                return gemv_linear(x, self.weight, tiling._replace(glu=0), tickets=self.flare_tickets)
            return nonsplit_linear(x, self.weight, self.bias, tiling)
        return super().forward(x)

    def flare_input_norm(self, x: torch.Tensor) -> Norm | None:
        """The decoder layer's input norm as a ``gemv.Norm`` where this layer, the projection that
        consumes its output, takes it in its step's GEMV (``rownorm``'s ``flare_deferred_norm``, which
        the layer asks too, and which then passes ``x`` on unnormed); None elsewhere."""
        norm = self._flare_input_norm
        return None if norm is None else norm.flare_deferred_norm(x)

    def flare_fold_tiling(self, rows: int) -> GemvTiling | None:
        """The GEMV tiling this layer takes in a step of ``rows`` rows where, as a gated MLP's
        down projection, it may take the residual add in its epilogue and (``folds_swiglu``) the
        activation in its loads (``flare_swiglu_down``); None where it takes another product (a
        prompt program, cuBLAS, the unsplit GEMM) or a GEMV of fewer than ``FOLD_MIN_BN``
        columns a program."""
        if prompt_rows.active():
            return None
        tiling = self.flare_step_tiling.get(rows)
        return tiling if isinstance(tiling, GemvTiling) and tiling.bn >= FOLD_MIN_BN else None

    def flare_glu_tiling(self, rows: int) -> GemvTiling | None:
        """The GEMV tiling with the gated activation in its epilogue (``glu``) this layer, a gated
        MLP's [gate; up] projection, takes in a step of ``rows`` rows (``flare_glu``); None
        elsewhere."""
        if prompt_rows.active():
            return None
        tiling = self.flare_step_tiling.get(rows)
        return tiling if isinstance(tiling, GemvTiling) and tiling.glu else None

    def flare_conv_tiling(self, rows: int) -> GemvTiling | None:
        """The GEMV tiling with which this layer, a Gated DeltaNet's input projection, takes a decode
        step's convolution in its epilogue at ``rows`` rows (``gemv.gemv_conv_linear``): where
        ``flare_conv_rows`` holds the count (the fold checked on the device, ``check_conv_folds``);
        None elsewhere."""
        if prompt_rows.active() or rows not in self.flare_conv_rows:
            return None
        tiling = self.flare_step_tiling.get(rows)
        return tiling if isinstance(tiling, GemvTiling) and tiling.split == 1 and not tiling.glu else None

    def flare_norm_glu_tiling(self, rows: int) -> GemvTiling | None:
        """The GLU tiling (``flare_glu_tiling``) with which this layer, a gated MLP's [gate; up]
        projection, takes the norm before it in its loads at ``rows`` rows (``flare_norm_glu``):
        where ``flare_norm_rows`` holds the count (``choose_step_gemms``); None elsewhere."""
        return self.flare_glu_tiling(rows) if rows in self.flare_norm_rows else None

    def flare_glu(self, x: torch.Tensor, tiling: GemvTiling) -> torch.Tensor:
        """``silu(gate) * up`` of this [gate; up] projection of ``x``, in one launch."""
        return gemv_linear(x, self.weight, tiling, tickets=self.flare_tickets)

    def flare_norm_glu(self, x: torch.Tensor, tiling: GemvTiling, norm: Norm) -> tuple[torch.Tensor, torch.Tensor]:
        """(``silu(gate) * up`` of this [gate; up] projection of ``norm``'s output, the norm's
        ``residual + x``) in one launch (``gemv.gemv_norm_linear``)."""
        return gemv_norm_linear(x, self.weight, tiling, norm)

    @staticmethod
    def flare_loads_act(tiling: GemvTiling) -> bool:
        """Whether this layer's GEMV on ``tiling`` computes a gated activation in its loads (as a
        down projection: ``folds_swiglu``)."""
        return folds_swiglu(tiling)

    def flare_act_down(self, act: torch.Tensor, tiling: GemvTiling,
                       residual: torch.Tensor | None = None) -> torch.Tensor:
        """This layer, a gated MLP's down projection, of the activation computed before (its
        gate/up projection's ``flare_glu``), by the GEMV with ``residual`` in its epilogue."""
        return gemv_linear(act, self.weight, tiling, residual=residual, tickets=self.flare_tickets)

    def flare_swiglu_down(self, gate_up: torch.Tensor, tiling: GemvTiling,
                          residual: torch.Tensor | None = None) -> torch.Tensor:
        """This layer as a gated MLP's down projection of ``silu(gate) * up``, from the
        [gate | up] projection, by the GEMV with the activation in its loads (``folds_swiglu``;
        otherwise computed apart, as the MLP computes it) and ``residual`` added in its
        epilogue, when given."""
        if folds_swiglu(tiling):
            return gemv_linear(gate_up, self.weight, tiling, swiglu=True, residual=residual, tickets=self.flare_tickets)
        gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
        return gemv_linear(F.silu(gate) * up, self.weight, tiling, residual=residual, tickets=self.flare_tickets)


_CLASSES: dict[type, type] = {}


def _plain_linears(layers: Iterable[nn.Module]):
    """(name, module) of every linear layer under ``layers`` whose forward is ``F.linear``
    of its weight and bias (``nn.Linear``'s and ``fused.FusedLinear``'s own forward, not a
    subclass's other forward), or that is one already made row invariant here."""
    from flare.prepare.recipes.fused import FusedLinear

    for i, layer in enumerate(layers):
        for name, module in layer.named_modules():
            if isinstance(module, _RowInvariant) or type(module).forward in (nn.Linear.forward, FusedLinear.forward):
                yield f"{i}.{name}", module


def _switch(module: nn.Module) -> None:
    if isinstance(module, _RowInvariant):
        return
    cls = type(module)
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"RowInvariant{cls.__name__}", (_RowInvariant, cls), {})
    module.__class__ = _CLASSES[cls]


def _key(module: nn.Module) -> tuple:
    w, b = module.weight, module.bias
    return tuple(w.shape), w.dtype, None if b is None else b.dtype


# Tilings of the unsplit GEMM timed for prompt rows where cuBLAS splits (on a GPU; the CPU keeps
# ``tiles``'): (BM, BN, BK, warps, stages), ``tiles``' two first, then deeper pipelines, longer K
# steps and 8-warp tiles (bench/gemm_invariance.py times the same set). Every one sums K in order:
# the same bits, checked on the device before a tiling is taken.
PROMPT_TILINGS = ((16, 64, 128, 4, 3), (64, 128, 64, 4, 3),
                  (16, 32, 128, 4, 4), (16, 64, 128, 4, 4), (16, 64, 256, 4, 3), (16, 128, 128, 4, 4),
                  (32, 64, 128, 4, 4), (64, 64, 64, 4, 4), (64, 64, 128, 4, 3), (64, 128, 64, 4, 4),
                  (64, 128, 64, 8, 4), (64, 256, 64, 8, 3), (128, 64, 64, 8, 4), (128, 128, 64, 8, 3),
                  (128, 128, 64, 8, 4), (128, 256, 64, 8, 3))


def prompt_tilings(weight: torch.Tensor, bias: torch.Tensor | None, row_counts: Iterable[int], *, timer=None,
                   margin: float = 0.97) -> dict[int, tuple[int, ...]]:
    """For each row count, the fastest of ``PROMPT_TILINGS`` over a weight of this shape where it
    takes at most ``margin`` x the time of ``tiles``' tiling and gives the rows the same bits (on
    random rows; a tiling whose rows differ is never taken); none where ``tiles``' stays. The
    weight's copies rotate as ``step_tiling``'s."""
    counts = sorted(set(row_counts))
    if not counts:
        return {}
    w, b, x = _random_operands(weight, bias, counts[-1], seed=3)
    rotating, timer = _rotation(w, timer)
    chosen = {}
    for c in counts:
        base = tiles(c, w.shape[1])
        ref = nonsplit_linear(x[:c], w, b, base)
        t_c = {base: timer(rotating(lambda w, t=base: nonsplit_linear(x[:c], w, b, t)))}
        for t in PROMPT_TILINGS:
            try:
                if t == (*base, 3) or not torch.equal(nonsplit_linear(x[:c], w, b, t), ref):
                    continue
            except OutOfResources:  # (more shared memory than this device has: not a tiling here)
                continue
            t_c[t] = timer(rotating(lambda w, t=t: nonsplit_linear(x[:c], w, b, t)))
        best = min(t_c, key=t_c.get)
        if best != base and t_c[best] <= margin * t_c[base]:
            chosen[c] = best
    return chosen


def make_row_invariant(layers: Iterable[nn.Module], row_counts: Iterable[int], *, measure: bool = False,
                       timer=None) -> dict[str, frozenset[int]]:
    """Give every plain linear layer under ``layers`` (``_plain_linears``) the row counts
    at which cuBLAS splits it; returns {module name: row counts} for those with any. (A
    layer whose weight a prepared module uses directly, such as a routed block's
    shared-expert gate, is measured too; its forward is never called.) ``measure`` (on a GPU,
    or with a ``timer``): each such layer also takes, at each of those counts, the unsplit GEMM's
    tiling that timed fastest (``prompt_tilings``: the same bits, only the time differs)."""
    counts = tuple(row_counts)
    measured: dict[tuple, tuple[frozenset[int], dict]] = {}
    found = {}
    for name, module in _plain_linears(layers):
        if getattr(module, "flare_split_rows", None):
            continue  # already measured
        key = _key(module)
        if key not in measured:
            split = split_rows(module.weight, module.bias, counts)
            timed = split and measure and (timer is not None or module.weight.device.type == "cuda")
            measured[key] = split, prompt_tilings(module.weight, module.bias, split, timer=timer) if timed else {}
        split, tiling = measured[key]
        if not split:
            continue
        _switch(module)
        module.flare_split_rows = split
        module.flare_split_tiling = tiling
        found[name] = split
    return found


# -- decode and verify steps: the unsplit GEMM where it is faster -----------------------

# Tilings tried for step rows (BM, BN, BK, warps): one 16-row tile holds the batch, and
# narrow column blocks give the weight's stream enough programs without splitting K.
STEP_TILINGS = ((16, 16, 256, 4), (16, 32, 256, 4), (16, 32, 128, 4), (16, 64, 128, 4), (16, 16, 512, 8))
# The few-row GEMV (kernels/gemv.py) for layers without a bias (``GemvTiling``: columns a
# program, K a step, warps, defer, rowloop, dot, stages, split), narrow programs over one or a
# few long steps of K, the first version's best, and 8 columns over steps of 1,024 with the lanes kept through the loop (the fastest for each
# of the 9B hybrid's four GDN-layer weights at one row among the five ``bench/pdl.py`` tries,
# ``bench/results/pdl-2026-12-04.json``); then two that take a row at a time (``rowloop``: the
# broadcast ones took 1.13-1.69x cuBLAS's time at four rows, and a layer's GEMV must serve every
# step row count, ``step_choice``; on the H200 the row loop was no better, 1.6-2.0 TB/s at four
# rows, ``gemv-2026-12-04-run2.json``); then one 16-row tensor-core tile at every count (``dot``,
# the same program whatever the rows, up to 16: verify steps too), the five of
# ``gemv-2026-12-04-run3.json``'s ten that were best for some weight of the 9B and 8B shapes: the
# 9B in_proj at 3.9 TB/s against cuBLAS's 3.6 at 1-4 rows, q/k/v and gate/up within 1 % of
# cuBLAS, the 4,096-column weights (down, o/out_proj) 5-15 % under it (too few programs without
# a split of K); and four that split K (2-4 slices, their partial sums added in order by the last
# program of a column tile to take a ticket, which also adds the residual, or scales by the rows'
# reciprocal RMS where the input norm is in the loads). (Two narrower split tilings, 16 columns x 4
# slices and 32 x 8, were offered at 0594ed8: the 30B-A3B shape's preparation took neither and
# 274 s against 211, which the 35B shape's 477 s could not afford under a 600 s call.)
STEP_GEMV_TILINGS = (GemvTiling(1, 4096, 4), GemvTiling(2, 4096, 8), GemvTiling(2, 2048, 4), GemvTiling(4, 2048, 4),
                     GemvTiling(8, 2048, 8), GemvTiling(8, 512, 4), GemvTiling(8, 1024, 4, 1),
                     GemvTiling(8, 512, 4, 0, 1), GemvTiling(8, 1024, 8, 0, 1),
                     GemvTiling(16, 256, 4, dot=1, stages=3), GemvTiling(32, 256, 4, dot=1, stages=3),
                     GemvTiling(16, 512, 4, dot=1, stages=2), GemvTiling(32, 128, 4, dot=1, stages=4),
                     GemvTiling(64, 128, 4, dot=1, stages=4),
                     GemvTiling(32, 128, 4, dot=1, stages=4, split=2), GemvTiling(32, 128, 4, dot=1, stages=4, split=4),
                     GemvTiling(64, 128, 4, dot=1, stages=4, split=4), GemvTiling(32, 256, 4, dot=1, stages=3, split=4))


# The tensor-core GEMVs without a split, with a gated MLP's activation in their epilogue: offered
# to its [gate; up] projection where its down projection does not take the activation in its loads.
GLU_TILINGS = tuple(t._replace(glu=1) for t in STEP_GEMV_TILINGS if t.dot and t.split == 1)


# Each program of the GEMV with the gated activation in its loads computes it for every row's
# K inputs again: rows x K x N / BN sigmoids a step. At 8 columns a program the 9B
# down projection (N 4,096, K 12,288) costs about 6M a row, beside its 100 MB weight stream; at
# one column 50M, which could take as long as the stream itself. The step tiling is timed
# without the fold, so narrower programs keep the activation kernel apart.
FOLD_MIN_BN = 8


def folds_swiglu(tiling: GemvTiling) -> bool:
    """Whether a down projection on this GEMV tiling computes the gated activation in its loads:
    not the tensor-core tile (``dot``), which would compute it for all ``DOT_ROWS`` rows of its
    tile, 16x a one-row step's sigmoids (its residual fold stays)."""
    return not tiling.dot


# Products a timing captures in one CUDA graph at least (each on the next weight copy).
TIMED_CALLS = 20


def _time_ms(fn, calls: int = TIMED_CALLS) -> float:
    """GPU time of one ``fn`` (ms): ``calls`` of them captured in a CUDA graph, the median
    replay over their number. Timed one launch at a time between events, each call also paid
    its launch (several µs against a 10-50 µs decode GEMM): the 9B hybrid's prepare of
    2026-12-04 chose no GEMV that way, where ``bench/gemv.py``, timing inside graphs, had it
    3-10 % faster than cuBLAS at one row for three of the four weights of a GDN layer."""
    from flare.prepare.timing import graph_ms

    return graph_ms(lambda: [fn() for _ in range(calls)], calls)


# Weight copies a timing rotates through, together at least this large: more than the
# H200's 50 MB L2, so each timed GEMM streams its weight from memory as a decode step does;
# at most MAX_COPIES of them (a timing captures a call for each: a mixture-of-experts block's
# one-column shared-expert gate, 4 KB, would have taken 65,536 calls a timing, and the 35B
# shape's preparation sat for minutes in them).
ROTATE_BYTES = 256 << 20
MAX_COPIES = 512


def _copies(nbytes: int) -> int:
    """How many copies of a weight of ``nbytes`` a GPU timing rotates through."""
    return min(MAX_COPIES, -(-ROTATE_BYTES // max(1, nbytes)))


def _rotation(w: torch.Tensor, timer=None):
    """(``rotating``, the timer) for products over weight ``w``: ``rotating(call)`` gives a callable
    that calls ``call`` on the next of several copies of ``w`` (on a GPU, ``ROTATE_BYTES`` of them
    together, at most ``MAX_COPIES``), and the default timer captures a call for every copy (at least ``TIMED_CALLS``)."""
    copies = _copies(w.numel() * w.element_size()) if w.device.type == "cuda" else 1
    ws = [w] + [w.clone() for _ in range(copies - 1)]

    def rotating(call):
        turn = itertools.count()
        return lambda: call(ws[next(turn) % len(ws)])

    return rotating, timer or functools.partial(_time_ms, calls=max(TIMED_CALLS, len(ws)))


def step_tiling(weight: torch.Tensor, bias: torch.Tensor | None, rows: int, *, timer=None,
                margin: float = 0.97, glu: bool = False) -> tuple[tuple[int, ...] | None, dict]:
    """The fastest of ``STEP_TILINGS`` (and, for a weight without a bias and at most
    its ``max_rows``, ``STEP_GEMV_TILINGS``) for ``rows`` rows over a weight of this
    shape, where it takes at most ``margin`` x cuBLAS's time (``F.linear``), else None; and
    the times measured (ms, by tiling and for cuBLAS). Random data: the times do not depend on values.
    On a GPU each call reads the next of several copies of the weight (``ROTATE_BYTES``); the
    default ``timer`` captures a call for every copy (at least ``TIMED_CALLS``), so a small
    weight's copies are not all read from L2 the replays after the first. ``glu``: the weight is
    a gated MLP's [gate; up] projection; ``GLU_TILINGS`` are timed too (their product is the
    activation, never the best here)."""
    w, b, x = _random_operands(weight, bias, rows)
    rotating, timer = _rotation(w, timer)
    times = {"cublas": timer(rotating(lambda w: F.linear(x, w, b)))}
    for t in STEP_TILINGS:
        times[t] = timer(rotating(lambda w, t=t: nonsplit_linear(x, w, b, t)))
    tickets = ticket_counters(weight.device)  # split GEMVs as a core's steps run them
    for t in (*STEP_GEMV_TILINGS, *(GLU_TILINGS if glu else ())) if bias is None else ():
        if rows <= t.max_rows and t.fits(weight.shape[1]):
            times[t] = timer(rotating(lambda w, t=t: gemv_linear(x, w, t, tickets=tickets)))
    best = min((t for t in times if t != "cublas" and not getattr(t, "glu", 0)), key=times.get)
    return (best if times[best] <= margin * times["cublas"] else None), times


# The GEMV ``--step-gemms gemv`` gives every layer: 8 columns a program (so the folds take it),
# K in steps of 512, a row at a time (its registers do not grow with the rows: a verify step of
# 8 rows with the lanes kept would hold 64K float32 lanes a program).
FORCED_GEMV = GemvTiling(8, 512, 4, 0, 1)


def force_step_gemv(layers: Iterable[nn.Module], row_counts: Iterable[int]) -> dict[str, dict]:
    """Every plain linear layer without a bias under ``layers`` takes ``FORCED_GEMV`` at every
    step row count (all of them, so that a row's bits do not depend on its batch: the GEMV sums
    each row alone, checked here on the device at these counts), untimed: what
    ``choose_step_gemms`` picks where the GEMVs time faster, on any shape (the GPU suite's small
    cores). Refused where a count exceeds its ``max_rows`` (verify programs of several drafts
    at the larger decode capacities). Returns {module name: {rows: tiling}} as
    ``choose_step_gemms`` does."""
    counts = sorted(set(row_counts))
    if not counts:
        return {}
    if counts[-1] > FORCED_GEMV.max_rows:
        raise ValueError(f"--step-gemms gemv: steps of {counts[-1]} rows (verify programs) exceed the GEMV's "
                         f"{FORCED_GEMV.max_rows}; use fewer draft tokens or decode capacities, or --step-gemms measure")
    found, checked = {}, set()
    for name, module in _plain_linears(layers):
        if module.bias is not None:
            continue
        if _key(module) not in checked:
            w, _, x = _random_operands(module.weight, None, counts[-1], seed=1)
            if not _gemv_same_rows(w, x, FORCED_GEMV, counts):
                raise RuntimeError(f"the GEMV {FORCED_GEMV} gives a row other bits at another row count on this "
                                   f"device ({tuple(module.weight.shape)}): --step-gemms gemv would break exactness")
            checked.add(_key(module))
        _switch(module)
        module.flare_step_tiling = {c: FORCED_GEMV for c in counts}
        found[name] = dict(module.flare_step_tiling)
    return found


def _same_rows(fn, x: torch.Tensor, counts: list[int]) -> bool:
    """Whether ``fn`` gives each row the same bits at every row count (random rows ``x``)."""
    full = fn(x[:counts[-1]])
    return all(torch.equal(fn(x[:c]), full[:c]) for c in counts)


def _gemv_same_rows(w: torch.Tensor, x: torch.Tensor, tiling: GemvTiling, counts: list[int]) -> bool:
    """Whether the GEMV with ``tiling`` gives each row the same bits at every count, as it is and,
    where the folds may take it (``FOLD_MIN_BN``), with the activation in its loads and the
    residual in its epilogue (random rows ``x`` standing for both halves of [gate | up])."""
    tickets = ticket_counters(w.device)
    if not _same_rows(lambda rows: gemv_linear(rows, w, tiling, tickets=tickets), x, counts):
        return False
    if tiling.bn < FOLD_MIN_BN or tiling.glu:  # (a GLU tiling's product is the activation: no folds)
        return True
    gate_up = torch.cat([x, x.flip(0)], dim=1)
    residual = torch.full((x.shape[0], w.shape[0]), 0.5, device=x.device, dtype=x.dtype)
    return _same_rows(lambda rows: gemv_linear(gate_up[: rows.shape[0]] if folds_swiglu(tiling) else rows, w, tiling,
                                               swiglu=folds_swiglu(tiling), residual=residual[: rows.shape[0]].contiguous(),
                                               tickets=tickets), x, counts)


class NormFold(NamedTuple):
    """A projection whose step GEMV may take the RMS norm before it in its loads: a gated MLP's
    [gate; up] projection, the decoder layer's residual add too (``add``;
    ``fused.norm_glu_projections``), or the projection that reads a decoder layer's input norm
    (``fused.input_norm_projections``); the norm's form (``zero_centred``: scaled by
    ``1 + weight``; otherwise by ``weight``, Llama's)."""

    zero_centred: bool
    add: bool = True


def _norm_operands(weight: torch.Tensor, rows: int, fold: NormFold, seed: int = 4):
    """A projection's norm for ``rows`` rows: a norm weight of its K, rows, and a residual (the add
    before the norm) where the fold has one, else None."""
    g = torch.Generator(device=weight.device).manual_seed(seed)
    k, dev, dt = weight.shape[1], weight.device, weight.dtype
    nw = torch.randn(k, generator=g, device=dev, dtype=dt)
    x, r = (torch.randn((rows, k), generator=g, device=dev, dtype=dt) for _ in range(2))
    return nw, x, r if fold.add else None


def _norm_ms(weight: torch.Tensor, rows: int, fold: NormFold, timer=None) -> float:
    """The time of a step's norm before the projection (``rownorm.rms_norm``, with the add where
    the fold has one: one launch) over ``rows`` rows of its K inputs."""
    from flare.prepare.kernels.rownorm import rms_norm

    nw, x, r = _norm_operands(weight, rows, fold)
    return (timer or _time_ms)(lambda: rms_norm(x, nw, 1e-6, fold.zero_centred, residual=r))


def _norm_gemv_ms(weight: torch.Tensor, rows: int, tiling: GemvTiling, fold: NormFold,
                  conv: ConvFold | None = None, timer=None) -> float:
    """The time of the GEMV on ``tiling`` (a GLU tiling's too) with the norm (and its add) in its
    loads, and with ``conv`` the convolution in its epilogue, each call reading the next of
    several weight copies, as ``step_tiling`` times the products."""
    rotating, timer = _rotation(weight, timer)
    nw, x, r = _norm_operands(weight, rows, fold)
    norm = Norm(nw, 1e-6, fold.zero_centred, r)
    if conv is not None:
        state, cw, slots, live = _conv_operands(weight, rows, conv)
        c = Conv(state, cw, None, slots, live)
        return timer(rotating(lambda w: gemv_conv_linear(x, w, tiling, c, norm=norm)))
    tickets = ticket_counters(weight.device) if tiling.split > 1 else None
    return timer(rotating(lambda w: gemv_norm_linear(x, w, tiling, norm, tickets=tickets)))


def _norm_same_rows(w: torch.Tensor, x: torch.Tensor, tiling: GemvTiling, counts: list[int], fold: NormFold) -> bool:
    """Whether the GEMV on ``tiling`` with the norm (and its add) in its loads gives each row (its
    output, and the sum with an add) the same bits at every count (random rows ``x``)."""
    nw, _, r = _norm_operands(w, x.shape[0], fold)
    tickets = ticket_counters(w.device) if tiling.split > 1 else None

    def both(rows):
        residual = r[: rows.shape[0]] if fold.add else None
        out, total = gemv_norm_linear(rows, w, tiling, Norm(nw, 1e-6, fold.zero_centred, residual), tickets=tickets)
        return out if total is None else torch.cat([out, total], dim=-1)

    return _same_rows(both, x, counts)


def _cublas_same_rows(w: torch.Tensor, b: torch.Tensor | None, x: torch.Tensor, counts: list[int]) -> bool:
    """Whether cuBLAS gives each row the same bits at every one of ``counts`` on this device."""
    return _same_rows(lambda rows: F.linear(rows, w, b), x, counts)


def _add_ms(weight: torch.Tensor, rows: int, timer=None, columns: int | None = None) -> float:
    """The time of a residual add of ``rows`` rows of this layer's outputs (or of ``columns``
    values a row), a kernel of its own."""
    a = torch.randn((rows, columns or weight.shape[0]), device=weight.device, dtype=weight.dtype)
    b = torch.randn_like(a)
    out = torch.empty_like(a)
    return (timer or _time_ms)(lambda: torch.add(a, b, out=out))


class ConvFold(NamedTuple):
    """A Gated DeltaNet's input projection whose GEMV may take the decode step's convolution in its
    epilogue: the convolution's ``channels`` (the projection's first outputs) and ``width``, and
    the decode steps' row ``counts`` (verify steps keep the convolution's kernel)."""

    channels: int
    width: int
    counts: frozenset[int]


def _conv_operands(weight: torch.Tensor, rows: int, fold: ConvFold, seed: int = 2):
    """Random histories for ``rows`` rows (and one slot no row takes), a convolution weight, and
    the rows' slots (in reverse) and live flags (the last of several rows not live, as a padded
    row of a step)."""
    g = torch.Generator(device=weight.device).manual_seed(seed)
    dev, dt = weight.device, weight.dtype
    state = torch.randn((rows + 1, fold.channels, fold.width - 1), generator=g, device=dev, dtype=dt)
    w = torch.randn((fold.channels, fold.width), generator=g, device=dev, dtype=dt)
    slots = torch.arange(rows, 0, -1, device=dev)
    live = torch.arange(rows, device=dev) < max(1, rows - 1)
    return state, w, slots, live


def _conv_ms(weight: torch.Tensor, rows: int, fold: ConvFold, timer=None) -> float:
    """The time of a decode step's convolution kernel (``gdn.conv1d_decode_step``) over ``rows``
    rows of the fold's channels."""
    from flare.prepare.kernels.gdn import conv1d_decode_step

    state, w, slots, live = _conv_operands(weight, rows, fold)
    x = torch.randn((rows, fold.channels), device=weight.device, dtype=weight.dtype)
    out = torch.empty_like(x)
    return (timer or _time_ms)(lambda: conv1d_decode_step(x, state, w, None, slots, live, out=out))


def _conv_gemv_ms(weight: torch.Tensor, rows: int, tiling: GemvTiling, fold: ConvFold, timer=None) -> float:
    """The time of the GEMV on ``tiling`` with the convolution in its epilogue, each call reading
    the next of several weight copies (``ROTATE_BYTES``), as ``step_tiling`` times the products."""
    w, _, x = _random_operands(weight, None, rows)
    rotating, timer = _rotation(w, timer)
    state, cw, slots, live = _conv_operands(weight, rows, fold)
    conv = Conv(state, cw, None, slots, live)
    return timer(rotating(lambda w: gemv_conv_linear(x, w, tiling, conv)))


def conv_fold_same(weight: torch.Tensor, tiling: GemvTiling, fold: ConvFold) -> bool:
    """Whether, on this device at each of the fold's counts, the GEMV on ``tiling`` with the
    convolution in its epilogue gives the outputs and leaves the histories of the same GEMV followed
    by the convolution kernel, bit for bit (random data, a padded row among several)."""
    from flare.prepare.kernels.gdn import conv1d_decode_step

    for c in sorted(fold.counts):
        w, _, x = _random_operands(weight, None, c, seed=3)
        state, cw, slots, live = _conv_operands(weight, c, fold)
        want, want_state = gemv_linear(x, w, tiling), state.clone()
        want[:, :fold.channels] = conv1d_decode_step(want[:, :fold.channels], want_state, cw, None, slots, live)
        got = gemv_conv_linear(x, w, tiling, Conv(state, cw, None, slots, live))
        if not (torch.equal(got, want) and torch.equal(state, want_state)):
            return False
    return True


def _conv_folds(layers: Iterable[nn.Module]):
    """(layer index, module name, input projection, channels, width) of each Gated DeltaNet under
    ``layers`` whose module offers its decode convolution to the projection's GEMV
    (``flare_conv_fold``) and whose projection no forward hook watches."""
    from flare.prepare.recipes.fused import hooked

    for i, layer in enumerate(layers):
        for name, m in layer.named_modules():
            fold = getattr(m, "flare_conv_fold", None)
            got = fold() if callable(fold) else None
            if got is not None and not hooked(got[0]):
                yield (i, name, *got)


def check_conv_folds(layers: Iterable[nn.Module], decode_counts: Iterable[int], log=None) -> dict[str, list[int]]:
    """Each Gated DeltaNet input projection under ``layers`` whose module offers the convolution
    (``flare_conv_fold``) and whose step product is a GEMV without a split at every decode count
    takes the convolution in that GEMV at those counts (``flare_conv_rows``), where
    ``conv_fold_same`` holds on this device (checked once a shape and tiling); elsewhere the kernel
    stays. Returns {projection name: counts}; ``log``: a line for a fold refused by the check."""
    counts = frozenset(decode_counts)
    found, checked = {}, {}
    for i, name, proj, channels, width in _conv_folds(layers) if counts else ():
        tilings = {getattr(proj, "flare_step_tiling", {}).get(c) for c in counts}
        tiling = tilings.pop() if len(tilings) == 1 else None
        if not (isinstance(tiling, GemvTiling) and tiling.split == 1 and not tiling.glu):
            continue
        key = (tuple(proj.weight.shape), proj.weight.dtype, tiling, channels, width)
        if key not in checked:
            checked[key] = conv_fold_same(proj.weight, tiling, ConvFold(channels, width, counts))
            if not checked[key] and log is not None:
                log(f"the convolution in the GEMV {tiling} of {tuple(proj.weight.shape)} differs from its kernel "
                    f"on this device: kept apart")
        proj.flare_conv_rows = counts if checked[key] else frozenset()
        if checked[key]:
            found[f"{i}.{name}.in_proj" if name else f"{i}.in_proj"] = sorted(counts)
    return found


def step_choice(weight: torch.Tensor, bias: torch.Tensor | None, counts: list[int], *, timer=None,
                margin: float = 0.97, residual_fold: bool = False, act_fold: bool = False,
                conv_fold: ConvFold | None = None, norm_fold: NormFold | None = None,
                split_norm: bool = False) -> tuple[dict[int, tuple[int, ...]], dict]:
    """One product for a layer's decode and verify steps at every row count in ``counts``, so
    that a row's bits never depend on how many rows its step has (the batch the scheduler put it
    in: cache on and off, a request resumed alone, give the same tokens only then). Families
    whose rows have the same bits at every count, checked here on random data: cuBLAS as it is
    (no tiling, the default), where its rows agree across the counts; the unsplit GEMM (one
    float32 sum over K in order: a ``STEP_TILINGS`` tiling at each count, and cuBLAS at the
    counts where it does not split K, the same bits); each GEMV tiling at every count (where
    all counts are GEMV rows and the layer has no bias). The family with the least time summed
    over the counts wins where it takes at most ``margin`` x cuBLAS's sum; where cuBLAS's own
    rows differ between counts, the fastest other family wins whatever its time. Returns
    ({rows: tiling} for the counts that leave cuBLAS, {count: step_tiling's times, and "add" with
    ``residual_fold``; "sums": {"cublas_ms", "chosen_ms"}, the two families' times summed over the
    counts, the adds included}). Chosen per
    row count instead, the 9B hybrid took the GEMV at one row and cuBLAS at four, and a row
    decoded alone differed from the same row batched (GPU suite, 2026-12-04).
    ``residual_fold``: the layer is a down projection whose GEMV adds the decoder layer's residual
    in its epilogue (``fused.residual_down_projections``): cuBLAS and the unsplit GEMM are charged
    the add's own kernel as well, timed at each count (``times[count]["add"]``).
    ``act_fold``: the layer is a gated MLP's [gate; up] projection whose down projection leaves
    the activation to a kernel of its own (``fused.glu_projections``): the ``GLU_TILINGS``, one
    launch with the activation in the epilogue, are offered too, and every other family is
    charged that kernel, timed at each count as an elementwise kernel of its bytes (an add of two
    [rows, N / 2] halves: ``times[count]["act"]``).
    ``conv_fold``: the layer is a Gated DeltaNet's input projection whose GEMV without a split may
    take the decode step's convolution in its epilogue (``ConvFold``; its module's
    ``flare_conv_fold``): at the fold's counts (decode steps) such a GEMV is timed with the
    convolution in it and every other family is charged the convolution's kernel
    (``times[count]["conv"]``).
    ``norm_fold`` (``NormFold``): the layer's GEMVs may also take the norm before it in their
    loads: with ``act_fold`` its GLU tilings, the decoder layer's residual add too
    (``fused.norm_glu_projections``); without, its ``dot`` tilings, a decoder layer's input norm
    (``fused.input_norm_projections``): those without a split where ``conv_fold`` is given (with
    the convolution), every one elsewhere, the split ones where ``split_norm`` (the core's ticket
    counters, which a split GEMV with the norm needs). A family of each such tiling timed with the
    norm (``times[count]["norm_gemv"][tiling]``) is offered too, and every family that leaves the
    norm apart, those tilings without it included, is charged the norm's kernel
    (``times[count]["norm"]``); ``times["sums"]["norm"]`` then says whether the chosen family
    takes it."""
    times = {c: step_tiling(weight, bias, c, timer=timer, margin=1.0, glu=act_fold)[1] for c in counts}
    # (the tilings that may take the norm: a [gate; up] projection's GLU tilings (none split);
    # another's dot GEMVs, unsplit where it has a convolution (timed with it), split ones too where
    # the core's ticket counters let them add their slices with the norm)
    norm_tilings = [t for t in (GLU_TILINGS if act_fold else STEP_GEMV_TILINGS)
                    if t.dot and (t.split == 1 or (split_norm and not (act_fold or conv_fold)))]
    for c in counts:
        if residual_fold:
            times[c]["add"] = _add_ms(weight, c, timer)
        if act_fold:
            times[c]["act"] = _add_ms(weight, c, timer, columns=weight.shape[0] // 2)
        if norm_fold:
            times[c]["norm"] = _norm_ms(weight, c, norm_fold, timer)
            conv = conv_fold if conv_fold and c in conv_fold.counts else None
            times[c]["norm_gemv"] = {t: _norm_gemv_ms(weight, c, t, norm_fold, conv, timer)
                                     for t in norm_tilings if t in times[c]}
        if conv_fold and c in conv_fold.counts:
            times[c]["conv"] = _conv_ms(weight, c, conv_fold, timer)
            for t in STEP_GEMV_TILINGS:
                if t in times[c] and t.split == 1:
                    times[c][t] = _conv_gemv_ms(weight, c, t, conv_fold, timer)
    # (the activation's and the convolution's kernels are charged as the add is: to every family
    # that leaves them apart)
    add = {c: times[c].get("add", 0.0) + times[c].get("act", 0.0) + times[c].get("conv", 0.0) + times[c].get("norm", 0.0)
           for c in counts}
    w, b, x = _random_operands(weight, bias, counts[-1], seed=1)
    cublas = sum(times[c]["cublas"] + add[c] for c in counts)
    cublas_same = _cublas_same_rows(w, b, x, counts)
    # Counts where cuBLAS's bits are not the unsplit ones (all of them where its own rows differ
    # between counts: the family then keeps off cuBLAS).
    split = split_rows(weight, bias, counts, remedy="--step-gemms cublas") if cublas_same else frozenset(counts)
    unsplit, unsplit_ms = {}, 0.0
    for c in counts:
        t = min(STEP_TILINGS, key=times[c].get)
        if c not in split and times[c]["cublas"] <= times[c][t]:
            unsplit_ms += times[c]["cublas"] + add[c]  # cuBLAS does not split here: the same bits
        elif torch.equal(nonsplit_linear(x[:c], w, b, t), nonsplit_linear(x[:c], w, b)):
            unsplit[c], unsplit_ms = t, unsplit_ms + times[c][t] + add[c]
        else:  # a tiling whose bits are not its default's on this device: no unsplit family
            unsplit_ms = float("inf")
    families = [(unsplit_ms, unsplit, False)]  # (time summed over the counts, {count: tiling}, takes the norm)
    def charges(c: int, t: GemvTiling) -> float:  # the kernels a GEMV family leaves apart, but the norm
        # (a GEMV too narrow for the folds leaves the add to its own kernel too; none takes the
        # activation of an act_fold projection; a split one leaves the convolution)
        return ((times[c].get("add", 0.0) if t.bn < FOLD_MIN_BN else 0.0) + times[c].get("act", 0.0)
                + (times[c].get("conv", 0.0) if t.split > 1 else 0.0))

    def with_norm(t: GemvTiling) -> None:  # the family of ``t`` with the norm in its loads, where offered
        if norm_fold and t in norm_tilings and _norm_same_rows(w, x, t, counts, norm_fold):
            families.append((sum(times[c]["norm_gemv"][t] + (0.0 if t.glu else charges(c, t)) for c in counts),
                             {c: t for c in counts}, True))

    for t in STEP_GEMV_TILINGS:  # those step_tiling offered at every count (no bias, rows and K they take)
        if all(t in times[c] for c in counts) and _gemv_same_rows(w, x, t, counts):
            families.append((sum(times[c][t] + charges(c, t) + times[c].get("norm", 0.0) for c in counts),
                             {c: t for c in counts}, False))
            with_norm(t)
    for t in GLU_TILINGS if act_fold else ():
        if all(t in times[c] for c in counts) and _gemv_same_rows(w, x, t, counts):
            families.append((sum(times[c][t] + times[c].get("norm", 0.0) for c in counts), {c: t for c in counts}, False))
            with_norm(t)
    best_ms, best, takes_norm = min(families, key=lambda f: f[0])
    if not cublas_same:
        if best_ms == float("inf"):
            raise RuntimeError(f"no product gives a row the same bits at every step row count {counts} on this device "
                               f"({tuple(weight.shape)}): use --step-gemms cublas")
    elif not (best and best_ms <= margin * cublas):
        best, best_ms, takes_norm = {}, cublas, False
    times["sums"] = {"cublas_ms": cublas, "chosen_ms": best_ms}  # over the counts, the adds (activations) included
    if norm_fold:
        times["sums"]["norm"] = takes_norm
    return best, times


def choose_step_gemms(layers: Iterable[nn.Module], row_counts: Iterable[int], log=None,
                      tickets: torch.Tensor | None = None, conv_counts: Iterable[int] = (), **kw) -> dict[str, dict]:
    """For each plain linear layer under ``layers``, the product of its decode and verify steps
    (``step_choice``: one family for all their row counts, where it beats cuBLAS, which splits
    K for few rows and adds a reduce kernel). Returns {module name: {rows: tiling}} for the
    layers switched, measuring each (shape, dtype, residual fold) once; ``log``: a callable given a
    line of the summed times for each; ``tickets``: the core's GEMV ticket counters, which the
    switched layers' split GEMVs take (``gemv_linear``; timed with counters of their own). The
    down projections are decided before the gate/up projections, which are offered the GLU
    tilings where their down projection leaves the activation apart (``step_choice``'s
    ``act_fold``): greedily, a down projection is not credited with the activation kernel a
    folding GEMV would save. ``conv_counts``: the decode steps' row counts where a Gated DeltaNet's
    input projection, whose module offers the convolution to its GEMV (``flare_conv_fold``), may take
    it (the CUDA path's; none elsewhere): its GEMVs without a split are timed with it there and the
    other families charged its kernel (``step_choice``'s ``conv_fold``); ``check_conv_folds`` then
    decides where it is taken. A gate/up projection offered the GLU tilings whose layer's add and
    post-attention norm may go into its loads (``fused.norm_glu_projections``: the norms switched
    for steps before this) is offered a GLU family timed with them (``step_choice``'s ``norm_fold``,
    in the norm's form) and, where that family wins, takes them (``flare_norm_rows``). So is the
    projection that reads a decoder layer's input norm (``fused.input_norm_projections``: the q/k/v
    of its attention, its Gated DeltaNet's input projection), its ``dot`` GEMVs (split ones too
    with ``tickets``) timed with the norm in their loads; where that family wins the two are linked
    (``fused.link_input_norm``): in its steps the layer passes the norm's input on and the
    projection applies the norm."""
    from flare.prepare.recipes.fused import (glu_projections, hooked, input_norm_projections, link_input_norm,
                                             norm_glu_projections, residual_down_projections)

    counts = sorted(set(row_counts))
    if not counts:
        return {}
    layers = list(layers)
    folds = {id(m) for m in residual_down_projections(layers)}
    glus = {id(up): down for up, down in glu_projections(layers)}
    # (those that may take the norm too)
    norms = {id(up): NormFold(bool(norm._ZERO_CENTRED)) for up, norm in norm_glu_projections(layers)}
    # (the projections that may take their decoder layer's input norm, with the norm and the mixer)
    inputs = {id(proj): (norm, mixer) for proj, norm, mixer in input_norm_projections(layers)}
    # Gated DeltaNet input projections whose GEMV may take the convolution
    convs = {id(proj): ConvFold(channels, width, frozenset(conv_counts) & frozenset(counts))
             for _, _, proj, channels, width in (_conv_folds(layers) if conv_counts else ())}

    def loads_act(down: nn.Module) -> bool:  # the down projection takes the activation in its loads
        t = getattr(down, "flare_step_tiling", {})
        return not hooked(down) and all(isinstance(t.get(c), GemvTiling) and t[c].bn >= FOLD_MIN_BN
                                        and folds_swiglu(t[c]) for c in counts)

    measured: dict[tuple, dict] = {}
    found = {}
    # The gate/up projections last: whether their down projection takes the activation decides theirs.
    linears = list(_plain_linears(layers))
    for name, module in [m for m in linears if id(m[1]) not in glus] + [m for m in linears if id(m[1]) in glus]:
        act = id(module) in glus and not loads_act(glus[id(module)])
        conv = convs.get(id(module))
        norm = norms.get(id(module)) if act else None
        if id(module) in inputs:
            norm = NormFold(bool(inputs[id(module)][0]._ZERO_CENTRED), add=False)
        key = (*_key(module), id(module) in folds, act, conv, norm)
        if key not in measured:
            chosen, times = step_choice(module.weight, module.bias, counts, residual_fold=key[-4], act_fold=act,
                                        conv_fold=conv, norm_fold=norm, split_norm=tickets is not None, **kw)
            measured[key] = chosen, times["sums"].get("norm", False)
            if log is not None:
                sums = times["sums"]
                what = " with the residual add" if key[-4] else " with the activation, the norm offered" if norm and act \
                    else " with the activation" if act else " with the convolution" if conv else ""
                what += ", the input norm offered" if norm and not act else ""
                log(f"step GEMM times for {tuple(module.weight.shape)}{what} "
                    f"(µs summed over {counts} rows): cuBLAS {sums['cublas_ms'] * 1e3:.1f}, chosen "
                    f"{sums['chosen_ms'] * 1e3:.1f}" + (", the norm taken" if sums.get("norm") else ""))
        chosen, takes_norm = measured[key]
        if chosen:
            _switch(module)
            module.flare_step_tiling = dict(chosen)
            module.flare_tickets = tickets
            module.flare_norm_rows = frozenset(chosen) if takes_norm else frozenset()
            found[name] = dict(chosen)
        elif isinstance(module, _RowInvariant):  # (a choice of an earlier call does not stand)
            module.flare_step_tiling = {}
            module.flare_norm_rows = frozenset()
        if id(module) in inputs:
            norm_module, mixer = inputs[id(module)]
            link_input_norm(module, norm_module, mixer if chosen and takes_norm else None)
    return found
