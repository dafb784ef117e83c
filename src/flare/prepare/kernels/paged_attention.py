"""Capture-safe paged attention in Triton (flash-decoding over pages).

Semantics are :func:`flare.prepare.attention.attend_reference`'s: token ``i``
of request slot ``s`` attends to key positions ``0..positions[i]`` of that
slot (with a sliding window ``W``: ``positions[i] - W + 1 .. positions[i]``, the
key blocks before the tile's earliest window skipped), the keys read through
``page_table[s]``. Rows with ``valid == False``
read nothing and produce zeros.

One kernel serves decode and prefill. A program owns a tile of query *rows*
for one kv head and one split of the key range::

    rows  = BLOCK_T tokens x HEADS query heads of one kv head (GQA packing)
            row r -> token tb*BLOCK_T + r // HEADS, head kvh*GROUP + r % HEADS
            (HEADS >= GROUP, a power of two; rows with r % HEADS >= GROUP are padding)
    keys  = 0 .. max(position of the tile's valid rows), BLOCK_N per step,
            each key's page looked up in page_table (page = j // PAGE)
    grid  = (cdiv(T, BLOCK_T), KVH, SPLITS)      -- static shapes only

Every length, position, slot and page is read on the device; nothing on the
host depends on tensor values, so the launch can be captured in a CUDA graph
and replayed with new inputs. Scores and the softmax state are fp32 (online
softmax in base 2); ``tl.dot`` runs on tensor cores in the cache dtype. In prompt
launches (``full_blocks``) the key blocks that every row of a tile sees whole run without
masks (``_key_range``): at long context all but the window's first block and the causal
diagonal, 1.5x faster on an H100 after 16K-62K cached tokens; the same bits (in the
interpreter, and compiled on the GPU with the row mask's select kept, see ``_key_block``).
Decode launches mask every block.

A tile of several tokens shares key tiles only if its valid tokens share one
slot (prefill). The kernel checks that on the device; a tile with mixed slots
falls back to one pass per token, so any batch is correct and the tiling hint
(:attr:`PagedBatch.single_slot`) only chooses speed.

Splits: ``SPLITS`` (static, the grid's third dimension) is the most programs
that may share one tile's key range. How many do (``eff``) is decided on the
device from the tiles that hold a valid token, so that about ``TARGET``
programs work (in a decode launch also from the tile's own keys, below). A prefill of 11
tokens after a 4,096-token cached prefix (one tile of ``prefill.128``) spreads its keys
over up to ``SPLITS`` programs, where a split sized statically for the capacity's 8 tiles
gave each of its few programs 13 key blocks in series. With ``eff > 1`` each working program
writes unnormalised partials for its valid rows and a second kernel combines
them; with ``eff == 1`` the program writes the output itself and the combine
does nothing. Every program of a tile computes the same ``eff``, and the tile's program
(tb, 0, 0) stores it for the combine. A decode launch with ticket counters (a CUDA
core's, ``PagedBatch.tickets``: ``FOLD``) needs no second kernel: each of a tile's programs
takes a ticket after storing its partials, and the one that takes the last folds the tile's
rows (every split's maximum and sum in one load, the partial outputs ``FOLD_CH`` splits at a
time: a fixed order, the same bits whoever arrives last), and sets its counter back to zero
(one launch fewer for every attention layer of a decode step).

Prompt programs (``SEG > 0``) must give a row the same bits whatever program it runs in
(the prefix cache prefills a suffix in a small program, the same prompt without the cache
in a large one), and ``eff`` depends on how many tiles hold tokens. So their keys come in
segments of ``SEG`` blocks at fixed positions (``plan_launch``: at least 4 blocks, at most
128 segments a row, the same for every prompt program of a core), and their query tiles
have the same height in every prompt program. Each segment starts from a fresh softmax
state and the segments are folded in order (``_fold``): by the program itself when
``eff == 1``, otherwise each split program stores its segments' partials (program ``split``
takes segments ``split, split + eff, ...``; partials by the tile's rank among the tiles
holding tokens) and the combine folds the row's segments the same way. The partials have
room for ``RTILES`` such tiles (128 MiB); a launch with more does not split (it has tiles
enough, and the bits do not depend on it). Decode steps keep the even split (their rows
need not equal a prompt's), whose partition of a row's keys follows ``eff``, hence the
step's live rows: past about ``eff`` key blocks of context a decode row's bits depend on
what shares its step. A decode tile's ``eff`` is also at most one program for each
``SPLIT_BLOCKS`` key blocks its rows span (``_key_splits``): a 16-token history is one program's
work rather than 32 programs' partials that the last folds (13.3 µs an attention layer on the
H100's 30B-A3B decode step at one row, against 5.8 for its q/k norm-rotary launch:
`timeline-qwen3-30b-a3b-shape-2026-12-07.json`). A row's bits change with it only where the
split without it gave each program one block (histories of 2 to ``eff`` blocks); below
``SPLIT_BLOCKS`` x ``eff`` blocks the partition of a decode row's keys follows from its own
length alone. ``segments=True`` gives a
decode launch the prompt launches' segments (one token a tile), so its rows do not depend on
what shares the step at any length; no program takes it: on the H200 it is
1.4-1.8x slower at four live rows of 16K-128K context (``bench/attention_decode.py``,
docs/gpu.md).

Open (noted 2026-12-02, when the segments were new; they have run on the GPU since):
* Speed, not measured apart: at the 8B shape with a 131K context a segment is 16 blocks
  (1,024 keys) and 3 tiles (48 tokens) may split, so a 128-token suffix after a 4K prefix
  runs one program per tile and kv head over 64 blocks in series (before: about 5 splits
  of 13 blocks); the prefix-hit TTFT and a 16- against a 2,048-row program's bits decide.
* The combine folds up to 128 segments in series per row, one load each (prefetch the
  next segment, keeping the order, if it shows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from flare.prepare.attention import PagedBatch, query_tile_tokens

LOG2E = 1.4426950408889634
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_SPLITS = 32
_PARTIAL_BYTES = 64 << 20  # largest split partials buffer of one launch (float32 acc)
_SEG_COUNT = 128  # most key segments of a prompt row (segments grow with the context limit)
_SEG_MIN = 4  # fewest key blocks a segment (the key loop is pipelined within a segment)
_SEG_PARTIAL_BYTES = 128 << 20  # largest segment partials buffer of one prompt launch
_DOT_MIN = 16  # tl.dot needs at least 16 rows
# Fewest key blocks a decode split works on: a row's keys go to at most one split per
# SPLIT_BLOCKS blocks of them (``_key_splits``), so a short history is not spread over the
# chip's worth of programs that each store a partial for the last one to fold.
SPLIT_BLOCKS = 2


@triton.jit
def _key_block(b, q, m, l, acc, act, pos, win, n_keys, pt_row, k_cache, v_cache, num_pages, kvh, d, d_in,
               stride_ptp, stride_cp, stride_co, stride_ch, stride_cd, scale_log2,
               PAGE: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, MASK: tl.constexpr,
               EVEN_D: tl.constexpr):
    """One block of BLOCK_N keys into the online softmax state (m, l, acc) of the rows.
    ``MASK`` False: a block every active row sees whole (``_key_range``), scored without
    the causal and window masks and loaded without key masks; only the row mask stays. It
    keeps the masked block's bits (a mask that keeps every score changes none) and is also
    what keeps them on the GPU: a select between the scaling multiply and the softmax's
    subtraction stops the compiler fusing the two into one FMA (a different rounding),
    as the masked path's select does."""
    j = b * BLOCK_N + tl.arange(0, BLOCK_N)
    if MASK:
        k_in = j < n_keys
        page = tl.load(pt_row + (j // PAGE) * stride_ptp, mask=k_in, other=0)
        # A page id outside the pool is treated as absent: never read out of bounds.
        k_in = k_in & (page >= 0) & (page < num_pages)
    else:
        page = tl.load(pt_row + (j // PAGE) * stride_ptp)
        # Never out of bounds here either: a page id outside the pool (a corrupt table;
        # the masked path would drop its keys) reads the null page.
        page = tl.where((page >= 0) & (page < num_pages), page, 0)
        k_in = j >= 0
    off = page.to(tl.int64) * stride_cp + (j % PAGE) * stride_co + kvh * stride_ch
    if EVEN_D and not MASK:  # no mask at all: the loads vectorise whole
        k = tl.load(k_cache + off[None, :] + d[:, None] * stride_cd)
    else:
        k = tl.load(k_cache + off[None, :] + d[:, None] * stride_cd, mask=k_in[None, :] & d_in[:, None], other=0.0)
    s = tl.dot(q, k, input_precision=PRECISION) * scale_log2
    if MASK:
        sees = act[:, None] & k_in[None, :] & (j[None, :] <= pos[:, None]) & (j[None, :] > pos[:, None] - win)
    else:
        sees = act[:, None]
    s = tl.where(sees, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    l = l * alpha + tl.sum(p, 1)
    if EVEN_D and not MASK:
        v = tl.load(v_cache + off[:, None] + d[None, :] * stride_cd)
    else:
        v = tl.load(v_cache + off[:, None] + d[None, :] * stride_cd, mask=k_in[:, None] & d_in[None, :], other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l, acc


@triton.jit
def _key_range(lo, hi, full_lo, full_hi, q, m, l, acc, act, pos, win, n_keys, pt_row, k_cache, v_cache, num_pages,
               kvh, d, d_in, stride_ptp, stride_cp, stride_co, stride_ch, stride_cd, scale_log2,
               PAGE: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, FULL: tl.constexpr,
               EVEN_D: tl.constexpr):
    """Key blocks ``lo .. hi - 1`` in order, masked; with ``FULL``, those in ``full_lo ..
    full_hi - 1`` (every row sees them whole) unmasked and only the rest (the window's
    first block, the causal diagonal) masked: the same bits as masking them all."""
    if FULL:
        a = tl.minimum(tl.maximum(full_lo, lo), hi)
        z = tl.maximum(tl.minimum(full_hi, hi), a)
        for b in range(lo, a):
            m, l, acc = _key_block(b, q, m, l, acc, act, pos, win, n_keys, pt_row, k_cache, v_cache, num_pages, kvh,
                                   d, d_in, stride_ptp, stride_cp, stride_co, stride_ch, stride_cd, scale_log2, PAGE,
                                   BLOCK_N, PRECISION, True, EVEN_D)
        for b in range(a, z):
            m, l, acc = _key_block(b, q, m, l, acc, act, pos, win, n_keys, pt_row, k_cache, v_cache, num_pages, kvh,
                                   d, d_in, stride_ptp, stride_cp, stride_co, stride_ch, stride_cd, scale_log2, PAGE,
                                   BLOCK_N, PRECISION, False, EVEN_D)
        lo = z
    for b in range(lo, hi):
        m, l, acc = _key_block(b, q, m, l, acc, act, pos, win, n_keys, pt_row, k_cache, v_cache, num_pages, kvh, d,
                               d_in, stride_ptp, stride_cp, stride_co, stride_ch, stride_cd, scale_log2, PAGE,
                               BLOCK_N, PRECISION, True, EVEN_D)
    return m, l, acc


@triton.jit
def _fold(M, L, O, m, l, acc):
    """Fold one segment's softmax state (m, l [R], acc [R, D_PAD]) into the running one
    (M, L, O), in explicit fused multiply-adds so that the attend kernel (R = its rows) and
    the combine kernel (R = 1) round it alike. A segment a row sees nothing of (m = -1e30,
    l = 0, acc = 0) leaves the running state as it is."""
    M2 = tl.maximum(M, m)
    a = tl.exp2(M - M2)
    b = tl.exp2(m - M2)
    a2 = tl.broadcast_to(a[:, None], acc.shape)
    b2 = tl.broadcast_to(b[:, None], acc.shape)
    return M2, tl.fma(L, a, l * b), tl.fma(O, a2, acc * b2)


@triton.jit
def _attend_kernel(
    q_ptr, out_ptr, k_cache, v_cache, page_table, token_slot, positions, valid,
    part_acc, part_m, part_l, part_eff,
    T, H, num_pages, max_pages, scale_log2, window,
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_cp, stride_co, stride_ch, stride_cd,
    stride_pts, stride_ptp, stride_ts, stride_pos, stride_val,
    GROUP: tl.constexpr, HEADS: tl.constexpr, BLOCK_T: tl.constexpr,
    PAGE: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, PRECISION: tl.constexpr,
    TILES_PAD: tl.constexpr, TARGET: tl.constexpr, SEG: tl.constexpr, NSEG: tl.constexpr,
    RTILES: tl.constexpr, FULL_BLOCKS: tl.constexpr, tickets=None, FOLD: tl.constexpr = False,
    SPLITS_PAD: tl.constexpr = 1, FOLD_CH: tl.constexpr = 1, SPLIT_BLOCKS: tl.constexpr = 0,
):
    tb = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ROWS: tl.constexpr = BLOCK_T * HEADS

    r = tl.arange(0, ROWS)
    tok = r // HEADS  # token within the tile
    g = r % HEADS  # head within the kv head's group
    t = tb * BLOCK_T + tok
    h = kvh * GROUP + g
    t_in = t < T
    row_in = t_in & (g < GROUP)
    d = tl.arange(0, D_PAD)
    d_in = d < D

    slot = tl.load(token_slot + t * stride_ts, mask=t_in, other=0).to(tl.int32)
    pos = tl.load(positions + t * stride_pos, mask=t_in, other=0).to(tl.int32)
    row_valid = row_in & (tl.load(valid + t * stride_val, mask=t_in, other=0) != 0)
    key_limit = max_pages * PAGE
    win = tl.where(window > 0, window, key_limit + 1)  # 0: the whole history

    if SPLITS > 1:
        eff = _effective_splits(valid, T, stride_val, tl.num_programs(1), BLOCK_T, TILES_PAD, SPLITS, TARGET,
                                RTILES)
        if SEG == 0:
            if SPLIT_BLOCKS > 0:
                eff = tl.minimum(eff, _key_splits(row_valid, pos, win, key_limit, BLOCK_N, SPLIT_BLOCKS))
        if (kvh == 0) & (split == 0):
            tl.store(part_eff + tb, eff)
    else:
        eff = 1
    # Segment partials go by the tile's rank among the tiles holding tokens (at most RTILES).
    rank = 0
    if SEG > 0:
        if SPLITS > 1:
            rank = _tile_rank(valid, T, stride_val, tb, BLOCK_T, TILES_PAD)

    # One slot for the whole tile (prefill, or a single token) -> one pass whose
    # key tiles every row shares. Otherwise one pass per token of the tile.
    slot_hi = tl.max(tl.where(row_valid, slot, -1), 0)
    slot_lo = tl.min(tl.where(row_valid, slot, slot_hi), 0)
    any_valid = tl.max(row_valid.to(tl.int32), 0) > 0
    uniform = slot_lo == slot_hi
    n_pass = tl.where(any_valid, tl.where(uniform, 1, BLOCK_T), 0)
    n_pass = tl.where(split < eff, n_pass, 0)  # a split beyond this launch's count idles

    q = tl.load(
        q_ptr + t[:, None] * stride_qt + h[:, None] * stride_qh + d[None, :] * stride_qd,
        mask=row_in[:, None] & d_in[None, :],
        other=0.0,
    ).to(k_cache.dtype.element_ty)

    # m starts finite so that fully masked rows give exp2(0) = 1, never NaN.
    m = tl.full([ROWS], -1.0e30, tl.float32)
    l = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, D_PAD], tl.float32)

    for p_i in range(0, n_pass):
        t_pass = tb * BLOCK_T + p_i
        pass_slot = tl.load(token_slot + t_pass * stride_ts, mask=t_pass < T, other=0).to(tl.int32)
        kslot = tl.where(uniform, slot_hi, pass_slot)
        # Rows of this pass: the whole tile, or token p_i alone. (Bounds rather than
        # `uniform | (tok == p_i)`: Triton's interpreter mis-types scalar-tensor `|`.)
        act = row_valid & (tok >= tl.where(uniform, 0, p_i)) & (tok <= tl.where(uniform, BLOCK_T, p_i))
        n_keys, n_blocks, b_first = _key_blocks(act, pos, win, key_limit, BLOCK_N)
        pt_row = page_table + kslot.to(tl.int64) * stride_pts
        # FULL_BLOCKS: blocks every active row sees whole (inside each one's window, up to
        # the lowest position) are scored unmasked where the pass is the whole tile (a
        # token's own pass leaves the other rows' state as it is only through the mask).
        full_lo = 0
        full_hi = 0
        if FULL_BLOCKS:
            full_lo = (tl.max(tl.where(act, pos, 0), 0) - win + BLOCK_N) // BLOCK_N
            full_hi = tl.minimum((tl.min(tl.where(act, pos, key_limit), 0) + 1) // BLOCK_N, n_keys // BLOCK_N)
            full_hi = tl.where(uniform, full_hi, 0)
        if SEG > 0:
            # Prompt programs: the keys in segments of SEG blocks at fixed positions, each
            # from a fresh softmax state, folded in order (_fold); a split program stores
            # its segments' partials and the combine folds them the same way, so a row's
            # bits do not depend on how many programs shared its keys.
            for sg in range(b_first // SEG + split, (n_blocks + SEG - 1) // SEG, eff):
                sm = tl.full([ROWS], -1.0e30, tl.float32)
                sl = tl.zeros([ROWS], tl.float32)
                sacc = tl.zeros([ROWS, D_PAD], tl.float32)
                sm, sl, sacc = _key_range(
                    tl.maximum(sg * SEG, b_first), tl.minimum(sg * SEG + SEG, n_blocks), full_lo, full_hi,
                    q, sm, sl, sacc, act, pos, win, n_keys, pt_row, k_cache, v_cache, num_pages, kvh, d, d_in,
                    stride_ptp, stride_cp, stride_co, stride_ch, stride_cd, scale_log2, PAGE, BLOCK_N, PRECISION,
                    FULL_BLOCKS, D == D_PAD)
                if eff == 1:
                    m, l, acc = _fold(m, l, acc, sm, sl, sacc)
                else:
                    keep = act & row_valid
                    prow = ((rank * BLOCK_T + tok) * H + h) * NSEG + sg
                    tl.store(part_m + prow, sm, mask=keep)
                    tl.store(part_l + prow, sl, mask=keep)
                    tl.store(part_acc + prow[:, None] * D_PAD + d[None, :], sacc, mask=keep[:, None])
        else:
            per_split = (n_blocks - b_first + eff - 1) // eff
            b_lo = b_first + split * per_split
            b_hi = tl.minimum(b_lo + per_split, n_blocks)
            m, l, acc = _key_range(
                b_lo, b_hi, full_lo, full_hi, q, m, l, acc, act, pos, win, n_keys, pt_row, k_cache, v_cache,
                num_pages, kvh, d, d_in, stride_ptp, stride_cp, stride_co, stride_ch, stride_cd, scale_log2, PAGE,
                BLOCK_N, PRECISION, FULL_BLOCKS, D == D_PAD)

    if eff == 1:
        if split == 0:
            o = acc / tl.where(l > 0, l, 1.0)[:, None]  # l == 0 only for rows that saw no key: acc == 0
            tl.store(
                out_ptr + t[:, None] * stride_ot + h[:, None] * stride_oh + d[None, :] * stride_od,
                o.to(out_ptr.dtype.element_ty),
                mask=row_in[:, None] & d_in[None, :],
            )
    elif SEG == 0:
        # Partials of valid rows only, of the working splits only: the combine reads
        # exactly these (an invalid row's output is zeros without any partial).
        keep = row_valid & ((tl.zeros([ROWS], tl.int32) + split) < eff)  # (a tensor: see the `|` note)
        prow = (t * H + h) * SPLITS + split
        tl.store(part_m + prow, m, mask=keep)
        tl.store(part_l + prow, l, mask=keep)
        tl.store(part_acc + prow[:, None] * D_PAD + d[None, :], acc, mask=keep[:, None])
        if FOLD:
            # The tile's SPLITS programs (idle ones too) each take a ticket after storing their
            # partials; the last folds the tile's rows in a fixed order whoever it is, and sets the
            # counter back to zero: the combine is no launch of its own.
            tl.debug_barrier()  # every thread's partials are stored before the ticket
            ticket = tl.atomic_add(tickets + tb * tl.num_programs(1) + kvh, 1, sem="acq_rel", scope="gpu")
            if ticket == SPLITS - 1:
                # Every split's maximum and sum in one load each, the outputs FOLD_CH splits at a
                # time (a [ROWS, FOLD_CH, D_PAD] block a load, unrolled: a few round trips to L2
                # where a split at a time took two per split, 24 µs a launch at 32 splits on the
                # H100 against 15 for the attend and combine kernels).
                row0 = (t * H + h) * SPLITS
                sp = tl.arange(0, SPLITS_PAD)
                sp_in = row_valid[:, None] & (sp[None, :] < eff)
                pm = tl.load(part_m + row0[:, None] + sp[None, :], mask=sp_in, other=-1.0e30, cache_modifier=".cg")
                big = tl.max(pm, 1)
                l_sum = tl.sum(tl.exp2(pm - big[:, None]) * tl.load(part_l + row0[:, None] + sp[None, :], mask=sp_in,
                                                                    other=0.0, cache_modifier=".cg"), 1)
                o = tl.zeros([ROWS, D_PAD], tl.float32)
                for c in tl.static_range(0, SPLITS_PAD, FOLD_CH):
                    spc = c + tl.arange(0, FOLD_CH)
                    in_c = row_valid[:, None] & (spc[None, :] < eff)
                    at = row0[:, None] + spc[None, :]
                    # (a masked split's weight exp2(-1e30 - big) is 0, or 1 times zeros where no split holds)
                    w = tl.exp2(tl.load(part_m + at, mask=in_c, other=-1.0e30, cache_modifier=".cg") - big[:, None])
                    pa = tl.load(part_acc + at[:, :, None] * D_PAD + d[None, None, :], mask=in_c[:, :, None],
                                 other=0.0, cache_modifier=".cg")
                    o += tl.sum(pa * w[:, :, None], 1)
                o = o / tl.where(l_sum > 0, l_sum, 1.0)[:, None]  # an invalid row: zeros
                tl.store(
                    out_ptr + t[:, None] * stride_ot + h[:, None] * stride_oh + d[None, :] * stride_od,
                    o.to(out_ptr.dtype.element_ty),
                    mask=row_in[:, None] & d_in[None, :],
                )
                tl.atomic_xchg(tickets + tb * tl.num_programs(1) + kvh, 0, sem="relaxed", scope="gpu")


@triton.jit
def _active_tiles(valid, T, stride_val, BLOCK_T: tl.constexpr, TILES_PAD: tl.constexpr):
    """[TILES_PAD] int32: 1 where the tile holds a valid token."""
    tt = tl.arange(0, TILES_PAD)[:, None] * BLOCK_T + tl.arange(0, BLOCK_T)[None, :]
    vv = (tl.load(valid + tt * stride_val, mask=tt < T, other=0) != 0).to(tl.int32)
    return tl.max(vv, 1)


@triton.jit
def _tile_rank(valid, T, stride_val, tile, BLOCK_T: tl.constexpr, TILES_PAD: tl.constexpr):
    """How many tiles before ``tile`` hold a valid token."""
    act = _active_tiles(valid, T, stride_val, BLOCK_T, TILES_PAD)
    return tl.sum(tl.where(tl.arange(0, TILES_PAD) < tile, act, 0), 0)


@triton.jit
def _effective_splits(valid, T, stride_val, KVH, BLOCK_T: tl.constexpr, TILES_PAD: tl.constexpr,
                      SPLITS: tl.constexpr, TARGET: tl.constexpr, RTILES: tl.constexpr):
    """Programs per tile for this launch: enough that the tiles holding a valid token,
    times the kv heads, times the splits come to about TARGET, at most SPLITS; in a
    prompt launch (``RTILES`` > 0) one when more tiles hold tokens than the segment
    partials have room for (a row's bits do not depend on it there). A function of
    ``valid`` alone, so every program of both kernels agrees."""
    active = tl.maximum(tl.sum(_active_tiles(valid, T, stride_val, BLOCK_T, TILES_PAD), 0), 1)
    eff = tl.minimum(tl.maximum((TARGET + active * KVH - 1) // (active * KVH), 1), SPLITS)
    if RTILES > 0:
        eff = tl.where(active > RTILES, 1, eff)
    return eff


@triton.jit
def _key_blocks(rows, pos, win, key_limit, BLOCK_N: tl.constexpr):
    """The keys of ``rows`` (a mask of the tile's rows): how many (up to the last row's position,
    at most ``key_limit``), in how many blocks, and the first block not wholly before every row's
    window (a sliding window skips the blocks before it)."""
    n_keys = tl.minimum(tl.max(tl.where(rows, pos, -1), 0) + 1, key_limit)
    n_blocks = (n_keys + BLOCK_N - 1) // BLOCK_N
    first_key = tl.maximum(tl.min(tl.where(rows, pos, key_limit), 0) - win + 1, 0)
    return n_keys, n_blocks, tl.minimum(first_key // BLOCK_N, n_blocks)


@triton.jit
def _key_splits(row_valid, pos, win, key_limit, BLOCK_N: tl.constexpr, SPLIT_BLOCKS: tl.constexpr):
    """Most programs a decode tile's keys give work to: one for each ``SPLIT_BLOCKS`` key blocks
    its valid rows span (``_key_blocks``, as its passes take them), at least one. A function of the
    tile's rows alone, so its programs and the combine agree."""
    _, n_blocks, b_first = _key_blocks(row_valid, pos, win, key_limit, BLOCK_N)
    return tl.maximum((n_blocks - b_first + SPLIT_BLOCKS - 1) // SPLIT_BLOCKS, 1)


@triton.jit
def _combine_kernel(
    part_acc, part_m, part_l, part_eff, out_ptr, valid, positions,
    T, H, stride_ot, stride_oh, stride_od, stride_val, stride_pos, key_limit, window,
    SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    SEG: tl.constexpr, NSEG: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, TILES_PAD: tl.constexpr,
    H_PAD: tl.constexpr = 1,
):
    """The splits' partial outputs of an attend launch that did not fold them, summed into ``out``.
    Decode's even splits (``SEG`` 0): a program per row (t * H + h) sums its splits in one tensor.
    A prompt launch's segments: a program per token folds each of its heads' segments in order
    (``H_PAD`` >= H rows), as the attend kernel folds them, a row's elementwise arithmetic the same
    whatever the rows beside it, so a token's heads share its position, tile rank and loop."""
    d = tl.arange(0, D_PAD)
    if SEG > 0:
        t = tl.program_id(0)
        hh = tl.arange(0, H_PAD)
        h_in = hh < H
        if tl.load(part_eff + t // BLOCK_T) > 1:  # 1: the attend kernel wrote the output itself
            # Segments of the tile this row sees nothing of would leave the state as it is.
            # An invalid row (a prompt program's padding, most of a short chunk's rows) reads no
            # partial and writes zeros without ranking its tile.
            o = tl.zeros([H_PAD, D_PAD], tl.float32)
            if tl.load(valid + t * stride_val) != 0:
                pos = tl.load(positions + t * stride_pos).to(tl.int32)
                n_blocks = (tl.minimum(pos + 1, key_limit) + BLOCK_N - 1) // BLOCK_N
                win = tl.where(window > 0, window, key_limit + 1)
                s_lo = tl.maximum(pos - win + 1, 0) // BLOCK_N // SEG
                s_hi = (n_blocks + SEG - 1) // SEG
                rank = _tile_rank(valid, T, stride_val, t // BLOCK_T, BLOCK_T, TILES_PAD)
                prow0 = ((rank * BLOCK_T + t % BLOCK_T) * H + hh) * NSEG
                M = tl.full([H_PAD], -1.0e30, tl.float32)
                L = tl.zeros([H_PAD], tl.float32)
                O = tl.zeros([H_PAD, D_PAD], tl.float32)
                for sg in range(s_lo, s_hi):
                    prow = prow0 + sg
                    M, L, O = _fold(M, L, O, tl.load(part_m + prow, mask=h_in, other=-1.0e30),
                                    tl.load(part_l + prow, mask=h_in, other=0.0),
                                    tl.load(part_acc + prow[:, None] * D_PAD + d[None, :], mask=h_in[:, None],
                                            other=0.0))
                o = O / tl.where(L > 0, L, 1.0)[:, None]
            tl.store(out_ptr + t * stride_ot + hh[:, None] * stride_oh + d[None, :] * stride_od,
                     o.to(out_ptr.dtype.element_ty), mask=h_in[:, None] & (d[None, :] < D))
    else:
        row = tl.program_id(0)  # t * H + h
        t = row // H
        h = row % H
        eff = tl.load(part_eff + t // BLOCK_T)  # the row's tile's
        if eff > 1:  # eff == 1: the attend kernel wrote the output itself
            ok = tl.load(valid + t * stride_val) != 0
            sp = tl.arange(0, SPLITS_PAD)
            sp_in = sp < tl.where(ok, eff, 0)  # an invalid row reads no partial
            m = tl.load(part_m + row * SPLITS + sp, mask=sp_in, other=-1.0e30)
            l = tl.load(part_l + row * SPLITS + sp, mask=sp_in, other=0.0)
            w = tl.exp2(m - tl.max(m, 0))
            l_sum = tl.sum(w * l, 0)
            acc = tl.load(part_acc + (row * SPLITS + sp[:, None]) * D_PAD + d[None, :], mask=sp_in[:, None],
                          other=0.0)
            o = tl.sum(acc * w[:, None], 0) / tl.where(l_sum > 0, l_sum, 1.0)  # an invalid row: zeros
            tl.store(out_ptr + t * stride_ot + h * stride_oh + d * stride_od, o.to(out_ptr.dtype.element_ty),
                     mask=d < D)


# Partial outputs the split fold loads at a time (float32 elements of a [rows, splits, D] block).
FOLD_BLOCK = 8192


def fold_splits(rows: int, d_pad: int, splits: int) -> int:
    """Splits the fold of a decode launch's last program loads together (``FOLD_CH``): a power of
    two, with ``rows`` x ``d_pad`` partial outputs each, about ``FOLD_BLOCK`` elements at most."""
    return max(1, min(triton.next_power_of_2(splits), FOLD_BLOCK // (rows * d_pad)))


@dataclass(frozen=True)
class Launch:
    """Static launch shape of :func:`attend_triton` (a function of shapes only)."""

    block_t: int  # query tokens per program
    heads: int  # padded query heads per token (>= group, power of two)
    block_n: int  # keys per inner step
    splits: int  # most programs sharing one row tile's key range (the device picks how many do)
    target: int = 264  # programs the device aims for when it picks the splits (2 x multiprocessors)
    # Prompt programs: keys in segments of ``seg`` blocks at fixed positions (0: decode's
    # even split of each tile's key range), at most ``nseg`` a row; the same for every
    # prompt program of a core, so a prompt row's bits do not depend on its program.
    seg: int = 0
    nseg: int = 0
    rtiles: int = 0  # prompt launches: most tiles holding tokens whose segment partials fit (more: no split)
    num_warps: int = 4
    num_stages: int = 2
    # Score the key blocks every row of a tile sees whole without masks (``_key_range``; the
    # same bits): prompt launches, where at long context nearly every block is whole.
    full_blocks: bool = False
    # Decode launches (``seg`` 0): at most one split per this many key blocks of a tile's keys
    # (0: as many as ``splits`` and ``target`` give, however short the history; prompt launches 0).
    split_blocks: int = SPLIT_BLOCKS

    @property
    def rows(self) -> int:
        return self.block_t * self.heads


def plan_launch(
    T: int, H: int, KVH: int, D: int, max_pages: int, page_size: int, *,
    tile_tokens: bool, sm_count: int, num_splits: int | None = None, segments: bool | None = None,
    rows: int | None = None, block_n: int | None = None, num_warps: int = 4, num_stages: int = 2,
    split_blocks: int = SPLIT_BLOCKS,
) -> Launch:
    """``segments``: keys in segments at fixed positions (default: in prompt launches, those
    that tile query tokens); True for a decode launch gives its rows the same bits whatever
    the step's live rows (module docstring). ``rows`` (query rows of a prompt tile, default
    ``QUERY_TILE_ROWS``), ``block_n``, ``num_warps`` and ``num_stages``: other tilings,
    for benchmarks (a core's prompt programs must all share one tile height); ``split_blocks``:
    the fewest key blocks a decode split works on (0: no such limit)."""
    tiled = tile_tokens and T > 1
    segments = tiled if segments is None else segments
    heads = triton.next_power_of_2(H // KVH)
    if tiled:
        # The same tile height in every prompt program, however few its rows: a row's
        # arithmetic (the dot's shape) must not depend on the program.
        block_t = query_tile_tokens(H, KVH, rows)
    else:
        block_t = 1
    heads = max(heads, -(-_DOT_MIN // block_t))  # pad a short tile up to tl.dot's minimum
    block_n = block_n or (64 if D <= 128 else 32)
    key_blocks = -(-(max_pages * page_size) // block_n)
    d_pad = max(16, triton.next_power_of_2(D))
    seg = nseg = rtiles = 0
    if segments:
        # Segments of at least _SEG_MIN blocks, at most _SEG_COUNT a row; the partials of
        # every segment of up to ``rtiles`` tiles (ranked among those holding tokens) fit
        # the budget, and a launch with more such tiles does not split (it has tiles enough).
        seg = max(_SEG_MIN, -(-key_blocks // _SEG_COUNT))
        nseg = -(-key_blocks // seg)
        per_tile = block_t * H * nseg * (d_pad + 2) * 4
        rtiles = min(-(-T // block_t), _SEG_PARTIAL_BYTES // per_tile)
        if num_splits is None:
            num_splits = min(-(-2 * sm_count // KVH), nseg, _MAX_SPLITS) if rtiles else 1
        rtiles = max(rtiles, 1)
    elif num_splits is None:
        # As many as one active tile would need to fill the chip twice, within the key
        # blocks a slot can have and the partials' memory (the device picks how many work).
        budget = max(1, _PARTIAL_BYTES // (T * H * d_pad * 4))
        num_splits = min(-(-2 * sm_count // KVH), key_blocks, _MAX_SPLITS, budget)
    return Launch(block_t=block_t, heads=heads, block_n=block_n, splits=max(1, num_splits),
                  target=2 * sm_count, seg=seg, nseg=nseg, rtiles=rtiles, num_warps=num_warps,
                  num_stages=num_stages, full_blocks=tiled, split_blocks=0 if seg else split_blocks)


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the CPU interpreter: small grids


def _check(batch: PagedBatch, layer: int, q: torch.Tensor) -> None:
    kv = batch.kv
    if q.dim() != 3:
        raise ValueError(f"q must be [T, H, D], got shape {tuple(q.shape)}")
    if kv.dim() != 6 or kv.shape[1] != 2:
        raise ValueError(f"kv must be [L, 2, P, page_size, KVH, D], got shape {tuple(kv.shape)}")
    if not 0 <= layer < kv.shape[0]:
        raise ValueError(f"layer {layer} outside kv's {kv.shape[0]} layers")
    T, H, D = q.shape
    if kv.shape[-1] != D:
        raise ValueError(f"head_dim: q has {D}, kv has {kv.shape[-1]}")
    if H % kv.shape[-2]:
        raise ValueError(f"query heads {H} not a multiple of kv heads {kv.shape[-2]}")
    if q.dtype not in _DTYPES or kv.dtype not in _DTYPES:
        raise ValueError(f"dtypes q={q.dtype} kv={kv.dtype}: expected float16, bfloat16 or float32")
    for name in ("token_slot", "positions", "valid"):
        if getattr(batch, name).shape != (T,):
            raise ValueError(f"batch.{name} has shape {tuple(getattr(batch, name).shape)}, expected ({T},)")


def attend_triton(
    batch: PagedBatch, layer: int, q: torch.Tensor, scaling: float, *, num_splits: int | None = None,
    target: int | None = None, window: int = 0, segments: bool | None = None, full_blocks: bool | None = None,
    launch: Launch | None = None, split_blocks: int = SPLIT_BLOCKS,
) -> torch.Tensor:
    """Paged attention of ``q`` (``[T, H, D]``) over ``batch``'s pages -> ``[T, H, D]`` in ``q.dtype``;
    ``window`` > 0 limits each token to the keys at positions ``> position - window``.

    ``num_splits`` overrides the most key-range splits and ``target`` the programs the
    device aims for (tests); by default both follow from static shapes and the
    device's multiprocessor count. ``segments=True`` folds a decode launch's keys in
    segments at fixed positions, as prompt launches do (``plan_launch``).
    ``full_blocks`` (default: the launch's, True for prompt launches that tile query tokens)
    scores the key blocks every row of a tile sees whole without masks (the same bits; tests
    and ``bench/attention_prefill.py`` set it either way); ``launch`` replaces the planned launch
    (benchmarks of other tilings: ``plan_launch``'s ``block_n``, ``rows``, ``num_warps``,
    ``num_stages``); ``split_blocks`` the fewest key blocks a decode split works on (0: no limit;
    a ``launch`` given brings its own).
    """
    _check(batch, layer, q)
    kv = batch.kv
    T, H, D = q.shape
    KVH, ps, P = kv.shape[-2], kv.shape[3], kv.shape[2]
    max_pages = batch.page_table.shape[1]
    out = torch.empty((T, H, D), dtype=q.dtype, device=q.device)
    if T == 0:
        return out
    lc = launch or plan_launch(
        T, H, KVH, D, max_pages, ps,
        tile_tokens=batch.single_slot or batch.tiles, sm_count=_sm_count(q.device), num_splits=num_splits,
        segments=segments, split_blocks=split_blocks,
    )
    d_pad = max(16, triton.next_power_of_2(D))
    k_cache, v_cache = kv[layer, 0], kv[layer, 1]  # [P, page_size, KVH, D] views
    if lc.splits > 1:
        rows, slots = (lc.rtiles * lc.block_t, lc.nseg) if lc.seg else (T, lc.splits)  # partials' rows, per row
        part_acc = torch.empty((rows, H, slots, d_pad), dtype=torch.float32, device=q.device)
        part_m = torch.empty((rows, H, slots), dtype=torch.float32, device=q.device)
        part_l = torch.empty((rows, H, slots), dtype=torch.float32, device=q.device)
        part_eff = torch.empty((triton.cdiv(T, lc.block_t),), dtype=torch.int32, device=q.device)  # a tile's
    else:
        part_acc = part_m = part_l = part_eff = out  # never touched when SPLITS == 1
    valid = batch.valid.view(torch.uint8)
    pt = batch.page_table
    tiles = triton.cdiv(T, lc.block_t)
    grid = (tiles, KVH, lc.splits)
    # A decode launch's last program of each tile folds the splits itself where the batch has
    # ticket counters (a CUDA core's: ``PagedBatch.tickets``); otherwise the combine kernel does.
    tickets = batch.tickets
    fold = (lc.splits > 1 and not lc.seg and tickets is not None and tickets.dtype == torch.int32
            and tickets.numel() >= tiles * KVH)
    _attend_kernel[grid](
        q, out, k_cache, v_cache, pt, batch.token_slot, batch.positions, valid,
        part_acc, part_m, part_l, part_eff,
        T, H, P, max_pages, scaling * LOG2E, window,
        *q.stride(), *out.stride(), *k_cache.stride(),
        pt.stride(0), pt.stride(1), batch.token_slot.stride(0), batch.positions.stride(0), valid.stride(0),
        GROUP=H // KVH, HEADS=lc.heads, BLOCK_T=lc.block_t, PAGE=ps, D=D, D_PAD=d_pad,
        BLOCK_N=lc.block_n, SPLITS=lc.splits,
        PRECISION="ieee" if kv.dtype == torch.float32 else "tf32",
        TILES_PAD=triton.next_power_of_2(tiles), TARGET=lc.target if target is None else target,
        SEG=lc.seg, NSEG=lc.nseg, RTILES=lc.rtiles,
        FULL_BLOCKS=lc.full_blocks if full_blocks is None else full_blocks,
        tickets=tickets if fold else part_eff, FOLD=fold, SPLITS_PAD=triton.next_power_of_2(lc.splits),
        FOLD_CH=fold_splits(lc.rows, d_pad, lc.splits), SPLIT_BLOCKS=lc.split_blocks, num_warps=lc.num_warps,
        num_stages=lc.num_stages,
    )
    if lc.splits > 1 and not fold:
        _combine_kernel[(T if lc.seg else T * H,)](  # (a program per token for segments, per row otherwise)
            part_acc, part_m, part_l, part_eff, out, valid, batch.positions, T, H, *out.stride(), valid.stride(0),
            batch.positions.stride(0), max_pages * ps, window,
            SPLITS=lc.splits, SPLITS_PAD=triton.next_power_of_2(lc.splits), D=D, D_PAD=d_pad,
            SEG=lc.seg, NSEG=lc.nseg, BLOCK_N=lc.block_n, BLOCK_T=lc.block_t,
            TILES_PAD=triton.next_power_of_2(tiles), H_PAD=triton.next_power_of_2(H) if lc.seg else 1, num_warps=4,
        )
    return out
