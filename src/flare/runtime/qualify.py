"""Replay qualification: the same programs on the same inputs, in two processes.

Preparation replays every captured graph in-process (torch) on a few input
sets and records a digest of every runtime-owned buffer afterwards; a fresh
torch-free process loads the exported core, applies the same inputs through
its executor and must reproduce every digest bit for bit.

Input sets are generated here, torch-free and deterministic, from the
manifest alone: a base state where every slot holds a plausible running
request (valid page tables, lengths, sampling parameters, random KV), then
per-program inputs (slots, chunk sizes, sample flags, decode batches) drawn
from a seeded generator.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable

import numpy as np

from flare.core import interface as io
from flare.core.manifest import BufferRole, DType, Manifest, ProgramKind
from flare.core.sampling_params import BY_NAME, INTEGER_STATE, SAMPLING_COLUMNS
from flare.runtime.executor import NUMPY_DTYPES

RUNTIME_ROLES = (BufferRole.kv, BufferRole.state, BufferRole.snapshot, BufferRole.input, BufferRole.output)


def runtime_buffers(m: Manifest) -> list:
    return [b for b in m.buffers if b.role in RUNTIME_ROLES]


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    return (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


def _fill(b, rng: np.random.Generator) -> np.ndarray:
    """Random but finite contents for an opaque runtime buffer (KV, hidden rows)."""
    n = b.numel
    if b.dtype == DType.bfloat16:
        return _bf16_bits(rng.standard_normal(n, dtype=np.float32) * 0.5).reshape(b.shape)
    if b.dtype in (DType.float16, DType.float32):
        return (rng.standard_normal(n, dtype=np.float32) * 0.5).astype(NUMPY_DTYPES[b.dtype]).reshape(b.shape)
    return np.zeros(b.shape, NUMPY_DTYPES[b.dtype])


def _probe(rng: np.random.Generator, param, rows: int) -> np.ndarray:
    """One value per slot for a sampling parameter (the draws of ABI 4's golden inputs)."""
    if param.probe_range is not None:
        return rng.uniform(*param.probe_range, rows)
    return rng.choice(param.probes, rows)


@dataclass
class BaseState:
    buffers: dict[str, np.ndarray]
    per_slot_tokens: int  # every slot owns this many tokens of distinct pages


def base_state(m: Manifest, seed: int = 0) -> BaseState:
    rng = np.random.default_rng(seed)
    c = m.capacities
    rows = c.slots + 1
    state = {b.name: _fill(b, rng) for b in runtime_buffers(m)}
    usable = m.pages.num_pages - 1
    max_len = min(c.context_limit - 2, (usable // rows) * m.pages.page_size)
    lengths = rng.integers(1, max(2, max_len // 2), rows).astype(np.int32)
    lengths[0] = 0
    state["state.len"][:] = lengths
    state["state.pending"][:] = rng.integers(0, c.sampling_vocab, rows)
    state["state.generated"][:] = rng.integers(0, 8, rows)
    state["state.max_new"][:] = rng.integers(8, 4096, rows)
    state["state.done"][:] = 0
    state["state.seed"][:] = rng.integers(-(1 << 62), 1 << 62, rows)
    state["state.counter"][:] = rng.integers(0, 1000, rows)
    for name, buffer in INTEGER_STATE.items():
        state[buffer][:] = _probe(rng, BY_NAME[name], rows)
    state["state.sampling"][:] = np.stack([_probe(rng, BY_NAME[n], rows) for n in SAMPLING_COLUMNS], -1)
    stops = np.full((rows, c.stop_ids), -1, np.int32)
    stops[:, : len(m.frontend.eos_ids)] = m.frontend.eos_ids
    state["state.stop_ids"][:] = stops
    # Disjoint page sets per slot, shuffled so pages are not contiguous.
    pages = rng.permutation(np.arange(1, m.pages.num_pages, dtype=np.int32))
    per = min(c.max_pages_per_slot, usable // rows)
    table = np.zeros((rows, c.max_pages_per_slot), np.int32)
    for s in range(1, rows):
        table[s, :per] = pages[(s - 1) * per : s * per]
    state["state.page_table"][:] = table
    hist = np.zeros((rows, c.vocab_size), np.int32)
    for s in range(1, rows):
        idx = rng.integers(0, c.sampling_vocab, 64)
        hist[s, idx] = rng.integers(0, 3, 64) + (rng.integers(0, 2, 64) << 24)
    state["state.hist"][:] = hist
    # Grammar masks on about half the rows, each allowing a random half of the vocabulary:
    # the sampler's mask path is qualified with real bitmasks, not only switched off.
    state["state.mask_on"][:] = rng.integers(0, 2, rows)
    # Log-probability blocks asked for on about half the rows (zeros on the others; each input
    # set of a sampling program sets its own: input_writes).
    state[io.LOGPROBS_ON][:] = rng.integers(0, 2, rows)
    words = state["in.token_mask"]
    words[:] = rng.integers(0, 1 << 32, words.shape, dtype=np.uint64).astype(np.uint32).view(np.int32)
    state[io.TOKENS][:] = rng.integers(0, c.sampling_vocab, state[io.TOKENS].shape)
    for name in (io.PrefillInput.buffer, io.AdmitInput.buffer, io.DECODE_SLOTS, io.StateInput.buffer,
                 io.PACK_INPUT, io.VERIFY_INPUT, io.DRAFTS):
        if name in state:
            state[name][...] = 0
    for name in [n for n in state if n.startswith("out.")]:
        state[name][...] = 0
    return BaseState(state, per * m.pages.page_size)


def input_writes(m: Manifest, program: str, index: int, base_state: BaseState) -> dict[str, np.ndarray]:
    """Full-buffer values that override the base state for one input set."""
    p = m.program(program)
    c = m.capacities
    rng = np.random.default_rng(1000 + 97 * index + sum(map(ord, program)))
    base = base_state.buffers
    per_slot_tokens = base_state.per_slot_tokens
    out: dict[str, np.ndarray] = {}
    if p.kind == ProgramKind.admit:
        slot = int(rng.integers(1, c.slots + 1))
        out[io.AdmitInput.buffer] = io.pack(io.AdmitInput(slot, int(rng.integers(1, p.capacity + 1)),
                                                          int(rng.integers(0, 2)), int(rng.integers(0, 2))))
        out[io.TOKENS] = rng.integers(0, c.sampling_vocab, base[io.TOKENS].shape).astype(np.int32)
    elif p.kind in (ProgramKind.prefill, ProgramKind.score):
        slot = int(rng.integers(1, c.slots + 1))
        n = int(rng.integers(1, p.capacity + 1))
        n = min(n, per_slot_tokens - 1)
        start = int(rng.integers(0, max(1, per_slot_tokens - n)))
        lens = base["state.len"].copy()
        lens[slot] = start
        done = base["state.done"].copy()
        done[slot] = int(rng.integers(0, 2)) if index == 2 else 0
        out["state.len"] = lens
        out["state.done"] = done
        out[io.PrefillInput.buffer] = io.pack(io.PrefillInput(slot, n, int(index != 1)))
        out[io.TOKENS] = rng.integers(0, c.sampling_vocab, base[io.TOKENS].shape).astype(np.int32)
    elif p.kind == ProgramKind.resume:
        slot = int(rng.integers(1, c.slots + 1))
        out[io.PrefillInput.buffer] = io.pack(io.PrefillInput(slot, 0, int(index != 1)))
        if index == 2:  # a finished request: nothing may change but the record
            done = base["state.done"].copy()
            done[slot] = 1
            out["state.done"] = done
    elif p.kind in (ProgramKind.snapshot, ProgramKind.restore):
        # A live slot and a checkpoint row; the tail page is one of the slot's pages,
        # or the null page (a page-aligned endpoint) in every third set.
        slot = int(rng.integers(1, c.slots + 1))
        row = int(rng.integers(1, c.snapshot_rows + 1)) if c.snapshot_rows else 0
        count = int(rng.integers(1, per_slot_tokens))
        table = base["state.page_table"][slot]
        page = m.pages.null_page if index % 3 == 2 else int(table[count // m.pages.page_size])
        out[io.StateInput.buffer] = io.pack(io.StateInput(slot, row, page, count))
    elif p.kind == ProgramKind.pack:
        # Segments of distinct live slots, each continuing a history, filling part of the
        # capacity; one segment does not sample, and in the third set one slot is finished.
        rows = base[io.PACK_INPUT].shape[0]
        used = int(rng.integers(1, min(rows, c.slots, (p.capacity + 1) // 2) + 1))
        slots = rng.permutation(np.arange(1, c.slots + 1))[:used]
        # Segment i spans rows [cuts[2i], cuts[2i + 1]): ascending, non-empty, gaps between.
        cuts = np.sort(rng.choice(np.arange(p.capacity + 1), size=2 * used, replace=False))
        arr = np.zeros(base[io.PACK_INPUT].shape, np.int32)
        lens = base["state.len"].copy()
        for i, slot in enumerate(slots):
            first, n = int(cuts[2 * i]), int(min(cuts[2 * i + 1] - cuts[2 * i], per_slot_tokens - 2))
            arr[i] = io.pack(io.PackSegment(int(slot), n, int(i != 0 or index == 0), first))
            lens[slot] = int(rng.integers(0, max(1, per_slot_tokens - n)))
        out[io.PACK_INPUT] = arr
        out["state.len"] = lens
        if index == 2:
            done = base["state.done"].copy()
            done[slots[-1]] = 1
            out["state.done"] = done
        out[io.TOKENS] = rng.integers(0, c.sampling_vocab, base[io.TOKENS].shape).astype(np.int32)
    elif p.kind == ProgramKind.verify:
        # Live slots verifying 0..D random drafts each (mostly rejected, some accepted where the
        # distribution is wide); in the third set one slot is finished.
        D = c.draft_tokens
        live = int(rng.integers(1, p.capacity + 1))
        slots = rng.permutation(np.arange(1, c.slots + 1))[:live]
        arr = np.zeros(base[io.VERIFY_INPUT].shape, np.int32)
        for i, slot in enumerate(slots):
            arr[i] = io.pack(io.VerifyInput(int(slot), int(rng.integers(0, D + 1)), per_slot_tokens))
        out[io.VERIFY_INPUT] = arr
        out[io.DRAFTS] = rng.integers(0, c.sampling_vocab, base[io.DRAFTS].shape).astype(np.int32)
        lens = base["state.len"].copy()
        lens[slots] = rng.integers(1, max(2, per_slot_tokens - D - 1), live)
        out["state.len"] = lens
        if index == 2:
            done = base["state.done"].copy()
            done[slots[0]] = 1
            out["state.done"] = done
    elif p.kind == ProgramKind.decode:
        live = int(rng.integers(1, p.capacity + 1))
        slots = rng.permutation(np.arange(1, c.slots + 1))[:live]
        arr = np.zeros(base[io.DECODE_SLOTS].shape, np.int32)
        arr[:live] = slots
        out[io.DECODE_SLOTS] = arr
        lens = base["state.len"].copy()
        lens[slots] = rng.integers(1, per_slot_tokens - 1, live)
        out["state.len"] = lens
        if index == 2:  # one finished request inside the batch: it must not change
            done = base["state.done"].copy()
            done[slots[0]] = 1
            out["state.done"] = done
    if p.kind not in (ProgramKind.admit, ProgramKind.snapshot, ProgramKind.restore) and io.LOGPROBS_ON in base:
        # The log-probability flags of a sampling program's set: every slot asks in the first
        # (whose rows sample and are live), a random half in the second, none in the third, so
        # the golden replays cover the blocks computed and skipped whatever slots a set picks.
        on = np.zeros_like(base[io.LOGPROBS_ON])
        on[1:] = 1 if index == 0 else rng.integers(0, 2, len(on) - 1) if index == 1 else 0
        out[io.LOGPROBS_ON] = on
    return out


def digests(m: Manifest, read: Callable[[str], bytes]) -> dict[str, str]:
    return {b.name: hashlib.sha256(read(b.name)).hexdigest()[:32] for b in runtime_buffers(m)}
