"""The sampler's kernels: the filters and draw over the sorted probabilities in one program a
row, the softmax before the sort and the log-probability block (further down) in two launches
each, and the commit of a sampled token in one.

``sampling.choose`` and ``sampling.verify_chain`` sort each row's probabilities and then
apply top-k, top-p and min-p, widen the kept prefix to the ties of its last member and draw
by inverse CDF (``sampling.filtered``, ``_draw``, ``_verify``). In plain tensor operations
that is about 35 kernels after the sort (scans, sums, gathers, comparisons): on the H200
about 0.1 ms of a decode step, launched one by one in the captured graph, for work that is
a few microseconds when the kept prefix is short (bench/timeline.py, the step's tail).

``draw_sorted`` does the same in one Triton program a row. It walks the row's sorted
probabilities block by block and stops where the kept prefix ends:

1. the prefix where every filter holds (``p >= p_k``, the mass strictly before a token
   ``< top_p`` unless top-p is 1 or more, ``p >= min_p * p_max``), at least one token; its
   last value is the threshold (a row no filter holds back keeps every token without a walk);
2. the tokens ``>= threshold`` (ties widened), their mass and count; for a verification,
   also the proposal's mass and the mass without it;
3. the inverse-CDF draw over that mass (and, verifying, over the mass without the
   proposal), stopping at the block where the target is passed.

The definitions are ``sampling.filtered``'s; only the arithmetic of the sums differs
(float32 block scans with a carried total, where ATen scans the row, on the CPU in double,
and divides by a separate sum), so a token can differ from the torch path's only where a
target falls within rounding of a boundary. A row
reads nothing of another row and its blocks are walked in one order, so a row's result
does not depend on the batch (ATen's scans of long rows may split by the row count).
The work follows the kept prefix: one block for top-k 20; a long kept prefix (nothing
filters: top_p 1, no top-k, no min-p) is passed chunk by chunk on the chunks' sums, a launch
before the walk (``draw_sorted``), and walked in blocks only in the chunk where it ends.

The CUDA default (``flare-prepare --sampler kernel``; ``ops`` keeps the tensor operations):
on the H200 every program of the GPU suite's seven shapes replays bitwise with it, and the
sampling tail of a step (scores, filters, draw and the log-probability block below) takes
0.18 instead of 0.38 ms at one row of a 248,320-token vocabulary with top-k 20 and top-p
0.95, 0.28 instead of 1.14 ms at four (``bench/sampler_tail.py``, docs/performance.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048
# Blocks a chunk of the draw's skip-ahead (``draw_sorted``): 4 blocks of 2,048, so a 151,936-token
# vocabulary is 19 chunk sums, read together by the walk.
CHUNK_BLOCKS = 4


@triton.jit
def _kept_block(sp_ptr, base, start, offs, V, thr):
    """A block of the sorted row from ``start``: positions, in range, values, kept (``>= thr``)
    and the kept values (zero elsewhere)."""
    idx = start + offs
    inb = idx < V
    s = tl.load(sp_ptr + base + idx, mask=inb, other=0.0)
    kept = inb & (s >= thr)
    return idx, inb, s, kept, tl.where(kept, s, 0.0)


@triton.jit
def _row_cuts(sp_ptr, base, V, top_k_ptr, min_p_ptr, row):
    """A sorted row's top-k and min-p cuts: (k, the k-th value, the min-p floor); a top-k of 0, a
    negative one or one of V and more keeps the whole row."""
    top_k = tl.load(top_k_ptr + row).to(tl.int32)
    k = tl.where((top_k > 0) & (top_k < V), top_k, V)
    return k, tl.load(sp_ptr + base + k - 1), tl.load(min_p_ptr + row) * tl.load(sp_ptr + base)


@triton.jit
def _chunk_sums_kernel(sp_ptr, stride, V, sums_ptr, NC, top_k_ptr, min_p_ptr, CHUNK: tl.constexpr):
    """Program (row, chunk): the sum of the chunk's CHUNK sorted probabilities (one reduction),
    or 0 without reading them where the chunk's last token is below the row's top-k value or
    min-p floor: such a chunk passes none of the walk's tests (the kept threshold is at least
    both), so its sum is never read into a running total (a short top-k reads no chunk)."""
    row = tl.program_id(0)
    c = tl.program_id(1)
    base = row.to(tl.int64) * stride
    _, kth, floor = _row_cuts(sp_ptr, base, V, top_k_ptr, min_p_ptr, row)
    last = tl.load(sp_ptr + base + tl.minimum((c + 1) * CHUNK, V) - 1)
    total = tl.zeros([], tl.float32)
    if (last >= kth) & (last >= floor):
        idx = c * CHUNK + tl.arange(0, CHUNK)
        total = tl.sum(tl.load(sp_ptr + base + idx, mask=idx < V, other=0.0), 0)
    tl.store(sums_ptr + row.to(tl.int64) * NC + c, total)


@triton.jit
def _whole_chunks(sp_ptr, base, V, sums_ptr, sums_row, NC, a0, a1, a2,
                  MODE: tl.constexpr, CHUNK: tl.constexpr, NCP: tl.constexpr):
    """The leading chunks whose every token passes a test of their last token (each test holds
    on a prefix of the sorted row, so a chunk passes whole when its last token does): their
    count and the mass through them (the chunk sums' running total; 0 for none; a prefix sum
    reads no later chunk's sum). MODE 0, the filters: value >= a0 (the top-k value), mass
    before it < a1 (the nucleus), value >= a2 (the min-p floor); 1, kept: value >= a0 (the
    threshold); 2, kept (a0) with the running mass through it <= a1 (the draw's target)."""
    c = tl.arange(0, NCP)
    inc = c < NC
    cs = tl.load(sums_ptr + sums_row + c, mask=inc, other=0.0)
    cend = tl.cumsum(cs, 0)
    last = tl.load(sp_ptr + base + tl.minimum((c + 1) * CHUNK, V) - 1, mask=inc, other=0.0)
    if MODE == 0:
        ok = (last >= a0) & (cend - last < a1) & (last >= a2)
    elif MODE == 1:
        ok = last >= a0
    else:
        ok = (last >= a0) & (cend <= a1)
    n = tl.min(tl.where(inc & ok, NCP, c), 0)  # the first chunk that fails (NCP: none)
    n = tl.minimum(n, NC)
    mass = tl.sum(tl.where(c == n - 1, cend, 0.0), 0)
    return n, mass


@triton.jit
def _draw_sorted_kernel(sp_ptr, si_ptr, stride, V, top_k_ptr, top_p_ptr, min_p_ptr, u_ptr, prop_ptr, u_rej_ptr,
                        tok_ptr, vtok_ptr, acc_ptr, sums_ptr, NC, VERIFY: tl.constexpr, BLOCK: tl.constexpr,
                        CHUNK: tl.constexpr = 0, NCP: tl.constexpr = 1):
    row = tl.program_id(0)
    base = row.to(tl.int64) * stride
    sums_row = row.to(tl.int64) * NC
    offs = tl.arange(0, BLOCK)
    k, kth, floor = _row_cuts(sp_ptr, base, V, top_k_ptr, min_p_ptr, row)
    top_p = tl.load(top_p_ptr + row)
    # No filter holds anything back (no top-k, top-p >= 1, min-p under the smallest value, a
    # NaN-free row): every token is kept without a walk (the sampling defaults of OpenAI clients).
    everything = (k == V) & (top_p >= 1.0) & (tl.load(sp_ptr + base + V - 1) >= floor)
    nucleus = tl.where(top_p >= 1.0, float("inf"), top_p)  # top-p >= 1 holds nothing back

    # 1. The kept prefix: every filter holds (each is a prefix of the sorted row).
    n_keep = tl.zeros([], tl.int32)
    carry = tl.zeros([], tl.float32)
    start = tl.zeros([], tl.int32)
    if CHUNK > 0:
        # Chunks matter only where the first passes top-k and min-p (a later one's last token is
        # no larger, and the kept threshold is at least both): a short top-k reads no chunk sum.
        last0 = tl.load(sp_ptr + base + tl.minimum(CHUNK, V) - 1)
        chunky = (last0 >= kth) & (last0 >= floor)
        if chunky:  # whole chunks first (their sums), then blocks from the first chunk cut
            nc, carry = _whole_chunks(sp_ptr, base, V, sums_ptr, sums_row, NC, kth, nucleus, floor, 0, CHUNK, NCP)
            n_keep = tl.minimum(nc * CHUNK, V)
            start = n_keep
    go = (start < V) & ~everything
    while go:
        idx = start + offs
        inb = idx < V
        s = tl.load(sp_ptr + base + idx, mask=inb, other=0.0)
        incl = carry + tl.cumsum(s, 0)
        keep = inb & (s >= kth) & (incl - s < nucleus) & (s >= floor)
        c = tl.sum(keep.to(tl.int32), 0)
        n_keep += c
        carry = tl.max(incl, 0)  # the running total (non-negative terms)
        start += BLOCK
        go = (c == BLOCK) & (start < V)
    n_keep = tl.where(everything, V, tl.maximum(n_keep, 1))
    thr = tl.load(sp_ptr + base + n_keep - 1)

    # 2. Widened to the ties of the threshold: mass and count (and the proposal's part).
    prop = tl.zeros([], tl.int64)
    if VERIFY:
        prop = tl.load(prop_ptr + row).to(tl.int64)
    total = tl.zeros([], tl.float32)
    rest_total = tl.zeros([], tl.float32)
    mass_x = tl.zeros([], tl.float32)
    last_rest = tl.zeros([], tl.int32)
    n_kept = tl.zeros([], tl.int32)
    start = tl.zeros([], tl.int32)
    if CHUNK > 0:
        if chunky:
            n_whole, total = _whole_chunks(sp_ptr, base, V, sums_ptr, sums_row, NC, thr, 0.0, 0.0, 1, CHUNK, NCP)
            n_kept = tl.minimum(n_whole * CHUNK, V)
            start = n_kept
    go = start < V
    while go:
        idx, inb, s, kept, ks = _kept_block(sp_ptr, base, start, offs, V, thr)
        total = tl.max(total + tl.cumsum(ks, 0), 0)
        c = tl.sum(kept.to(tl.int32), 0)
        n_kept += c
        if VERIFY:
            ids = tl.load(si_ptr + base + idx, mask=inb, other=-1)
            at = kept & (ids == prop)
            mass_x += tl.sum(tl.where(at, s, 0.0), 0)
            rs = tl.where(at, 0.0, ks)
            rest_total = tl.max(rest_total + tl.cumsum(rs, 0), 0)
            last_rest = tl.maximum(last_rest, tl.max(tl.where(rs > 0, idx, 0), 0))
        start += BLOCK
        go = (c == BLOCK) & (start < V)
    n_kept = tl.maximum(n_kept, 1)  # (a NaN row keeps nothing: its draw reads the row's first id)

    # 3. Inverse CDF: the first kept position whose running mass passes the target.
    target = tl.load(u_ptr + row) * total
    target_r = tl.zeros([], tl.float32)
    if VERIFY:
        target_r = tl.load(u_rej_ptr + row) * rest_total
    below = tl.zeros([], tl.int32)
    below_r = tl.zeros([], tl.int32)
    run = tl.zeros([], tl.float32)
    run_r = tl.zeros([], tl.float32)
    start = tl.zeros([], tl.int32)
    if CHUNK > 0:
        if chunky:  # the whole-kept chunks the target passes
            n_pass, run = _whole_chunks(sp_ptr, base, V, sums_ptr, sums_row, NC, thr, target, 0.0, 2, CHUNK, NCP)
            below = tl.minimum(n_pass * CHUNK, V)
            start = below
    go = start < V
    while go:
        idx, inb, s, kept, ks = _kept_block(sp_ptr, base, start, offs, V, thr)
        incl = run + tl.cumsum(ks, 0)
        run = tl.max(incl, 0)
        c = tl.sum(kept.to(tl.int32), 0)
        b = tl.sum((kept & (incl <= target)).to(tl.int32), 0)
        below += b
        more = b == c
        if VERIFY:
            ids = tl.load(si_ptr + base + idx, mask=inb, other=-1)
            rs = tl.where(ids == prop, 0.0, ks)
            incl_r = run_r + tl.cumsum(rs, 0)
            run_r = tl.max(incl_r, 0)
            b_r = tl.sum((kept & (incl_r <= target_r)).to(tl.int32), 0)
            below_r += b_r
            more = more | (b_r == c)
        start += BLOCK
        go = more & (c == BLOCK) & (start < V)
    tl.store(tok_ptr + row, tl.load(si_ptr + base + tl.minimum(below, n_kept - 1)))
    if VERIFY:
        # Correctly rounded, as torch divides: Triton's "/" is an approximate division (within
        # 2 ulp), which turned p(x) = 1 into 1 - 2^-24 and rejected a draw of u = 1 - 2^-24.
        accepted = tl.load(u_ptr + row) < tl.div_rn(mass_x, total)
        drawn = tl.load(si_ptr + base + tl.minimum(below_r, last_rest))
        tl.store(vtok_ptr + row, tl.where(accepted, prop, drawn))
        tl.store(acc_ptr + row, accepted.to(tl.int8))


def draw_sorted(sp: torch.Tensor, si: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                min_p: torch.Tensor, u: torch.Tensor, proposal: torch.Tensor | None = None,
                u_rej: torch.Tensor | None = None, block: int = BLOCK, chunk: int | None = None):
    """Over probabilities sorted descending ``sp [N, V]`` (float32) and their token ids
    ``si``: the filters of ``sampling.filtered`` and the draw of ``sampling._draw`` with
    ``u`` (token ids int64 ``[N]``). With a ``proposal`` (int64 ``[N]``) and ``u_rej``,
    also ``sampling._verify``'s verdict: returns (tokens, verified tokens, accepted bool).
    ``block``: tokens a step of the walk (tests use small ones to cross many blocks).

    Without a proposal, a launch of a program per row and chunk of ``chunk`` tokens (default
    ``CHUNK_BLOCKS`` blocks) first sums each chunk, and the walk skips the chunks that a filter,
    the kept mass or the draw's target passes whole, walking blocks only in the chunk where it
    stops: a row that keeps every token (no top-k, top-p 1: OpenAI clients' defaults) or a
    long prefix costs a few blocks, not the vocabulary's. ``chunk`` 0: the block walk alone
    (verification always walks blocks: the proposal's mass and the redraw need the ids)."""
    N, V = sp.shape
    if sp.stride(-1) != 1 or si.stride(-1) != 1 or si.stride(0) != sp.stride(0):
        raise ValueError("draw_sorted needs rows with unit stride and one row stride")
    tok = torch.empty(N, dtype=torch.int64, device=sp.device)
    verify = proposal is not None
    vtok = torch.empty(N, dtype=torch.int64, device=sp.device) if verify else tok
    acc = torch.empty(N, dtype=torch.int8, device=sp.device) if verify else tok
    chunk = 0 if verify else (block * CHUNK_BLOCKS if chunk is None else chunk)
    if chunk and (chunk % block or chunk & (chunk - 1)):
        raise ValueError(f"draw_sorted's chunk {chunk}: a power of two and a multiple of the block {block}")
    nc = triton.cdiv(V, chunk) if chunk else 1
    sums = torch.empty((N, nc), dtype=torch.float32, device=sp.device) if chunk else sp
    top_k, min_p = top_k.contiguous(), min_p.float().contiguous()  # (a copy each, in a program: once)
    if chunk:
        _chunk_sums_kernel[(N, nc)](sp, sp.stride(0), V, sums, nc, top_k, min_p, CHUNK=chunk,
                                    num_warps=8 if chunk >= 4096 else 4)
    _draw_sorted_kernel[(N,)](
        sp, si, sp.stride(0), V, top_k, top_p.float().contiguous(), min_p,
        u.float().contiguous(), proposal.contiguous() if verify else tok, u_rej.float().contiguous() if verify else u,
        tok, vtok, acc, sums, nc, VERIFY=verify, BLOCK=block, CHUNK=chunk, NCP=triton.next_power_of_2(nc),
        num_warps=8 if block >= 1024 else 4)
    return (tok, vtok, acc.bool()) if verify else tok


# -- the softmax before the sort ---------------------------------------------------------------
#
# ``sampling._sorted`` sorts each row's probabilities: ATen's softmax of a row is one block of
# threads walking the whole vocabulary (about 13-16 µs of a decode step's tail for 151,936
# tokens, bench/timeline.py). Here a row is split over programs of SM_CHUNK tokens: each leaves
# its chunk's maximum and sum of exponentials relative to it, then each rescales the row's
# partial sums to the row's maximum (in chunk order: a row's result does not depend on the
# batch) and writes its chunk's probabilities, exp(x - max) / sum with a correctly rounded
# division. A row of -inf only is NaN and a NaN anywhere makes its row NaN, as torch's softmax.

SM_CHUNK = 4096


@triton.jit
def _max_sum_exp(x, inb):
    """A block's maximum and its sum of exp(x - maximum) over ``inb`` (``_softmax_part_kernel`` and
    ``_logprob_part_kernel``); a block of -inf has no mass (x - m would be NaN there)."""
    m = tl.max(x, 0)
    return m, tl.sum(tl.where(inb, tl.exp(x - tl.where(m == float("-inf"), 0.0, m)), 0.0), 0)


@triton.jit
def _row_max_sum(m_ptr, s_ptr, at, NB, NBP: tl.constexpr):
    """A row's maximum and sum of exp(x - maximum) from its NB blocks' (``_max_sum_exp``), in
    block order; blocks of no mass add nothing."""
    b = tl.arange(0, NBP)
    m = tl.load(m_ptr + at + b, mask=b < NB, other=float("-inf"))
    big = tl.max(m, 0)
    s = tl.load(s_ptr + at + b, mask=b < NB, other=0.0)
    return big, tl.sum(tl.where(m == float("-inf"), s, s * tl.exp(m - big)), 0)


@triton.jit
def _softmax_part_kernel(x_ptr, stride, V, NC, m_ptr, s_ptr, CHUNK: tl.constexpr):
    row = tl.program_id(0)
    c = tl.program_id(1)
    idx = c * CHUNK + tl.arange(0, CHUNK)
    inb = idx < V
    x = tl.load(x_ptr + row.to(tl.int64) * stride + idx, mask=inb, other=float("-inf"))
    m, s = _max_sum_exp(x, inb)
    s = tl.where(tl.sum((x != x).to(tl.int32), 0) > 0, float("nan"), s)  # (a NaN makes the row's sum NaN)
    at = row.to(tl.int64) * NC + c
    tl.store(m_ptr + at, m)
    tl.store(s_ptr + at, s)


@triton.jit
def _softmax_norm_kernel(x_ptr, p_ptr, stride, stride_p, V, NC, m_ptr, s_ptr, CHUNK: tl.constexpr,
                         NCP: tl.constexpr):
    row = tl.program_id(0)
    c = tl.program_id(1)
    big, total = _row_max_sum(m_ptr, s_ptr, row.to(tl.int64) * NC, NC, NCP)
    idx = c * CHUNK + tl.arange(0, CHUNK)
    inb = idx < V
    x = tl.load(x_ptr + row.to(tl.int64) * stride + idx, mask=inb, other=float("-inf"))
    tl.store(p_ptr + row.to(tl.int64) * stride_p + idx, tl.div_rn(tl.exp(x - big), total), mask=inb)


def softmax_rows(x: torch.Tensor, chunk: int = SM_CHUNK) -> torch.Tensor:
    """torch.softmax(x, dim=-1) of float32 rows ``[N, V]`` (unit stride) in two launches of a
    program per row and chunk of ``chunk`` tokens (tests use small ones)."""
    N, V = x.shape
    if x.dtype != torch.float32 or x.stride(-1) != 1:
        raise ValueError(f"softmax_rows needs float32 rows of unit stride, got {x.dtype} {tuple(x.stride())}")
    nc = triton.cdiv(V, chunk)
    m = torch.empty((N, nc), dtype=torch.float32, device=x.device)
    s = torch.empty((N, nc), dtype=torch.float32, device=x.device)
    p = torch.empty((N, V), dtype=torch.float32, device=x.device)
    if N and V:
        warps = 8 if chunk >= 4096 else 4
        _softmax_part_kernel[(N, nc)](x, x.stride(0), V, nc, m, s, CHUNK=chunk, num_warps=warps)
        _softmax_norm_kernel[(N, nc)](x, p, x.stride(0), p.stride(0), V, nc, m, s, CHUNK=chunk,
                                      NCP=triton.next_power_of_2(nc), num_warps=warps)
    return p


# -- the log-probability block ------------------------------------------------------------
#
# ``sampling.logprob_block``: log_softmax of the raw logits over the sampling vocabulary,
# the sampled (or scored) token's value and the N largest with their ids. With tensor
# operations that is a softmax, a gather and ATen's radix top-k: about 30 kernels a step
# on the H200 (the decode tail of bench/timeline.py). Here it is two: each program of
# ``_logprob_part_kernel`` takes a block of a row's logits and leaves its maximum, its sum
# of exponentials relative to that maximum and its N largest candidates; one program a row
# of ``_logprob_merge_kernel`` joins a row's blocks. Candidates are 64-bit keys: the
# logit's float32 bits mapped to an order-preserving unsigned integer above the complement
# of the token id, so the largest key is the largest logit and, among equal logits, the
# lowest id (torch.topk leaves the order of ties unspecified; two logits that differ but
# round to one log-probability keep their logit order); N maxima are taken one after the
# other. A row reads nothing of another row and is summed in one order whatever the batch.

LP_BLOCK = 4096


@triton.jit
def _order_key(x, idx):
    """64-bit keys ordering (x descending, idx ascending) as unsigned integers (-0.0 as +0.0)."""
    bits = tl.where(x == 0.0, 0.0, x).to(tl.uint32, bitcast=True)
    ordered = tl.where((bits >> 31) != 0, ~bits, bits | 0x80000000)
    return (ordered.to(tl.uint64) << 32) | (0xFFFFFFFF - idx.to(tl.uint32)).to(tl.uint64)


@triton.jit
def _wants_block(slots_ptr, on_ptr, row, GATED: tl.constexpr):
    """Whether a row's slot asks for its log-probability block (every row without a gate)."""
    want = True
    if GATED:
        want = tl.load(on_ptr + tl.load(slots_ptr + row).to(tl.int64)) != 0
    return want


@triton.jit
def _logprob_part_kernel(x_ptr, stride, V, NB, m_ptr, s_ptr, key_ptr, slots_ptr, on_ptr, N: tl.constexpr,
                         NP: tl.constexpr, BLOCK: tl.constexpr, GATED: tl.constexpr):
    row = tl.program_id(0)
    blk = tl.program_id(1)
    if _wants_block(slots_ptr, on_ptr, row, GATED):  # (a row that asks for none reads nothing)
        idx = blk * BLOCK + tl.arange(0, BLOCK)
        inb = idx < V
        x = tl.load(x_ptr + row.to(tl.int64) * stride + idx, mask=inb, other=float("-inf")).to(tl.float32)
        m, s = _max_sum_exp(x, inb)
        at = row.to(tl.int64) * NB + blk
        tl.store(m_ptr + at, m)
        tl.store(s_ptr + at, s)
        keys = tl.where(inb, _order_key(x, idx), 0)
        out = key_ptr + at * NP
        for k in tl.static_range(N):
            top = tl.max(keys, 0)
            tl.store(out + k, top)
            keys = tl.where(keys == top, 0, keys)


@triton.jit
def _logprob_merge_kernel(x_ptr, stride, V, NB, m_ptr, s_ptr, key_ptr, tok_ptr, out_ptr, stride_out, slots_ptr,
                          on_ptr, N: tl.constexpr, NP: tl.constexpr, NBP: tl.constexpr, GATED: tl.constexpr):
    row = tl.program_id(0)
    out = out_ptr + row.to(tl.int64) * stride_out
    if _wants_block(slots_ptr, on_ptr, row, GATED):
        at = row.to(tl.int64) * NB
        big, s = _row_max_sum(m_ptr, s_ptr, at, NB, NBP)
        log_s = tl.log(s)
        base = x_ptr + row.to(tl.int64) * stride
        tok = tl.minimum(tl.maximum(tl.load(tok_ptr + row), 0), V - 1)
        tl.store(out, ((tl.load(base + tok).to(tl.float32) - big) - log_s).to(tl.int32, bitcast=True))
        c = tl.arange(0, NBP * NP)
        keys = tl.load(key_ptr + at * NP + c, mask=(c < NB * NP) & (c % NP < N), other=0)
        for k in tl.static_range(N):
            top = tl.max(keys, 0)
            keys = tl.where(keys == top, 0, keys)
            i = (0xFFFFFFFF - (top & 0xFFFFFFFF)).to(tl.int32)
            tl.store(out + 1 + k, ((tl.load(base + i).to(tl.float32) - big) - log_s).to(tl.int32, bitcast=True))
            tl.store(out + 1 + N + k, i)
    else:  # zeros where the slot asks for none (the host reads no block there)
        j = tl.arange(0, 2 * NP)  # (not c: a name bound in both branches must keep one type)
        tl.store(out + 1 + j, tl.zeros([2 * NP], tl.int32), mask=j < 2 * N)
        tl.store(out, 0)


def logprob_block(logits: torch.Tensor, tok: torch.Tensor, n: int, vocab: int, block: int = LP_BLOCK,
                  out: torch.Tensor | None = None,
                  wants: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``sampling.logprob_block`` in two kernels: for logits ``[R, >= vocab]`` (rows with
    unit stride) and a token per row, int32 ``[R, 1 + 2 n]``: the token's log_softmax over the
    first ``vocab`` columns, the ``n`` largest (descending; equal logits by ascending id) as
    float32 bits, then their ids. ``block``: columns a program (tests use small ones); ``out``:
    where to write them (int32 ``[R, 1 + 2 n]``, rows of unit stride: a completion record's
    columns). ``wants``: (the rows' slots ``[R]``, a flag per slot): a row whose slot's flag is 0
    reads no logit and gets zeros (``sampling.logprob_block``'s ``wants``)."""
    if logits.stride(-1) != 1:
        raise ValueError("logprob_block needs rows with unit stride")
    if not 0 < n <= vocab:
        raise ValueError(f"logprob_block keeps 1..{vocab} values, not {n}")
    R = logits.shape[0]
    nb = triton.cdiv(vocab, block)
    np_ = triton.next_power_of_2(n)
    dev = logits.device
    m = torch.empty((R, nb), dtype=torch.float32, device=dev)
    s = torch.empty((R, nb), dtype=torch.float32, device=dev)
    keys = torch.empty((R, nb, np_), dtype=torch.uint64, device=dev)
    if out is None:
        out = torch.empty((R, 1 + 2 * n), dtype=torch.int32, device=dev)
    elif out.shape != (R, 1 + 2 * n) or out.dtype != torch.int32 or out.stride(1) != 1:
        raise ValueError(f"logprob_block's out {tuple(out.shape)} {out.dtype}: expected int32 [{R}, {1 + 2 * n}]")
    slots, on = wants if wants is not None else (m, m)  # (unread without a gate)
    if wants is not None and (slots.shape != (R,) or on.dim() != 1):
        raise ValueError(f"logprob_block's wants: {R} slots and a flag per slot, got {tuple(slots.shape)}, "
                         f"{tuple(on.shape)}")
    slots, on = slots.contiguous(), on.contiguous()
    _logprob_part_kernel[(R, nb)](logits, logits.stride(0), vocab, nb, m, s, keys, slots, on, N=n, NP=np_,
                                  BLOCK=block, GATED=wants is not None, num_warps=8 if block >= 2048 else 4)
    _logprob_merge_kernel[(R,)](logits, logits.stride(0), vocab, nb, m, s, keys, tok.contiguous(), out, out.stride(0),
                                slots, on, N=n, NP=np_, NBP=triton.next_power_of_2(nb), GATED=wants is not None,
                                num_warps=4)
    return out


# -- the commit of a sampled token ------------------------------------------------------------
#
# ``programs._sample_and_commit``'s state writes in tensor operations: the row's slot state read,
# its pending token, generated count, counter and done flag written back with four index_copy
# kernels, the histogram with an index_add, the completion record stacked and copied: about ten
# kernels of a decode step's tail (bench/timeline.py), for a few integers a row. Here one program
# a row reads its slot's state and writes it back with the record: the same values (integer
# arithmetic). A row that is not live writes back what it read and counts nothing in the
# histogram, as the tensor form; padding rows name the null slot, whose state nobody reads.


@triton.jit
def _commit_kernel(slots_ptr, live_ptr, tok_ptr, pending_ptr, generated_ptr, counter_ptr, done_ptr, hist_ptr,
                   stop_ptr, max_new_ptr, rec_ptr, NS, stride_hist, stride_stop, stride_rec,
                   NS_PAD: tl.constexpr, RUNNING: tl.constexpr, STOP: tl.constexpr, LENGTH: tl.constexpr,
                   INACTIVE: tl.constexpr):
    b = tl.program_id(0)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    live = tl.load(live_ptr + b) != 0
    tok = tl.load(tok_ptr + b).to(tl.int64)
    li = live.to(tl.int64)
    generated = tl.load(generated_ptr + slot).to(tl.int64) + li
    j = tl.arange(0, NS_PAD)
    stops = tl.load(stop_ptr + slot * stride_stop + j, mask=j < NS, other=-1).to(tl.int64)
    stop_hit = tl.max((stops == tok).to(tl.int32), 0) > 0
    max_new = tl.load(max_new_ptr + slot).to(tl.int64)
    status = tl.where(stop_hit, STOP, tl.where(generated >= max_new, LENGTH, RUNNING)).to(tl.int64)
    pending = tl.where(live, tok, tl.load(pending_ptr + slot).to(tl.int64))
    done = tl.where(live, status, tl.load(done_ptr + slot).to(tl.int64))
    counter = tl.load(counter_ptr + slot) + li.to(counter_ptr.dtype.element_ty)
    tl.store(pending_ptr + slot, pending.to(pending_ptr.dtype.element_ty))
    tl.store(generated_ptr + slot, generated.to(generated_ptr.dtype.element_ty))
    tl.store(counter_ptr + slot, counter)
    tl.store(done_ptr + slot, done.to(done_ptr.dtype.element_ty))
    if live:  # (live rows hold distinct slots: no two programs count into one entry)
        at = hist_ptr + slot * stride_hist + tok
        tl.store(at, tl.load(at) + 1)
    rec = rec_ptr + b.to(tl.int64) * stride_rec
    dtype = rec_ptr.dtype.element_ty
    tl.store(rec, slot.to(dtype))
    tl.store(rec + 1, tl.where(live, tok, -1).to(dtype))
    tl.store(rec + 2, generated.to(dtype))
    tl.store(rec + 3, tl.where(live, status, INACTIVE).to(dtype))


def commit_rows(state: dict[str, torch.Tensor], slots: torch.Tensor, live: torch.Tensor, tok: torch.Tensor,
                record: torch.Tensor) -> None:
    """``programs._sample_and_commit``'s commit in one launch: for row b of ``slots`` (int64
    ``[B]``), ``live`` (bool) and the sampled ``tok`` (int64), slot state ``state`` (the core's
    views: ``state.pending``, ``.generated``, ``.counter``, ``.done``, ``.hist``, ``.stop_ids``,
    ``.max_new``) takes the token where the row is live, and ``record`` (``[B, >= 4]`` int32, rows of
    unit stride) the completion record (slot, token or -1, generated, status or inactive)."""
    from flare.core.interface import Status

    B = slots.shape[0]
    hist, stops = state["state.hist"], state["state.stop_ids"]
    if record.shape[0] != B or record.shape[1] < 4 or record.stride(1) != 1 or hist.stride(1) != 1 \
            or stops.stride(1) != 1:
        raise ValueError(f"commit_rows: record {tuple(record.shape)} for {B} rows, rows of unit stride")
    slots, live, tok = slots.contiguous(), live.contiguous(), tok.contiguous()  # (rows of unit stride)
    if B:
        _commit_kernel[(B,)](
            slots, live.view(torch.uint8), tok, state["state.pending"], state["state.generated"],
            state["state.counter"], state["state.done"], hist, stops, state["state.max_new"], record,
            stops.shape[1], hist.stride(0), stops.stride(0), record.stride(0),
            NS_PAD=triton.next_power_of_2(max(stops.shape[1], 1)), RUNNING=int(Status.running),
            STOP=int(Status.stop), LENGTH=int(Status.length), INACTIVE=int(Status.inactive), num_warps=1)


@triton.jit
def _commit_hidden_kernel(slots_ptr, live_ptr, hidden_ptr, state_ptr, len_ptr, H, stride_h, stride_s,
                          BLOCK: tl.constexpr):
    b = tl.program_id(0)
    if tl.load(live_ptr + b) != 0:
        slot = tl.load(slots_ptr + b).to(tl.int64)
        for h0 in range(0, H, BLOCK):
            h = h0 + tl.arange(0, BLOCK)
            row = tl.load(hidden_ptr + b.to(tl.int64) * stride_h + h, mask=h < H)
            tl.store(state_ptr + slot * stride_s + h, row.to(state_ptr.dtype.element_ty), mask=h < H)
        tl.store(len_ptr + slot, tl.load(len_ptr + slot) + 1)


def commit_hidden(state: dict[str, torch.Tensor], slots: torch.Tensor, live: torch.Tensor,
                  hidden: torch.Tensor) -> None:
    """A decode step's commit before its head in one launch: a live row's slot keeps the row's
    final hidden vector (``state.hidden``) and its length grows by one (``state.len``); the other
    rows write nothing (the tensor form writes back what it read: six kernels)."""
    buf = state["state.hidden"]
    B, H = hidden.shape
    if buf.shape[1] != H or hidden.stride(1) != 1 or buf.stride(1) != 1:
        raise ValueError(f"commit_hidden: rows of {H} into state.hidden {tuple(buf.shape)}, unit stride")
    slots, live = slots.contiguous(), live.contiguous()  # (rows of unit stride)
    if B:
        _commit_hidden_kernel[(B,)](slots, live.view(torch.uint8), hidden, buf, state["state.len"], H,
                                    hidden.stride(0), buf.stride(0), BLOCK=min(4096, triton.next_power_of_2(H)),
                                    num_warps=4)
