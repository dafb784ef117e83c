"""The Gated DeltaNet block grid's data movement on the CUDA path, in three launches.

A prefill chunk on the slot's block grid (``recipes/qwen3_5._aligned_prefill``, the
reference) re-runs the stash of the block under way, then its own tokens, in two calls
of the chunked delta rule: the complete blocks, then the partial block. Around the two
calls it gathers the sequence (stash ++ chunk) from the slot's rows, picks the initial
matrix (the block start's when the grid ends at the chunk's start, else the recurrent
matrix), assembles the output rows and writes four state rows back. In torch that is
about fifty small launches per layer; on the H200 they made a 128-token chunk's layer
cost 218 µs against 60 µs for one call of the rule (``bench/gdn_kernels.py``,
``layer.grid``). Here the same movement takes three launches, reads each byte once and
does no arithmetic, so the rule sees the same inputs: the valid output rows and the state
rows are the reference's bits (``tests/test_gdn_grid.py``; the stash's rows past ``r``,
never read, are zero here where the reference leaves other rows' values)::

    grid_rows     (cdiv(whole + BLOCK, block_t), cdiv(width, block_c))
                  seq rows [whole + BLOCK, width]: the first ``whole`` are the first call's
                  (grid positions 0 .., zero from ``edge`` on), the last BLOCK the partial
                  block's (positions ``edge`` .., zero from ``total`` on); and
                  meta int32 [4] = (edge, total - edge, r, on_grid)
    grid_initial  (cdiv(Hv * Dk * Dv, block),)    the initial matrix [1, Hv, Dk, Dv]
    grid_commit   (the four parts' blocks,)       the output rows [T, Hv, Dv] (zero past the
                  count); when the chunk has tokens: the recurrent matrix, the block-start
                  matrix, the stash (the partial block's rows) and the grid row (S, r)

``r`` is the stash's length (0 when the grid does not end at the chunk's start),
``total = r + count`` and ``edge`` the start of the last, partial block. Rows that enter
the rule as zero (q, k, v and, through the gates' count, decay and beta) leave the
recurrence unchanged, as the reference's masked inputs do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _grid_meta(grid_ptr, slot, start_ptr, count_ptr, stride_g, BLOCK: tl.constexpr):
    """(r, total, edge, on_grid) of a chunk at ``start`` with ``count`` tokens."""
    S = tl.load(grid_ptr + slot * stride_g).to(tl.int64)
    kept = tl.load(grid_ptr + slot * stride_g + 1).to(tl.int64)
    on_grid = S == tl.load(start_ptr).to(tl.int64)
    r = tl.where(on_grid, kept, 0)
    total = r + tl.load(count_ptr).to(tl.int64)
    return r, total, total // BLOCK * BLOCK, on_grid


@triton.jit
def _grid_rows_kernel(
    rows_ptr, stash_ptr, grid_ptr, slot_ptr, start_ptr, count_ptr, seq_ptr, meta_ptr, WHOLE, WIDTH,
    stride_rt, stride_rc, stride_sr, stride_st, stride_sc, stride_g, stride_qt, stride_qc,
    BLOCK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    slot = tl.load(slot_ptr).to(tl.int64)
    r, total, edge, on_grid = _grid_meta(grid_ptr, slot, start_ptr, count_ptr, stride_g, BLOCK)
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        m = tl.arange(0, 4)
        meta = tl.where(m == 0, edge, tl.where(m == 1, total - edge, tl.where(m == 2, r, on_grid.to(tl.int64))))
        tl.store(meta_ptr + m, meta.to(tl.int32))
    i = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    tail = i >= WHOLE
    at = tl.where(tail, edge + i - WHOLE, i)  # the row's position on the grid
    used = (i < WHOLE + BLOCK) & (at < tl.where(tail, total, edge))
    stashed = at < r
    c_in = (c < WIDTH)[None, :]
    from_stash = tl.load(stash_ptr + slot * stride_sr + at[:, None] * stride_st + c[None, :] * stride_sc,
                         mask=(used & stashed)[:, None] & c_in, other=0.0)
    from_chunk = tl.load(rows_ptr + (at - r)[:, None] * stride_rt + c[None, :] * stride_rc,
                         mask=(used & ~stashed)[:, None] & c_in, other=0.0)
    x = tl.where(stashed[:, None], from_stash.to(seq_ptr.dtype.element_ty), from_chunk.to(seq_ptr.dtype.element_ty))
    tl.store(seq_ptr + i[:, None] * stride_qt + c[None, :] * stride_qc, x, mask=(i < WHOLE + BLOCK)[:, None] & c_in)


def grid_rows(rows: torch.Tensor, stash: torch.Tensor, grid: torch.Tensor, slot: torch.Tensor, start: torch.Tensor,
              count: torch.Tensor, whole: int, block: int, *, block_t: int = 16,
              block_c: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """The two rule calls' input rows and the chunk's grid figures: ``rows [T, width]``
    (the convolution's output | b | a), one layer's ``stash [slots, block, width]`` and
    ``grid [slots, 2]``; ``slot``, ``start`` (the chunk's first position) and ``count``:
    device tensors whose first element is read. Returns (seq ``[whole + block, width]`` in
    rows' dtype, meta int32 ``[4]``: edge, total - edge, r, on_grid)."""
    T, width = rows.shape
    if stash.dim() != 3 or stash.shape[1:] != (block, width) or grid.dim() != 2 or grid.shape[1] != 2:
        raise ValueError(f"stash {tuple(stash.shape)} / grid {tuple(grid.shape)}: expected "
                         f"[slots, {block}, {width}] and [slots, 2]")
    if grid.stride(1) != 1:
        raise ValueError("grid rows must hold (S, r) side by side")
    if whole % block or whole < T:
        raise ValueError(f"whole {whole} must be a multiple of {block} that holds the chunk's {T} rows")
    seq = torch.empty((whole + block, width), dtype=rows.dtype, device=rows.device)
    meta = torch.empty(4, dtype=torch.int32, device=rows.device)
    block_c = min(block_c, triton.next_power_of_2(width))
    _grid_rows_kernel[(triton.cdiv(whole + block, block_t), triton.cdiv(width, block_c))](
        rows, stash, grid, slot, start, count, seq, meta, whole, width, *rows.stride(), *stash.stride(),
        grid.stride(0), *seq.stride(), BLOCK=block, BLOCK_T=block_t, BLOCK_C=block_c, num_warps=4)
    return seq, meta


def _flat_rows(name: str, t: torch.Tensor) -> int:
    """The row stride of a ``[rows, ...]`` view whose rows are contiguous."""
    inner = t[0]
    if not inner.is_contiguous():
        raise ValueError(f"{name}: each row must be contiguous")
    return t.stride(0)


@triton.jit
def _grid_initial_kernel(block_ptr, rec_ptr, slot_ptr, meta_ptr, out_ptr, N, stride_b, stride_r,
                         BLOCK_N: tl.constexpr):
    slot = tl.load(slot_ptr).to(tl.int64)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    on_grid = (tl.zeros_like(n) + tl.load(meta_ptr + 3)) != 0  # a vector: masks are vectors
    n_in = n < N
    b = tl.load(block_ptr + slot * stride_b + n, mask=n_in & on_grid, other=0.0)
    r = tl.load(rec_ptr + slot * stride_r + n, mask=n_in & ~on_grid, other=0.0)
    tl.store(out_ptr + n, tl.where(on_grid, b, r), mask=n_in)


def grid_initial(block_rows: torch.Tensor, rec_rows: torch.Tensor, slot: torch.Tensor, meta: torch.Tensor, *,
                 block: int = 1024) -> torch.Tensor:
    """The first rule call's initial matrix ``[1, Hv, Dk, Dv]``: the slot's block-start
    matrix when the grid ends at the chunk's start (``meta[3]``), else its recurrent one."""
    if block_rows.shape != rec_rows.shape or block_rows.dtype != rec_rows.dtype:
        raise ValueError(f"block {tuple(block_rows.shape)} and recurrent {tuple(rec_rows.shape)} rows differ")
    out = torch.empty((1, *rec_rows.shape[1:]), dtype=rec_rows.dtype, device=rec_rows.device)
    N = out.numel()
    _grid_initial_kernel[(triton.cdiv(N, block),)](
        block_rows, rec_rows, slot, meta, out, N, _flat_rows("block rows", block_rows),
        _flat_rows("recurrent rows", rec_rows), BLOCK_N=block, num_warps=4)
    return out


@triton.jit
def _grid_commit_kernel(
    whole_ptr, tail_ptr, core_ptr, final_ptr, block_ptr, seq_ptr, rec_rows_ptr, block_rows_ptr, stash_rows_ptr,
    grid_ptr, slot_ptr, start_ptr, count_ptr, meta_ptr, T, F, N, WHOLE, STASH_N,
    stride_rec, stride_blk, stride_stash, stride_g,
    BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # The programs of the four parts one after another: output rows, recurrent matrix,
    # block-start matrix, stash.
    pid = tl.program_id(0)
    n_core = tl.cdiv(T * F, BLOCK_N)
    n_state = tl.cdiv(N, BLOCK_N)
    part = tl.where(pid < n_core, 0, tl.where(pid < n_core + n_state, 1, tl.where(pid < n_core + 2 * n_state, 2, 3)))
    base = tl.where(part == 0, 0, tl.where(part == 1, n_core, tl.where(part == 2, n_core + n_state,
                                                                          n_core + 2 * n_state)))
    slot = tl.load(slot_ptr).to(tl.int64)
    count = tl.load(count_ptr).to(tl.int64)
    n = (pid - base) * BLOCK_N + tl.arange(0, BLOCK_N)
    live = (tl.zeros_like(n) + count) > 0  # a chunk without tokens leaves the slot's state as it is
    if part == 0:  # output rows: chunk row t is grid position t + r, in the first call's rows or the tail's
        edge = tl.load(meta_ptr).to(tl.int64)
        r = tl.load(meta_ptr + 2).to(tl.int64)
        t = n // F
        f = n % F
        at = t + r
        used = (n < T * F) & (t < count)
        in_whole = at < edge
        a = tl.load(whole_ptr + at * F + f, mask=used & in_whole & (at < WHOLE), other=0.0)
        b = tl.load(tail_ptr + (at - edge) * F + f, mask=used & ~in_whole & (at - edge < BLOCK), other=0.0)
        tl.store(core_ptr + n, tl.where(in_whole, a, b), mask=n < T * F)
    elif part == 1:
        rec = tl.load(final_ptr + n, mask=(n < N) & live)
        tl.store(rec_rows_ptr + slot * stride_rec + n, rec, mask=(n < N) & live)
    elif part == 2:
        start_state = tl.load(block_ptr + n, mask=(n < N) & live)
        tl.store(block_rows_ptr + slot * stride_blk + n, start_state, mask=(n < N) & live)
    else:
        stash = tl.load(seq_ptr + WHOLE * (STASH_N // BLOCK) + n, mask=(n < STASH_N) & live)
        tl.store(stash_rows_ptr + slot * stride_stash + n, stash.to(stash_rows_ptr.dtype.element_ty),
                 mask=(n < STASH_N) & live)
        if (pid == base) & (count > 0):
            g = tl.arange(0, 2)
            start = tl.load(start_ptr).to(tl.int64)
            kept = tl.load(meta_ptr + 1).to(tl.int64)
            tl.store(grid_ptr + slot * stride_g + g, tl.where(g == 0, start + count, kept).to(tl.int32))


def grid_commit(whole_core: torch.Tensor, tail_core: torch.Tensor, final: torch.Tensor, block_state: torch.Tensor,
                seq: torch.Tensor, rec_rows: torch.Tensor, block_rows: torch.Tensor, stash_rows: torch.Tensor,
                grid: torch.Tensor, slot: torch.Tensor, start: torch.Tensor, count: torch.Tensor, meta: torch.Tensor,
                T: int, *, block: int = 1024) -> torch.Tensor:
    """The chunk's output rows ``[T, Hv, Dv]`` from the two calls' (``whole_core [whole, Hv,
    Dv]``, ``tail_core [BLOCK, Hv, Dv]``), zero past the count; when the chunk has tokens,
    the slot's recurrent row becomes ``final``, its block-start row ``block_state`` (both
    ``[1, Hv, Dk, Dv]``), its stash the partial block's rows (``seq``'s last BLOCK) and its
    grid row (start + count, total - edge)."""
    whole, Hv, Dv = whole_core.shape
    B = tail_core.shape[0]
    if tail_core.shape[1:] != (Hv, Dv) or final.shape != block_state.shape or final.shape[1:] != rec_rows.shape[1:]:
        raise ValueError(f"whole {tuple(whole_core.shape)} / tail {tuple(tail_core.shape)} / final "
                         f"{tuple(final.shape)} / block {tuple(block_state.shape)}: shapes do not agree")
    if seq.shape[0] != whole + B or stash_rows.shape[1:] != (B, seq.shape[1]):
        raise ValueError(f"seq {tuple(seq.shape)} / stash {tuple(stash_rows.shape)}: expected [{whole + B}, width] "
                         f"and [slots, {B}, width]")
    for name, t in (("whole", whole_core), ("tail", tail_core), ("final", final), ("block", block_state),
                    ("seq", seq)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    core = torch.empty((T, Hv, Dv), dtype=whole_core.dtype, device=whole_core.device)
    F, N, stash_n = Hv * Dv, final.numel(), B * seq.shape[1]
    blocks = triton.cdiv(T * F, block) + 2 * triton.cdiv(N, block) + triton.cdiv(stash_n, block)
    _grid_commit_kernel[(blocks,)](
        whole_core, tail_core, core, final, block_state, seq, rec_rows, block_rows, stash_rows, grid, slot, start,
        count, meta, T, F, N, whole, stash_n, _flat_rows("recurrent rows", rec_rows),
        _flat_rows("block rows", block_rows), _flat_rows("stash rows", stash_rows), grid.stride(0),
        BLOCK=B, BLOCK_N=block, num_warps=4)
    return core
