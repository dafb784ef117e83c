"""Page and slot ownership, and the scheduler driven without an executor.

The scheduler runs against ``FakeDevice``: numpy arrays shaped like the core's
runtime buffers, the scheduler's ``Write``s applied to them exactly as the
reference executor applies them, and prefill/decode/admit semantics of
``flare.prepare.programs`` re-enacted on those arrays (lengths, pending token,
generated count, counter, stop ids, penalty histogram, completion records with
columns slot, token, generated, status). Tokens come from ``token_fn(seed,
counter)``, the same dependency the real sampler has, so a request's stream is
known in advance. The fake also checks every KV position a program would write
lies in a page the request owns: a page-growth bug fails here, not silently.

It also models what the prefix cache must preserve. KV contents are token ids
(``kv[page, offset]``), and each slot's continuation state is the tuple of
tokens it has consumed (standing for the hidden vector and recurrent state).
``snapshot`` / ``restore`` copy that tuple and the tail page between slots and
snapshot rows exactly as the real programs copy rows. Before every prefill or
decode the fake checks that the slot's state is exactly the request's consumed
history and that its page table maps every consumed position to the token
consumed there; writes into a page anybody else references (a shared,
immutable page) fail.

Page ids in the expectations are derived by hand from the policy in
``flare.runtime.scheduler`` (reservation = pages for min(history + one page,
prompt + max_tokens); growth keeps one page ahead; FIFO free list).
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np
import pytest

from flare.core import interface as io
from flare.core.errors import AdmissionError, FrontendError, ModelOutputError
from flare.core.manifest import HIST_PROMPT_BIT, Manifest, ProgramKind, load_manifest, \
    runtime_buffer_shapes
from flare.runtime.pages import PagePool, PoolExhausted, SlotPool
from flare.runtime.request import FinishReason, Request, SamplingParams, Status
from flare.runtime.scheduler import Scheduler, Step, derive_seed

PS = 16  # page size of the test cores


# ---------------------------------------------------------------------------
# PagePool / SlotPool


def test_page_pool_ids_are_fifo_and_skip_the_null_page():
    pool = PagePool(8)
    assert (pool.total, pool.free, pool.used) == (7, 7, 0)
    assert pool.allocate(3) == [1, 2, 3]
    assert pool.allocate(2) == [4, 5]
    pool.check_integrity()
    pool.release([4, 2])
    # Oldest free pages first, then released pages in release order.
    assert pool.allocate(4) == [6, 7, 4, 2]
    assert (pool.free, pool.used) == (0, 7)
    assert not pool.can_allocate(1)
    with pytest.raises(PoolExhausted):
        pool.allocate(1)
    assert pool.free == 0  # a failed allocation takes nothing
    pool.check_integrity()


def test_page_pool_nonzero_null_page():
    pool = PagePool(4, null_page=2)
    assert pool.allocate(3) == [0, 1, 3]
    pool.check_integrity()


def test_page_pool_refcounts():
    pool = PagePool(6)
    a = pool.allocate(2)
    assert [pool.refcount(p) for p in range(6)] == [0, 1, 1, 0, 0, 0]
    pool.retain([1])
    pool.retain([1])
    assert pool.refcount(1) == 3
    pool.release([1, 2])
    assert (pool.refcount(1), pool.refcount(2), pool.free) == (2, 0, 4)
    pool.release([1])
    pool.release([1])
    assert pool.refcount(1) == 0 and pool.free == 5
    # Free list order: 3, 4, 5 (never allocated), then 2, then 1.
    assert pool.allocate(5) == [3, 4, 5, 2, 1]
    pool.check_integrity()
    assert a == [1, 2]


def test_page_pool_errors():
    pool = PagePool(4)
    with pytest.raises(ValueError, match="null page and at least one"):
        PagePool(1)
    pages = pool.allocate(2)
    pool.release(pages)
    with pytest.raises(ValueError, match="release of free page 1"):
        pool.release([1])
    with pytest.raises(ValueError, match="release of free page 3"):
        pool.release([3])  # never allocated
    with pytest.raises(ValueError, match="retain of free page 2"):
        pool.retain([2])
    with pytest.raises(ValueError, match="release of free page 0"):
        pool.release([0])  # the null page is never owned
    pool.check_integrity()


def test_page_pool_integrity_detects_corruption():
    pool = PagePool(4)
    pool.allocate(1)
    pool._free.append(1)  # a used page on the free list
    with pytest.raises(AssertionError, match="page 1: refcount 1 disagrees"):
        pool.check_integrity()
    pool = PagePool(4)
    pool._free.append(2)
    with pytest.raises(AssertionError, match="free list twice"):
        pool.check_integrity()
    pool = PagePool(4)
    pool._free.append(0)
    with pytest.raises(AssertionError, match="null page"):
        pool.check_integrity()


def test_slot_pool():
    slots = SlotPool(3)
    assert [slots.allocate() for _ in range(3)] == [1, 2, 3]
    with pytest.raises(PoolExhausted):
        slots.allocate()
    slots.release(2)
    slots.release(1)
    with pytest.raises(ValueError, match="release of free slot 2"):
        slots.release(2)
    with pytest.raises(ValueError, match="release of free slot 0"):
        slots.release(0)
    slots.check_integrity()
    assert slots.free == 2
    assert [slots.allocate(), slots.allocate()] == [2, 1]
    slots.check_integrity()
    slots._used.add(0)
    with pytest.raises(AssertionError):
        slots.check_integrity()


# ---------------------------------------------------------------------------
# The fake device


def token_fn(seed: int, counter: int) -> int:
    """Stands in for the sampler: a token from (seed, counter) only. Never an EOS id."""
    return 1000 + (seed * 7919 + counter * 104729) % 40000


class Sink:
    def __init__(self, stop_on: int | None = None):
        self.visible: list[int] = []
        self.finished = 0
        self.stop_on = stop_on  # pretend a stop string matched when this token arrives

    def on_tokens(self, request, ids):
        self.visible.extend(ids)
        return self.stop_on in ids

    def on_finish(self, request):
        self.finished += 1


class FakeDevice:
    def __init__(self, m: Manifest, pool: PagePool | None = None):
        self.m = m
        self.caps = m.capacities
        self.pool = pool
        self.a = {name: np.zeros(shape, np.dtype(dt.value)) for name, (_, dt, shape) in
                  runtime_buffer_shapes(self.caps).items()}
        self.kv = np.full((m.pages.num_pages, PS), -1, np.int64)
        self.state: dict[int, tuple[int, ...]] = {}  # slot -> consumed tokens (continuation)
        self.snap: dict[int, tuple[int, ...]] = {}  # snapshot row -> consumed tokens
        self.snap_tail: dict[int, np.ndarray] = {}
        self.log: list[tuple[str, list[str]]] = []

    def apply(self, w) -> None:  # as ReferenceExecutor._apply
        view = self.a[w.buffer]
        if w.row is None:
            flat = np.asarray(w.value, dtype=view.dtype).reshape(-1)
            view.reshape(-1)[: flat.size] = flat
        else:
            view[w.row] = w.value

    def run(self, step: Step) -> np.ndarray | None:
        for w in step.writes:
            self.apply(w)
        self.log.append((step.program, [r.id for r in step.requests]))
        if step.kind == ProgramKind.admit:
            slot, count, clear, mode = io.unpack(io.AdmitInput, self.a[io.AdmitInput.buffer])
            toks = self.a[io.TOKENS][:count]
            if clear:
                self.a["state.hist"][slot] = 0
                self.state[slot] = ()
            if mode == io.AdmitMode.prompt:
                self.a["state.hist"][slot, np.unique(toks)] |= HIST_PROMPT_BIT
            else:
                np.add.at(self.a["state.hist"][slot], toks, 1)
            return None
        if step.kind in (ProgramKind.snapshot, ProgramKind.restore):
            slot, row, page, count = io.unpack(io.StateInput, self.a[io.StateInput.buffer])
            assert row != 0 and slot != 0
            if step.kind == ProgramKind.snapshot:
                self.snap[row] = self.state[slot]
                self.snap_tail[row] = self.kv[page].copy()
                consumed = int(self.a["state.len"][slot])
            else:
                assert len(self.snap[row]) == count
                if page != self.m.pages.null_page:
                    self._check_private(step.requests[0], page)
                self.state[slot] = self.snap[row]
                self.kv[page] = self.snap_tail[row]
                self.a["state.len"][slot] = consumed = count
            return io.pack(io.StateCompletion(slot, row, consumed))[None]
        if step.kind == ProgramKind.resume:
            slot, n, sample, _ = io.unpack(io.PrefillInput, self.a[io.PrefillInput.buffer])
            req = step.requests[0]
            self._check_history(req, slot)
            live = np.array([sample != 0 and self.a["state.done"][slot] == 0])
            return self._sample_and_commit(np.array([slot]), live)
        if step.kind == ProgramKind.prefill:
            slot, n, sample, _ = io.unpack(io.PrefillInput, self.a[io.PrefillInput.buffer])
            self._prefill(step.requests[0], slot, self.a[io.TOKENS][:n])
            live = np.array([sample != 0 and self.a["state.done"][slot] == 0])
            return self._sample_and_commit(np.array([slot]), live)
        if step.kind == ProgramKind.pack:  # segments in order, then unused rows (count 0)
            capacity = step_capacity(step)
            segments = [io.unpack(io.PackSegment, row) for row in self.a[io.PACK_INPUT][:capacity]]
            used = [seg for seg in segments if seg.count]
            assert all(seg.count == 0 for seg in segments[len(used):]) and len(used) == len(step.requests)
            ends = [seg.row + seg.count for seg in used]
            assert all(e <= nxt.row for e, nxt in zip(ends, used[1:])) and ends[-1] <= capacity
            for req, seg, (_, _, decoding) in zip(step.requests, used, step.segments):
                tokens = self.a[io.TOKENS][seg.row : seg.row + seg.count]
                if decoding:  # a decode row: the pending token, written by the host
                    assert seg.count == 1 and tokens[0] == self.a["state.pending"][seg.slot]
                    self._decode_row(req, seg.slot)
                else:
                    self._prefill(req, seg.slot, tokens)
            slots = np.array([seg.slot for seg in segments])
            live = np.array([seg.count > 0 and seg.sample != 0 and self.a["state.done"][seg.slot] == 0
                             for seg in segments])
            return self._sample_and_commit(slots, live)
        slots = self.a[io.DECODE_SLOTS][: step_capacity(step)].astype(np.int64)
        live = (slots > 0) & (self.a["state.done"][slots] == 0)
        for i, s in enumerate(slots):
            if live[i]:
                self._decode_row(next(r for r in step.requests if r.slot == s), int(s))
        return self._sample_and_commit(slots, live)

    def _decode_row(self, req: Request, slot: int) -> None:
        """The slot consumes its pending token."""
        self._check_history(req, slot)
        pending = int(self.a["state.pending"][slot])
        self._write_kv(req, slot, int(self.a["state.len"][slot]), pending)
        self.state[slot] += (pending,)
        self.a["state.len"][slot] += 1

    def _prefill(self, req: Request, slot: int, tokens: np.ndarray) -> None:
        """A chunk of the request's history continues its slot: KV, state and length."""
        assert slot == req.slot
        start, n = int(self.a["state.len"][slot]), len(tokens)
        assert list(tokens) == req.target[start : start + n]
        self._check_history(req, slot)
        for pos in range(start, start + n):
            self._write_kv(req, slot, pos, req.target[pos])
        self.state[slot] += tuple(req.target[start : start + n])
        self.a["state.len"][slot] = start + n

    def _check_history(self, req: Request, slot: int) -> None:
        """The slot holds exactly the request's consumed history, state and KV alike."""
        n = int(self.a["state.len"][slot])
        history = tuple((req.prompt + req.output)[:n])
        assert self.state[slot] == history, f"{req}: continuation state is not its history"
        table = self.a["state.page_table"][slot]
        kv = [int(self.kv[table[p // PS], p % PS]) for p in range(n)]
        assert tuple(kv) == history, f"{req}: KV pages do not hold its history"

    def _check_private(self, req: Request, page: int) -> None:
        if self.pool is not None:
            assert self.pool.refcount(page) == 1, f"{req} writes shared page {page}"

    def _write_kv(self, req: Request, slot: int, pos: int, token: int) -> None:
        page = int(self.a["state.page_table"][slot, pos // PS])
        assert page != 0 and page in req.pages, f"{req} writes position {pos} into page {page} ({req.pages})"
        self._check_private(req, page)
        self.kv[page, pos % PS] = token

    def _sample_and_commit(self, slots: np.ndarray, live: np.ndarray) -> np.ndarray:
        a = self.a
        rec = np.zeros((len(slots), len(io.Completion._fields)), np.int32)
        for i, s in enumerate(slots):
            gen = int(a["state.generated"][s])
            if not live[i]:
                rec[i] = io.pack(io.Completion(s, -1, gen, io.Status.inactive))
                continue
            tok = token_fn(int(a["state.seed"][s]), int(a["state.counter"][s]))
            if a["state.mask_on"][s]:  # as the sampler: only allowed tokens, chosen by the same draw
                allowed = allowed_tokens(a["in.token_mask"][s])
                tok = allowed[tok % len(allowed)]
            gen += 1
            status = (io.Status.stop if tok in a["state.stop_ids"][s]
                      else io.Status.length if gen >= a["state.max_new"][s] else io.Status.running)
            a["state.pending"][s] = tok
            a["state.generated"][s] = gen
            a["state.counter"][s] += 1
            a["state.done"][s] = status
            a["state.hist"][s, tok] += 1
            rec[i] = io.pack(io.Completion(s, tok, gen, status))
        return rec


def allowed_tokens(words: np.ndarray) -> list[int]:
    bits = (words[:, None].astype(np.int64) >> np.arange(32)) & 1
    return [int(t) for t in np.flatnonzero(bits.reshape(-1))]


def step_capacity(step: Step) -> int:
    return int(step.program.split(".")[1])


def small_manifest(core: Path, *, num_pages: int, slots: int, snapshot_rows: int = 0) -> Manifest:
    """The core's manifest with a smaller pool; ``snapshot_rows`` 0 (the default here)
    leaves the prefix cache off, so these tests see the scheduler alone."""
    m = load_manifest(core)
    decode_caps = tuple(c for c in m.capacities.decode_capacities if c <= slots)
    assert decode_caps[-1] == slots  # cores always have slots == largest decode capacity
    caps = msgspec.structs.replace(m.capacities, slots=slots, decode_capacities=decode_caps,
                                   snapshot_rows=snapshot_rows)
    programs = tuple(p for p in m.programs if p.kind != ProgramKind.decode or p.capacity in decode_caps)
    return msgspec.structs.replace(m, capacities=caps, programs=programs,
                                   pages=msgspec.structs.replace(m.pages, num_pages=num_pages))


def params(seed: int, max_tokens: int, **kw) -> SamplingParams:
    base = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0,
                frequency_penalty=0.0, seed=seed, max_tokens=max_tokens)
    return SamplingParams(**{**base, **kw})


def make_request(name: str, prompt_len: int, max_tokens: int, seed: int, sink=None, **kw) -> Request:
    prompt = [100 + (7 * i + seed) % 500 for i in range(prompt_len)]
    return Request(prompt, params(seed, max_tokens, **kw), sink or Sink(), request_id=name)


class Driver:
    """Runs the scheduler against the fake device, checking invariants after every step
    and logging every change of a request's page list as (consumed, pages)."""

    def __init__(self, m: Manifest, *, prefix_cache: bool = True, prefill_while_decoding: int = 0):
        self.sched = Scheduler(m, prefix_cache=prefix_cache, prefill_while_decoding=prefill_while_decoding)
        self.dev = FakeDevice(m, self.sched.pages)
        self.pages: dict[str, list[tuple[int, tuple[int, ...]]]] = {}
        self.known: list[Request] = []
        self.steps: list[Step] = []

    def add(self, *reqs: Request) -> None:
        for r in reqs:
            self.sched.add(r)
            self.known.append(r)
            self.pages[r.id] = []

    def _note_pages(self) -> None:
        for r in self.known:
            log = self.pages[r.id]
            cur = tuple(r.pages)
            if (log[-1][1] if log else ()) != cur:
                log.append((r.consumed, cur))

    def step(self) -> Step | None:
        step = self.sched.schedule()
        self._note_pages()
        self.sched.check_integrity()
        if step is None:
            return None
        self.steps.append(step)
        records = self.dev.run(step)
        self.sched.complete(step, records)
        self._note_pages()
        self.sched.check_integrity()
        if step.kind != ProgramKind.admit:
            for r in step.requests:
                if r.slot is not None:
                    assert int(self.dev.a["state.len"][r.slot]) == r.consumed
                    assert int(self.dev.a["state.generated"][r.slot]) == len(r.output)
        return step

    def run(self, until=None, limit: int = 10_000) -> None:
        for _ in range(limit):
            if until is not None and until():
                return
            if self.step() is None:
                return
        raise AssertionError("scheduler did not settle")


# ---------------------------------------------------------------------------
# Scheduler


def test_single_request_reservation_growth_and_length_finish(tiny_core):
    d = Driver(small_manifest(tiny_core, num_pages=12, slots=2))
    a = make_request("A", 20, 40, seed=1)
    d.add(a)
    first = d.step()
    assert first.kind == ProgramKind.admit and first.program == "admit.128"
    # Reservation: min(20 + 16, 20 + 40) = 36 tokens -> 3 pages.
    assert (a.slot, a.pages, a.status) == (1, [1, 2, 3], Status.PREFILLING)
    w = {x.buffer: x for x in first.writes}
    assert list(w["state.page_table"].value[:4]) == [1, 2, 3, 0] and w["state.page_table"].row == 1
    assert list(w["state.stop_ids"].value[:2]) == [2, -1]  # the tiny core's EOS set, nothing else
    assert io.unpack(io.AdmitInput, w["in.admit"].value) == io.AdmitInput(1, 20, clear=1, mode=io.AdmitMode.prompt)
    assert list(w["in.tokens"].value) == a.prompt
    assert (int(w["state.seed"].value), int(w["state.max_new"].value)) == (1, 40)
    pre = d.step()
    assert (pre.program, pre.count, pre.sample) == ("prefill.128", 20, True)
    assert [io.unpack(io.PrefillInput, x.value) for x in pre.writes if x.buffer == "in.prefill"] == [
        io.PrefillInput(1, 20, sample=1)]
    d.run()
    # Growth one page ahead: at consumed 32 (the first token of page 3) page 4 is added,
    # and never more: prompt + max_tokens = 60 tokens fit in 4 pages.
    assert d.pages["A"] == [(0, (1, 2, 3)), (32, (1, 2, 3, 4)), (59, ())]
    assert a.finish_reason == FinishReason.length
    assert a.output == [token_fn(1, i) for i in range(40)]
    assert a.sink.visible == a.output and a.sink.finished == 1
    assert [s.program for s in d.steps] == ["admit.128", "prefill.128"] + ["decode.1"] * 39
    assert d.sched.pages.free == 11 and d.sched.slots.free == 2 and not d.sched.has_work()
    # Released pages go to the back of the free list, in the request's page order.
    assert list(d.sched.pages._free) == [5, 6, 7, 8, 9, 10, 11, 1, 2, 3, 4]


def test_preemption_of_newest_decoder_and_readmission(tiny_core):
    """11 usable pages, 2 slots. A (prompt 40, max 70) is 25 tokens ahead of B
    (prompt 16, max 100); both grow one page ahead until the pool is empty. When A
    needs the page for position 96 the newest decoder, B, is preempted; B is readmitted
    with target = prompt + output[:-1] once A finishes and frees its pages. B has a
    frequency penalty, so its admission rebuilds the histogram from prompt and output."""
    d = Driver(small_manifest(tiny_core, num_pages=12, slots=2))
    a = make_request("A", 40, 70, seed=11)
    b = make_request("B", 16, 100, seed=22, frequency_penalty=0.5)
    d.add(a, b)
    d.run(until=lambda: b.preemptions == 1)
    pre_step = d.steps[-1]
    assert pre_step.program == "decode.1" and pre_step.requests == [a]
    assert b.status == Status.WAITING and b.pages == [] and b.slot is None and list(d.sched.waiting) == [b]
    assert a.consumed == 97 and len(b.output) == 56
    assert b.target == b.prompt + b.output[:55]
    assert d.sched.preemptions_total == 1
    hist_b = d.dev.a["state.hist"][2].copy()  # B's slot row as B left it

    # Readmission (once A has finished): admit writes restore the whole state row, in slot 2.
    d.run(until=lambda: b.slot is not None)
    assert a.finished and b.slot == 2
    admit1, admit2 = d.steps[-1], d.step()
    reseeded = derive_seed(22, 56)
    w = {x.buffer: x.value for x in admit1.writes}
    assert int(w["state.generated"]) == 56 and int(w["state.pending"]) == token_fn(22, 55)
    assert int(w["state.seed"]) == reseeded and int(w["state.counter"]) == 0 and int(w["state.len"]) == 0
    # The prompt clears the row and sets prompt bits; the output adds counts.
    assert io.unpack(io.AdmitInput, w["in.admit"]) == io.AdmitInput(2, 16, clear=1, mode=io.AdmitMode.prompt)
    assert io.unpack(io.AdmitInput, {x.buffer: x.value for x in admit2.writes}["in.admit"]) == io.AdmitInput(
        2, 56, clear=0, mode=io.AdmitMode.output)
    # The penalty histogram rebuilt by the admit steps equals the one B had before.
    assert np.array_equal(d.dev.a["state.hist"][2], hist_b)
    assert int(hist_b.sum() & (HIST_PROMPT_BIT - 1)) > 0
    refill = d.step()
    assert refill.program == "prefill.128" and (refill.count, refill.sample) == (71, False)
    assert io.unpack(io.PrefillInput, {x.buffer: x.value for x in refill.writes}["in.prefill"]) == io.PrefillInput(
        2, 71, sample=0)
    assert b.output == [token_fn(22, i) for i in range(56)]  # the refill sampled nothing
    assert d.step().program == "decode.1"

    d.run()
    assert d.pages["A"] == [
        (0, (1, 2, 3, 4)),  # reservation: 40 + 16 tokens
        (48, (1, 2, 3, 4, 8)),
        (64, (1, 2, 3, 4, 8, 10)),
        (96, (1, 2, 3, 4, 8, 10, 5)),  # page 5 came from preempted B; 110 tokens need no 8th page
        (109, ()),
    ]
    assert d.pages["B"] == [
        (0, (5, 6)),
        (16, (5, 6, 7)),
        (32, (5, 6, 7, 9)),
        (48, (5, 6, 7, 9, 11)),
        (0, ()),  # preempted while at consumed 71: page 6 would be needed at position 80
        (0, (6, 7, 9, 11, 1, 2)),  # readmitted: 71 + 16 tokens -> 6 pages, FIFO from the free list
        (80, (6, 7, 9, 11, 1, 2, 3)),
        (96, (6, 7, 9, 11, 1, 2, 3, 4)),
        (115, ()),
    ]
    assert a.finish_reason == b.finish_reason == FinishReason.length
    assert a.output == [token_fn(11, i) for i in range(70)]
    # B keeps the 56 tokens it had (the last one pending at preemption) and continues
    # from a reseeded stream: nothing is lost, repeated, or re-drawn from the old stream.
    assert b.output == [token_fn(22, i) for i in range(56)] + [token_fn(reseeded, i) for i in range(44)]
    assert b.sink.visible == b.output and b.sink.finished == 1

    assert d.sched.pages.free == 11 and d.sched.slots.free == 2


def test_small_request_behind_blocked_large_request(tiny_core):
    d = Driver(small_manifest(tiny_core, num_pages=12, slots=4))
    a = make_request("A", 100, 10, seed=1)  # reserves min(116, 110) tokens: 7 pages
    big = make_request("L", 70, 10, seed=2)  # needs min(86, 80) tokens: 5 pages, 4 free
    small = make_request("S", 20, 10, seed=3)  # needs 2 pages
    d.add(a, big, small)
    d.step()
    assert a.pages == [1, 2, 3, 4, 5, 6, 7] and small.pages == [8, 9]
    assert (a.slot, small.slot) == (1, 2)
    assert big.status == Status.WAITING and list(d.sched.waiting) == [big]
    d.run(until=lambda: big.status != Status.WAITING)
    assert a.finish_reason == FinishReason.length and not small.finished
    # A's pages freed: L gets the oldest free pages first (10, 11 never used), slot 3.
    assert big.pages == [10, 11, 1, 2, 3] and big.slot == 3
    d.run()
    for r, seed in ((a, 1), (big, 2), (small, 3)):
        assert r.finish_reason == FinishReason.length
        assert r.output == [token_fn(seed, i) for i in range(10)]
    assert d.sched.pages.free == 11


def test_waits_for_a_free_slot(tiny_core):
    d = Driver(small_manifest(tiny_core, num_pages=64, slots=2))
    reqs = [make_request(f"R{i}", 5, 3, seed=i) for i in range(3)]
    d.add(*reqs)
    d.step()
    assert [r.slot for r in reqs] == [1, 2, None] and reqs[2].status == Status.WAITING
    d.run(until=lambda: reqs[2].slot is not None)
    assert reqs[2].slot == 1 and reqs[0].finished and not reqs[1].finished
    d.run()
    assert all(r.output == [token_fn(i, k) for k in range(3)] for i, r in enumerate(reqs))


def _long_prompt_behind_a_decoder(d: Driver, a_tokens: int) -> tuple[Request, Request]:
    """A (10 prompt tokens, ``a_tokens`` out) decoding when B (300 tokens, 3 out) arrives; run to the end."""
    a = make_request("A", 10, a_tokens, seed=5)
    d.add(a)
    d.run(until=lambda: a.status == Status.DECODING)
    b = make_request("B", 300, 3, seed=6)
    d.add(b)
    d.run()
    return a, b


def test_prefill_chunking_interleaved_with_decode(tiny_core):
    d = Driver(small_manifest(tiny_core, num_pages=64, slots=2))
    a, b = _long_prompt_behind_a_decoder(d, 8)
    trace = [(s.program, [r.id for r in s.requests], s.count) for s in d.steps]
    assert trace == [
        ("admit.128", ["A"], 0),
        ("prefill.128", ["A"], 10),
        ("admit.128", ["B"], 0),  # 300 prompt tokens, no penalty: one admit (clears the slot)
        ("decode.1", ["A"], 0),
        ("prefill.128", ["B"], 128),
        ("decode.1", ["A"], 0),
        ("prefill.128", ["B"], 128),
        ("decode.1", ["A"], 0),
        ("prefill.128", ["B"], 44),  # the last chunk samples B's first token
        ("decode.2", ["A", "B"], 0),
        ("decode.2", ["A", "B"], 0),
        ("decode.1", ["A"], 0),  # B finished at 3 tokens
        ("decode.1", ["A"], 0),
    ]
    chunks = [s for s in d.steps if s.kind == ProgramKind.prefill and s.requests == [b]]
    assert [s.sample for s in chunks] == [False, False, True]
    assert [io.unpack(io.PrefillInput, w.value) for s in chunks for w in s.writes if w.buffer == "in.prefill"] == [
        io.PrefillInput(2, 128, 0), io.PrefillInput(2, 128, 0), io.PrefillInput(2, 44, 1)]
    assert b.output == [token_fn(6, i) for i in range(3)] and a.output == [token_fn(5, i) for i in range(8)]
    # Reservation: min(300 + 16, 300 + 3) = 303 tokens -> 19 pages, no growth.
    assert [len(p) for _, p in d.pages["B"]] == [19, 0]


def test_prefill_chunks_are_capped_while_others_decode(tiny_core):
    """--prefill-while-decoding 48: while A decodes, B's prompt goes in chunks of at most 48
    tokens with a decode step after each; C, prefilling alone later, gets whole chunks; the
    outputs are those of the uncapped schedule."""
    d = Driver(small_manifest(tiny_core, num_pages=64, slots=2), prefill_while_decoding=48)
    a, b = _long_prompt_behind_a_decoder(d, 20)
    trace = [(s.kind, s.count) for s in d.steps if s.kind in (ProgramKind.prefill, ProgramKind.decode)]
    b_chunks = [s.count for s in d.steps if s.kind == ProgramKind.prefill and s.requests == [b]]
    assert b_chunks == [48] * 6 + [12], b_chunks
    first = trace.index((ProgramKind.prefill, 48))
    assert [k for k, _ in trace[first : first + 12]] == [ProgramKind.prefill, ProgramKind.decode] * 6
    assert b.output == [token_fn(6, i) for i in range(3)] and a.output == [token_fn(5, i) for i in range(20)]
    c = make_request("C", 300, 1, seed=7)
    d.add(c)
    d.run()
    assert [s.count for s in d.steps if s.kind == ProgramKind.prefill and s.requests == [c]] == [128, 128, 44]
    with pytest.raises(ValueError, match="must not be negative"):
        Scheduler(small_manifest(tiny_core, num_pages=64, slots=2), prefill_while_decoding=-1)


@pytest.fixture(scope="module")
def small_prefill_core() -> Path:
    from tests.conftest import TINY_OPTS, prepare_core

    return prepare_core("llama-tiny", [*TINY_OPTS, "--min-prefill-capacity", "16"], name="llama-tiny-small-prefill")


def _arrive_while_decoding(d: Driver, a_tokens: int, late_tokens: int):
    """A decodes; once it has two tokens, B, C and E (12-token prompts) arrive together.
    Returns (A, [B, C, E], index of the first step after their arrival)."""
    a = make_request("A", 10, a_tokens, seed=5)
    d.add(a)
    d.run(until=lambda: len(a.output) >= 2)
    late = [make_request(n, 12, late_tokens, seed=s) for n, s in (("B", 6), ("C", 7), ("E", 8))]
    d.add(*late)
    return a, late, len(d.steps)


def _trace(d: Driver, start: int, *kinds: ProgramKind) -> list[tuple[str, list[str]]]:
    return [(s.program, [r.id for r in s.requests]) for s in d.steps[start:] if s.kind in kinds]


@pytest.mark.parametrize("budget", [0, 16])
def test_short_prompts_arriving_together_prefill_before_the_next_decode(small_prefill_core, budget):
    """Three 12-token prompts arriving while A decodes: on prefill.16 they fit one turn's
    budget (the 128-token prefill chunk) and all prefill before A's next step, which then
    carries all four; with --prefill-while-decoding 16 each turn holds one of them. Outputs
    are the same either way."""
    d = Driver(small_manifest(small_prefill_core, num_pages=64, slots=4), prefill_while_decoding=budget)
    a, late, start = _arrive_while_decoding(d, 12, 6)
    d.run()
    trace = _trace(d, start, ProgramKind.prefill, ProgramKind.decode)
    if budget == 0:
        assert trace[:4] == [("prefill.16", ["B"]), ("prefill.16", ["C"]), ("prefill.16", ["E"]),
                             ("decode.4", ["A", "B", "C", "E"])], trace
    else:
        assert trace[:6] == [("prefill.16", ["B"]), ("decode.2", ["A", "B"]), ("prefill.16", ["C"]),
                             ("decode.4", ["A", "B", "C"]), ("prefill.16", ["E"]),
                             ("decode.4", ["A", "B", "C", "E"])], trace
    assert a.output == [token_fn(5, i) for i in range(12)]
    assert [r.output for r in late] == [[token_fn(s, i) for i in range(6)] for s in (6, 7, 8)]


@pytest.fixture(scope="module")
def pack_core() -> Path:
    from tests.conftest import TINY_OPTS, prepare_core

    return prepare_core("llama-tiny", [*TINY_OPTS, "--pack-capacities", "64"], name="llama-tiny-pack")


def test_short_prompts_arriving_together_share_one_pack_program(pack_core):
    """--pack-capacities 64: three 12-token prompts arriving while A decodes run as one
    pack.64 program, then one decode step carries all four. A 41-token prompt with two
    more behind it packs with the first of them only (41 + 12 fit, + 12 more do not), the
    third prefills alone; outputs are the sampler's, as without packing."""
    d = Driver(small_manifest(pack_core, num_pages=64, slots=4))
    a, late, start = _arrive_while_decoding(d, 30, 4)
    d.run(until=lambda: all(r.finished for r in late))
    trace = _trace(d, start, ProgramKind.prefill, ProgramKind.decode, ProgramKind.pack)
    assert trace[:2] == [("pack.64", ["B", "C", "E"]), ("decode.4", ["A", "B", "C", "E"])], trace
    pack = next(s for s in d.steps if s.kind == ProgramKind.pack)
    assert pack.segments == [(12, True, False)] * 3 and pack.count == 36
    assert [r.output for r in late] == [[token_fn(s, i) for i in range(4)] for s in (6, 7, 8)]
    more = [make_request("F", 41, 2, seed=9), make_request("G", 12, 2, seed=10), make_request("H", 12, 2, seed=11)]
    d.add(*more)
    start = len(d.steps)
    d.run(until=lambda: all(r.finished for r in more))
    runs = _trace(d, start, ProgramKind.prefill, ProgramKind.pack)
    assert runs == [("pack.64", ["F", "G"]), ("prefill.128", ["H"])], runs
    assert [r.output for r in more] == [[token_fn(s, i) for i in range(2)] for s in (9, 10, 11)]
    assert a.output == [token_fn(5, i) for i in range(len(a.output))]


def test_decode_steps_carry_a_prefill_chunk(pack_core, tiny_core):
    """--decode-with-prefill on a core with pack.64: while B's 150-token prompt prefills
    beside two decoders (A, C), every step is one pack.64 of B's next chunk and a decode
    row each for A and C, so neither waits a step; once B has sampled, plain decode steps
    follow. B's first chunk takes the 62 rows the decoders leave; its later chunks continue
    its history, so they take whole attention tiles (``pack_align`` rows each) and the
    decode rows start on the next tile. Outputs equal the alternating schedule's."""
    def run(mixed: bool):
        d = Driver(small_manifest(pack_core, num_pages=64, slots=4))
        d.sched.decode_with_prefill = mixed
        a, c = make_request("A", 10, 20, seed=5), make_request("C", 14, 20, seed=7)
        d.add(a, c)
        d.run(until=lambda: len(a.output) >= 2 and len(c.output) >= 2)
        b = make_request("B", 150, 4, seed=6)
        d.add(b)
        start = len(d.steps)
        d.run()
        return d, start, a, b, c

    d, start, a, b, c = run(True)
    align = d.sched.caps.pack_align
    assert 1 < align < 64
    chunks = [62]
    while sum(chunks) < 150:
        chunks.append(min(62 // align * align, 150 - sum(chunks)))
    trace = _trace(d, start, ProgramKind.prefill, ProgramKind.decode, ProgramKind.pack)
    assert trace[: len(chunks) + 1] == [("pack.64", ["B", "A", "C"])] * len(chunks) + [
        ("decode.4", ["A", "C", "B"])], trace
    packs = [s for s in d.steps[start:] if s.kind == ProgramKind.pack]
    assert [s.segments for s in packs] == [[(n, i == len(chunks) - 1, False), (1, True, True), (1, True, True)]
                                           for i, n in enumerate(chunks)]
    rows = [io.unpack(io.PackSegment, r) for r in d.dev.a[io.PACK_INPUT][:3]]  # the last pack's layout
    assert [(r.count, r.row) for r in rows] == [(chunks[-1], 0), (1, align), (1, align + 1)]
    plain, _, *outputs = run(False)
    assert [r.output for r in (a, b, c)] == [r.output for r in outputs]
    assert b.output == [token_fn(6, i) for i in range(4)] and a.output == [token_fn(5, i) for i in range(20)]
    with pytest.raises(ValueError, match="pack programs"):
        Scheduler(small_manifest(tiny_core, num_pages=64, slots=2), decode_with_prefill=True)


def test_finish_on_stop_status_and_on_sink_stop(tiny_core):
    d = Driver(small_manifest(tiny_core, num_pages=12, slots=2))
    stop_tok = token_fn(7, 3)
    a = make_request("A", 8, 50, seed=7, stop_token_ids=(stop_tok,))
    b = make_request("B", 8, 50, seed=8, sink=Sink(stop_on=token_fn(8, 2)))
    d.add(a, b)
    w = {x.buffer: x.value for x in d.step().writes}
    assert list(w["state.stop_ids"][:3]) == [2, stop_tok, -1]
    d.run()
    # Device stop status: the stop token is output but not visible.
    assert a.finish_reason == FinishReason.stop and a.output == [token_fn(7, i) for i in range(4)]
    assert a.sink.visible == a.output[:3]
    # A stop string matched by the sink: the token that completed it is visible.
    assert b.finish_reason == FinishReason.stop and b.output == [token_fn(8, i) for i in range(3)]
    assert b.sink.visible == b.output
    assert d.sched.pages.free == 11 and d.sched.slots.free == 2


def test_ignore_eos_leaves_stop_ids_empty(tiny_core):
    d = Driver(small_manifest(tiny_core, num_pages=12, slots=2))
    a = make_request("A", 8, 2, seed=7, ignore_eos=True)
    d.add(a)
    w = {x.buffer: x.value for x in d.step().writes}
    assert list(w["state.stop_ids"]) == [-1] * 16


def test_max_tokens_one_finishes_at_prefill(tiny_core):
    d = Driver(small_manifest(tiny_core, num_pages=12, slots=2))
    a = make_request("A", 30, 1, seed=9)
    d.add(a)
    d.run()
    assert [s.program for s in d.steps] == ["admit.128", "prefill.128"]
    assert a.finish_reason == FinishReason.length and a.output == [token_fn(9, 0)]
    # prompt + max_tokens = 31 tokens: 2 pages reserved, never grown.
    assert d.pages["A"] == [(0, (1, 2)), (30, ())]


def test_cancellation(tiny_core):
    d = Driver(small_manifest(tiny_core, num_pages=12, slots=2))
    a = make_request("A", 20, 30, seed=1)
    b = make_request("B", 20, 30, seed=2)
    c = make_request("C", 20, 30, seed=3)
    d.add(a, b, c)
    # Cancel a waiting request: it leaves the queue without ever holding anything.
    d.sched.cancel(c)
    step = d.step()
    assert step.requests == [a] and step.kind == ProgramKind.admit
    assert c.finish_reason == FinishReason.cancelled and c.sink.finished == 1 and c.pages == []
    assert a.pages == [1, 2, 3] and b.pages == [4, 5, 6]
    # Cancel B right after admission: its queued admit step is dropped.
    d.sched.cancel(b)
    step = d.step()
    assert step.program == "prefill.128" and step.requests == [a]
    assert b.finish_reason == FinishReason.cancelled and b.slot is None and b.pages == []
    assert d.sched.pages.free == 8 and d.sched.slots.free == 1
    # Cancel A while decoding: pages and slot come back at the next boundary.
    d.run(until=lambda: len(a.output) == 5)
    d.sched.cancel(a)
    assert d.step() is None
    assert a.finish_reason == FinishReason.cancelled and len(a.output) == 5
    assert a.sink.finished == 1 and a.sink.visible == a.output
    assert d.sched.pages.free == 11 and d.sched.slots.free == 2 and not d.sched.has_work()
    assert [s.program for s in d.steps].count("admit.128") == 1  # B's admit never ran


def test_cancel_one_of_two_decoders(tiny_core):
    d = Driver(small_manifest(tiny_core, num_pages=12, slots=2))
    a = make_request("A", 10, 20, seed=1)
    b = make_request("B", 10, 20, seed=2)
    d.add(a, b)
    d.run(until=lambda: len(b.output) == 3)
    d.sched.cancel(a)
    step = d.step()
    assert step.program == "decode.1" and step.requests == [b]
    assert a.finish_reason == FinishReason.cancelled and a.slot is None
    d.run()
    assert b.output == [token_fn(2, i) for i in range(20)]


def test_validation_rejects_what_can_never_run(tiny_core):
    sched = Scheduler(small_manifest(tiny_core, num_pages=12, slots=2))
    with pytest.raises(AdmissionError, match="pool holds 11") as e:
        sched.add(make_request("X", 161, 10, seed=0))  # 11 pages of prompt + 1
    assert (e.value.code, e.value.param) == ("kv_capacity_exceeded", "prompt")
    sched.add(make_request("Y", 160, 10, seed=0))  # 10 pages + 1: fits the whole pool
    with pytest.raises(AdmissionError, match="the prompt has 1000 and max_tokens asks for 25") as e:
        sched.add(make_request("Z", 1000, 25, seed=0))
    assert (e.value.code, e.value.param) == ("context_length_exceeded", "max_tokens")
    with pytest.raises(AdmissionError, match="the prompt has 1024$") as e:
        sched.add(make_request("Z", 1024, 1, seed=0))
    assert e.value.param == "prompt"  # a runtime field: the server names its own (test_http)
    with pytest.raises(FrontendError, match="prompt is empty"):
        sched.add(make_request("E", 0, 1, seed=0))
    with pytest.raises(FrontendError, match="at most 16 stop token ids"):
        sched.add(make_request("S", 5, 1, seed=0, stop_token_ids=tuple(range(10, 26))))
    sched.add(make_request("S", 5, 1, seed=0, stop_token_ids=tuple(range(10, 24))))  # 15 + EOS
    bad = Request([5, 49152], params(0, 1), request_id="V")
    with pytest.raises(FrontendError, match="outside the vocabulary"):
        sched.add(bad)
    assert [r.id for r in sched.waiting] == ["Y", "S"]


def test_history_filling_the_pool_finishes_with_length(tiny_core):
    """A lone request whose history outgrows the whole pool ends with ``length``
    rather than preempting itself forever."""
    d = Driver(small_manifest(tiny_core, num_pages=4, slots=2))
    a = make_request("A", 20, 100, seed=4)
    d.add(a)
    d.run()
    # 3 pages hold 48 tokens: the decode that would write position 48 cannot run.
    assert a.finish_reason == FinishReason.length and a.consumed == 48
    assert a.output == [token_fn(4, i) for i in range(29)]
    assert d.sched.pages.free == 3


def test_completion_for_wrong_slot_is_rejected(tiny_core):
    d = Driver(small_manifest(tiny_core, num_pages=12, slots=2))
    a = make_request("A", 10, 5, seed=1)
    d.add(a)
    d.step()
    step = d.sched.schedule()
    bad = np.array([[2, 5, 1, 0]], np.int32)
    with pytest.raises(Exception, match="completion for slot 2, expected 1"):
        d.sched.complete(step, bad)
    assert a.output == [] and a.consumed == 0


# ---------------------------------------------------------------------------
# Grammar-constrained requests


class ScriptGrammar:
    """A grammar that allows exactly one token sequence, then only ``end`` (an EOS id).
    ``fail_at``: the mask call at which it reports a failure instead."""

    def __init__(self, script: list[int], end: int, words: int, fail_at: int | None = None):
        self.script, self.end, self.words, self.fail_at = script, end, words, fail_at
        self.accepted: list[int] = []
        self.masks = 0

    def fill_mask(self, out: np.ndarray) -> bool:
        self.masks += 1
        if self.masks == self.fail_at:
            return False
        nxt = self.script[len(self.accepted)] if len(self.accepted) < len(self.script) else self.end
        bits = np.zeros(self.words * 32, np.int64)
        bits[nxt] = 1
        out[:] = (bits.reshape(-1, 32) << np.arange(32)).sum(axis=1).astype(np.uint32).view(np.int32)
        return True

    def accept(self, token: int) -> bool:
        ok = token == (self.script[len(self.accepted)] if len(self.accepted) < len(self.script) else self.end)
        self.accepted.append(token)
        return ok

    def error(self) -> str:
        return "scripted failure"


def test_grammar_masks_at_every_sampling_step_and_only_there(tiny_core):
    """A constrained request (prompt of 200 tokens: two prefill chunks) beside a free one:
    mask_on is written at admission (1 / 0), the constrained slot's mask row goes with
    its final prefill chunk and with every decode step, each computed after the grammar
    accepted the previous token; the output is the script, then EOS ends it."""
    m = small_manifest(tiny_core, num_pages=64, slots=2)
    d = Driver(m)
    eos = m.frontend.eos_ids[0]
    script = [500 + 3 * i for i in range(6)]
    g = ScriptGrammar(script, eos, d.dev.a["in.token_mask"].shape[1])
    free = make_request("F", 10, 12, seed=4)
    con = Request([100 + i % 300 for i in range(200)], params(9, 40), Sink(), request_id="C", grammar=g)
    d.add(free, con)
    d.run()
    admits = {s.requests[0].id: {w.buffer: w.value for w in s.writes}
              for s in d.steps if s.kind == ProgramKind.admit and any(w.buffer == "state.mask_on" for w in s.writes)}
    assert (int(admits["F"]["state.mask_on"]), int(admits["C"]["state.mask_on"])) == (0, 1)
    masked = [(s.program, [r.id for r in s.requests]) for s in d.steps
              if any(w.buffer == "in.token_mask" for w in s.writes)]
    sampling_c = [(s.program, [r.id for r in s.requests]) for s in d.steps if con in s.requests
                  and (s.kind == ProgramKind.decode or (s.kind == ProgramKind.prefill and s.sample))]
    assert masked == sampling_c and len(masked) == len(script) + 1  # six script tokens, then EOS
    assert [s.sample for s in d.steps if s.kind == ProgramKind.prefill and s.requests == [con]] == [False, True]
    for s in d.steps:
        rows = [w.row for w in s.writes if w.buffer == "in.token_mask"]
        assert rows in ([], [con.slot] if con.slot is not None else rows)
    assert con.output == script + [eos] and g.accepted == con.output and g.masks == len(script) + 1
    assert con.finish_reason == FinishReason.stop and con.sink.visible == script
    assert free.output == [token_fn(4, i) for i in range(12)]  # unconstrained, unaffected


def test_admission_writes_whether_the_request_reads_log_probabilities(tiny_core):
    """state.logprobs_on is written at admission: 1 for a request that asks for log-probabilities
    (any count, 0 included), 0 for one that does not (its rows' blocks are then skipped)."""
    m = small_manifest(tiny_core, num_pages=64, slots=4)
    d = Driver(m)
    reqs = [make_request("N", 10, 4, seed=1), make_request("Z", 10, 4, seed=2, logprobs=0),
            make_request("T", 10, 4, seed=3, logprobs=3)]
    d.add(*reqs)

    def admitted():
        return {s.requests[0].id: int({w.buffer: w.value for w in s.writes}[io.LOGPROBS_ON])
                for s in d.steps if s.kind == ProgramKind.admit and any(w.buffer == io.LOGPROBS_ON for w in s.writes)}
    d.run(until=lambda: len(admitted()) == 3)
    assert admitted() == {"N": 0, "Z": 1, "T": 1}


def test_grammar_survives_preemption(tiny_core):
    """A constrained request preempted mid-output keeps its grammar state: after
    readmission its next masks continue the script where it stopped."""
    m = small_manifest(tiny_core, num_pages=12, slots=2)
    d = Driver(m)
    eos = m.frontend.eos_ids[0]
    script = [1000 + i for i in range(80)]
    a = make_request("A", 40, 70, seed=11)
    g = ScriptGrammar(script, eos, d.dev.a["in.token_mask"].shape[1])
    b = Request([100 + (7 * i + 22) % 500 for i in range(16)], params(22, 100), Sink(), request_id="B", grammar=g)
    d.add(a, b)
    d.run(until=lambda: b.preemptions == 1)
    assert len(b.output) == 56 and b.output == script[:56]
    d.run()
    assert b.output == script + [eos] and b.finish_reason == FinishReason.stop and b.preemptions == 1
    admissions = [{w.buffer: w.value for w in s.writes} for s in d.steps if s.kind == ProgramKind.admit
                  and b in s.requests and any(w.buffer == "state.mask_on" for w in s.writes)]
    assert [int(w["state.mask_on"]) for w in admissions] == [1, 1]  # first admission and readmission


@pytest.mark.parametrize("fail_at", [1, 3])
def test_grammar_failure_ends_only_its_request(tiny_core, fail_at):
    """A grammar that cannot give a mask (at the first sample, in prefill, or later, in
    decode) ends its request with a typed error; the step goes on without it."""
    m = small_manifest(tiny_core, num_pages=24, slots=2)
    d = Driver(m)
    g = ScriptGrammar([600, 601, 602, 603], m.frontend.eos_ids[0], d.dev.a["in.token_mask"].shape[1],
                      fail_at=fail_at)
    bad = Request([100 + i for i in range(8)], params(1, 20), Sink(), request_id="G", grammar=g)
    ok = make_request("OK", 8, 6, seed=2)
    d.add(bad, ok)
    d.run()
    assert bad.finish_reason == FinishReason.error and isinstance(bad.error, ModelOutputError)
    assert bad.error.code == "grammar_failed" and "scripted failure" in bad.error.message
    assert bad.output == [600, 601][: fail_at - 1] and bad.sink.finished == 1
    assert ok.output == [token_fn(2, i) for i in range(6)] and ok.finish_reason == FinishReason.length
    assert d.sched.slots.free == 2 and d.sched.pages.free == 23


def test_pack_layout_and_plan():
    """flare.runtime.packing: chunks that continue a history take whole tiles; a pack needs
    two chunks without decoders; beside decoders the first chunk is cut to the rows left
    (whole tiles when it continues) but not below half the pack; the smallest capacity that
    holds the rows runs it; segments never exceed the decode batch."""
    from flare.runtime.packing import Chunk, layout, plan

    assert layout([(12, False), (5, True), (1, False), (1, False)], 16) == ([0, 16, 32, 33], 34)
    assert layout([(3, False), (1, False)], 16) == ([0, 3], 4)
    cold = Chunk(12, False)
    assert plan([cold], 0, (64, 256), 16, 8) is None  # one prompt runs its own prefill
    assert plan([cold, cold, cold], 0, (64, 256), 16, 8) == (64, [12, 12, 12])
    assert plan([cold] * 6, 0, (64, 256), 16, 8) == (256, [12] * 6)
    assert plan([cold] * 6, 0, (64,), 16, 8) == (64, [12] * 5)  # the sixth does not fit
    assert plan([cold] * 6, 0, (64, 256), 16, 3) == (64, [12] * 3)  # three slots at most
    assert plan([Chunk(40, True), cold], 0, (64,), 16, 8) == (64, [40, 12])  # rows 0-40, then 48-60
    assert plan([Chunk(40, True), Chunk(20, False)], 0, (64,), 16, 8) is None  # 48 + 20 > 64: one chunk
    # Beside decoders (after the chunk, densely):
    assert plan([Chunk(150, False)], 2, (64,), 16, 8) == (64, [62])
    assert plan([Chunk(150, True)], 2, (64,), 16, 8) == (64, [48])  # whole tiles: 62 -> 48
    assert plan([Chunk(150, True)], 40, (64,), 16, 64) is None  # 16 tokens a step: below half the pack
    assert plan([Chunk(10, True)], 40, (64,), 16, 64) == (64, [10])  # the prompt's last chunk
    assert plan([Chunk(10, False), cold], 2, (16, 64), 16, 8) == (64, [10, 12])
    assert plan([Chunk(10, False)], 2, (16, 64), 16, 8) == (16, [10])
    assert plan([cold], 8, (64,), 16, 8) is None  # no segment left beside a full decode batch
    # --prefill-while-decoding 64 beside four decoders: three prompts' chunks keep to 64 tokens.
    assert plan([Chunk(64, False)] * 3, 4, (64, 256), 16, 8, 64) == (256, [64])
    assert plan([Chunk(64, False)] * 3, 4, (64, 256), 16, 8) == (256, [64, 64, 64])
