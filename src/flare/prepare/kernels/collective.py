"""Capture-safe one-shot collectives between the ranks of one host (CUDA TP).

Every rank's arena sits at its own fixed address and has the same layout, so a
buffer of rank ``s`` is rank ``r``'s buffer plus ``base_s - base_r``. Inside one
runtime process every rank's arena is mapped (peer-mapped across GPUs), so a
kernel on rank ``r`` loads a peer's buffer through that fixed address: a graph
holds only kernel nodes with fixed pointers, nothing rank-specific to patch.

Protocol, per program ``b`` of a fixed grid of ``BLOCKS`` programs (the same on
every rank, so program ``b`` of every rank covers the same elements):

1. ``e = flags[b] + 1`` (only this rank writes its own ``flags``); the payload
   slice goes into this rank's exchange slot ``e % 2``;
2. ``flags[b] = e`` with release semantics at system scope (after a CTA barrier);
3. wait until every peer's ``flags[b]`` is ``e`` or ``e + 1`` (acquire; a peer can
   be at most one collective ahead: it cannot pass its next barrier without us);
4. combine every rank's slot ``e % 2`` in rank order (so every rank computes the
   same bits) into the output.

Double buffering makes a second barrier unnecessary: a peer writes slot
``e % 2`` again only at ``e + 2``, after it has seen our flag ``e + 1``, which we
publish only after finishing ``e``'s reads (kernels on a stream run in order).
A peer that never arrives makes the waiting program trap after ``SPIN`` polls
(tens of seconds): the launch fails with a device error instead of combining
stale data or hanging, and the executor reports it. Every rank's kernel must be
loaded before a collective starts (module loads can wait for running kernels):
preparation's loopback warmups and the runtime's startup load them.

Modes: ``SUM`` (all-reduce, float32 accumulation in rank order, in place allowed),
``GATHER`` (concatenate ``[rows, cols]`` parts along the last dimension),
``FROM_ZERO`` (rank 0's values everywhere, in place allowed).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flare.prepare.parallel import FROM_ZERO, GATHER, SUM  # noqa: F401 (the modes, re-exported)

BLOCKS = 32  # programs per collective (and flag words per rank); small, so peers always co-reside
BLOCK = 2048
SPIN = 1 << 26  # polls of a peer's flag before the launch traps (tens of seconds)
MAX_RANKS = 8


@triton.jit
def _collective_kernel(x_ptr, out_ptr, exch_ptr, flags_ptr, peers_ptr, n, cols, slot_elems,
                       RANK: tl.constexpr, SIZE: tl.constexpr, MODE: tl.constexpr, NPROG: tl.constexpr,
                       BLOCK: tl.constexpr, SPIN: tl.constexpr):
    ITEM: tl.constexpr = x_ptr.dtype.element_ty.primitive_bitwidth // 8
    pid = tl.program_id(0)
    own_flag = flags_ptr + pid
    e = tl.load(own_flag, volatile=True) + 1
    slot = (e & 1).to(tl.int64) * slot_elems
    step = NPROG * BLOCK
    lanes = tl.arange(0, BLOCK)
    for start in range(pid * BLOCK, n, step):
        offs = start + lanes
        m = offs < n
        tl.store(exch_ptr + slot + offs, tl.load(x_ptr + offs, mask=m), mask=m)
    tl.debug_barrier()
    tl.atomic_xchg(own_flag, e, sem="release", scope="sys")
    for s in tl.static_range(SIZE):
        if s != RANK:
            peer_flag = own_flag + tl.load(peers_ptr + s) // 4
            seen = tl.atomic_add(peer_flag, 0, sem="acquire", scope="sys")
            spins = 0
            while ((seen - e) < 0) & (spins < SPIN):
                seen = tl.atomic_add(peer_flag, 0, sem="acquire", scope="sys")
                spins += 1
            if spins >= SPIN:  # the peer never came: fail the launch rather than combine stale data
                tl.inline_asm_elementwise("trap;", "=r,r", [spins], dtype=tl.int32, is_pure=False, pack=1)
    tl.debug_barrier()
    for start in range(pid * BLOCK, n, step):
        offs = start + lanes
        m = offs < n
        if MODE == 0:
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for s in tl.static_range(SIZE):
                peer = exch_ptr + tl.load(peers_ptr + s) // ITEM + slot
                acc += tl.load(peer + offs, mask=m, volatile=True).to(tl.float32)
            tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=m)
        elif MODE == 1:
            row = offs // cols
            col = offs - row * cols
            for s in tl.static_range(SIZE):
                peer = exch_ptr + tl.load(peers_ptr + s) // ITEM + slot
                v = tl.load(peer + offs, mask=m, volatile=True)
                tl.store(out_ptr + row * (cols * SIZE) + s * cols + col, v, mask=m)
        else:
            peer = exch_ptr + tl.load(peers_ptr) // ITEM + slot
            tl.store(out_ptr + offs, tl.load(peer + offs, mask=m, volatile=True), mask=m)


def launch(mode: int, x: torch.Tensor, out: torch.Tensor, exchange: torch.Tensor, flags: torch.Tensor,
           peers: torch.Tensor, *, rank: int, size: int) -> None:
    """One collective over ``size`` ranks. ``x``/``out`` contiguous (``out`` may be ``x``
    except for GATHER); ``exchange``: this rank's uint8 exchange buffer (two slots);
    ``flags``: its int32 ``[BLOCKS]`` words; ``peers``: int64 ``[size]``, rank s's arena
    base minus this rank's in bytes (all zeros: every peer is this rank, a loopback
    that completes alone)."""
    if not (x.is_contiguous() and out.is_contiguous()):
        raise ValueError("collective operands must be contiguous")
    if not 1 < size <= MAX_RANKS or not 0 <= rank < size or peers.numel() != size or peers.dtype != torch.int64:
        raise ValueError(f"bad rank set: rank {rank} of {size}, peers {tuple(peers.shape)} {peers.dtype}")
    if mode == GATHER and (out.numel() != x.numel() * size or out.shape[-1] != x.shape[-1] * size):
        raise ValueError(f"gather of {tuple(x.shape)} over {size} ranks into {tuple(out.shape)}")
    if mode != GATHER and out.shape != x.shape:
        raise ValueError(f"collective output {tuple(out.shape)} does not match its input {tuple(x.shape)}")
    if flags.dtype != torch.int32 or flags.numel() < BLOCKS:
        raise ValueError(f"flags must be int32 with at least {BLOCKS} words")
    item = x.element_size()
    slot_bytes = exchange.numel() // 2 // 16 * 16
    if x.numel() * item > slot_bytes:
        raise ValueError(f"collective payload of {x.numel() * item} bytes exceeds the exchange slot ({slot_bytes})")
    if x.numel() == 0:
        return
    cols = x.shape[-1] if mode == GATHER else 1
    exch = exchange[: 2 * slot_bytes].view(x.dtype)
    _collective_kernel[(BLOCKS,)](
        x, out, exch, flags, peers, x.numel(), cols, slot_bytes // item,
        RANK=rank, SIZE=size, MODE=mode, NPROG=BLOCKS, BLOCK=BLOCK, SPIN=SPIN, num_warps=4,
    )
