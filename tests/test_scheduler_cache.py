"""The scheduler with the prefix cache, against the fake device of
``test_pages_scheduler`` (which checks, before every prefill and decode, that a
slot's continuation state and KV pages hold exactly the request's consumed
history, and that nobody writes a shared page).

Tiny core manifest, page size 16, 64-token hash blocks. Page ids follow the
FIFO free list: never-used pages first, then released pages in release order.
Snapshot rows and request slots are handed out the same way (a released slot
goes to the back of the queue). Capture budget =
snapshot rows // slots, capped at 8."""

from __future__ import annotations

from flare.core import interface as io

import numpy as np

from flare.core.manifest import ProgramKind
from flare.runtime.request import FinishReason, Request, Status
from tests.test_pages_scheduler import Driver, Sink, params, small_manifest, token_fn

CONV = [200 + (13 * i) % 701 for i in range(400)]  # a conversation's token stream


def req(name: str, prompt: list[int], max_tokens: int, seed: int, endpoints=(), **kw) -> Request:
    return Request(list(prompt), params(seed, max_tokens, **kw), Sink(), request_id=name, endpoints=endpoints)


def trace(steps) -> list[tuple]:
    out = []
    for s in steps:
        if s.kind in (ProgramKind.snapshot, ProgramKind.restore):
            meta = next(w.value for w in s.writes if w.buffer == io.StateInput.buffer)
            out.append((s.program, s.requests[0].id, io.unpack(io.StateInput, meta)))  # (slot, row, page, count)
        elif s.kind == ProgramKind.prefill:
            out.append((s.program, s.requests[0].id, s.count))
        else:
            out.append((s.program, tuple(r.id for r in s.requests)))
    return out


def ckpts(d: Driver) -> list[tuple[int, int, list[int], int | None]]:
    """(length, row, segment, parent length) of every published checkpoint, by id."""
    return [(c.length, c.row, c.segment, c.parent.length if c.parent else None)
            for c in d.sched.checkpoints.cache.checkpoints()]


def turn1(d: Driver) -> Request:
    """A 40-token prompt whose messages end at 10 and 25; five output tokens."""
    a = req("A", CONV[:40], 5, seed=1, endpoints=(10, 25))
    d.add(a)
    d.run()
    return a


def test_captures_at_endpoints_publish_after_the_copy(tiny_core):
    d = Driver(small_manifest(tiny_core, num_pages=40, slots=2, snapshot_rows=8))  # budget 4
    a = turn1(d)
    # Reservation min(40 + 16, 40 + 5) = 45 tokens: pages 1, 2, 3. Budget 4: terminal, prompt,
    # and both message endpoints. Prefill stops at each; each snapshot copies the tail page
    # holding the endpoint (10 -> page 1, 25 -> page 2, 40 -> page 3).
    assert trace(d.steps) == [
        ("admit.128", ("A",)),
        ("prefill.128", "A", 10), ("snapshot.1", "A", (1, 1, 1, 10)),
        ("prefill.128", "A", 15), ("snapshot.1", "A", (1, 2, 2, 25)),
        ("prefill.128", "A", 15), ("snapshot.1", "A", (1, 3, 3, 40)),
        ("decode.1", ("A",)), ("decode.1", ("A",)), ("decode.1", ("A",)), ("decode.1", ("A",)),
        # Terminal capture: 40 prompt + 5 sampled - the pending one = 44 consumed.
        ("snapshot.1", "A", (1, 4, 3, 44)),
    ]
    assert a.output == [token_fn(1, i) for i in range(5)] and a.finish_reason == FinishReason.length
    # Each checkpoint owns the complete pages after its parent's: 10 and 44 complete none.
    assert ckpts(d) == [(10, 1, [], None), (25, 2, [1], 10), (40, 3, [2], 25), (44, 4, [], 40)]
    # The request is gone; its complete pages stay with the checkpoints, page 3 is free.
    assert d.sched.page_usage() == (37, 0, 2) and list(d.sched.pages._free)[-1] == 3
    assert d.sched.prefill_tokens_total == 40 and a.cached_tokens == 0


def test_next_turn_restores_and_prefills_only_the_suffix(tiny_core):
    d = Driver(small_manifest(tiny_core, num_pages=40, slots=2, snapshot_rows=8))
    turn1(d)
    # Turn 2: the prompt continues A's prompt with a scripted assistant message (ends at 46)
    # and a user message (ends at 56's header). A's terminal (44) holds A's own output, not
    # this message: the deepest usable checkpoint is A's prompt endpoint, 40.
    b = req("B", CONV[:56], 3, seed=2, endpoints=(10, 25, 46))
    n0 = len(d.steps)
    d.add(b)
    d.run()
    assert b.cached_tokens == 40
    # Reservation min(56 + 16, 59) -> 4 pages: the checkpoint's 2 complete pages shared,
    # 2 private (4, 5); the tail (positions 32..39) is restored into page 4. Slot 2.
    assert trace(d.steps[n0:]) == [
        ("admit.128", ("B",)),
        ("restore.1", "B", (2, 3, 4, 40)),
        ("prefill.128", "B", 6), ("snapshot.1", "B", (2, 5, 4, 46)),
        ("prefill.128", "B", 10), ("snapshot.1", "B", (2, 6, 5, 56)),
        ("decode.1", ("B",)), ("decode.1", ("B",)),
        ("snapshot.1", "B", (2, 7, 5, 58)),
    ]
    assert d.pages["B"][0] == (40, (1, 2, 4, 5))
    assert b.output == [token_fn(2, i) for i in range(3)]
    assert d.sched.prefill_tokens_total == 40 + 16  # prompt tokens minus cached tokens
    assert ckpts(d)[4:] == [(46, 5, [], 40), (56, 6, [4], 46), (58, 7, [], 56)]
    assert d.sched.checkpoints.hit_tokens_total == 40


def test_full_prompt_hit_runs_resume_and_no_prefill(tiny_core):
    d = Driver(small_manifest(tiny_core, num_pages=40, slots=2, snapshot_rows=8))
    turn1(d)
    c = req("C", CONV[:40], 3, seed=7)
    n0, prefilled = len(d.steps), d.sched.prefill_tokens_total
    d.add(c)
    d.run()
    # The whole prompt is A's prompt endpoint: restore it and sample from the saved
    # hidden vector. No prefill program runs, no token is recomputed.
    assert trace(d.steps[n0:]) == [
        ("admit.128", ("C",)),
        ("restore.1", "C", (2, 3, 4, 40)),
        ("resume.1", ("C",)),
        ("decode.1", ("C",)), ("decode.1", ("C",)),
        ("snapshot.1", "C", (2, 5, 4, 42)),
    ]
    assert not any(s.kind == ProgramKind.prefill for s in d.steps[n0:])
    assert d.sched.prefill_tokens_total == prefilled and c.cached_tokens == 40
    # The request's own sampling stream, from its own seed: not the earlier request's.
    assert c.output == [token_fn(7, i) for i in range(3)] and c.sink.visible == c.output
    # The penalty histogram was built from the full prompt by the admit program.
    assert (d.dev.a["state.hist"][2][CONV[:40]] > 0).all()


def test_branches_share_pages_up_to_their_divergence(tiny_core):
    d = Driver(small_manifest(tiny_core, num_pages=40, slots=2, snapshot_rows=16))  # budget 8
    turn1(d)
    b1 = req("B1", CONV[:40] + [901] * 10, 3, seed=11)
    b2 = req("B2", CONV[:40] + [902] * 10, 3, seed=12)
    d.add(b1, b2)
    d.step()  # admits both
    # Both restore A's prompt endpoint (40): the two complete pages are shared, each
    # branch gets its own private tail page (4 and 6) with a copy of positions 32..39.
    assert (b1.pages, b2.pages) == ([1, 2, 4, 5], [1, 2, 6, 7])
    assert [d.sched.pages.refcount(p) for p in (1, 2, 4, 6)] == [3, 3, 1, 1]
    d.run()
    restores = [t for t in trace(d.steps) if t[0] == "restore.1"]
    assert restores == [("restore.1", "B1", (2, 3, 4, 40)), ("restore.1", "B2", (1, 3, 6, 40))]
    assert b1.output == [token_fn(11, i) for i in range(3)] and b2.output == [token_fn(12, i) for i in range(3)]
    # Each branch published under the shared parent, with its own pages.
    root = next(c for c in d.sched.checkpoints.cache.checkpoints() if c.length == 40)
    assert [(c.length, c.segment) for c in root.children] == [(44, []), (50, [4]), (50, [6])]
    cache = d.sched.checkpoints.cache
    assert [cache.chain(c) for c in root.children] == [[1, 2], [1, 2, 4], [1, 2, 6]]
    # Each branch's history matches only its own checkpoint.
    assert cache.match(b1.prompt, cache.digests()) is root.children[1]
    assert cache.match(b2.prompt, cache.digests()) is root.children[2]


def test_page_pressure_evicts_the_least_recently_used_conversation(tiny_core):
    """11 usable pages, one slot. Conversations X and Y each leave a prompt checkpoint
    (2 complete pages) and a terminal one (no complete page of its own). A request
    that continues X restores X's prompt checkpoint and publishes 44 and 45 under it;
    a large unrelated request then needs 8 pages with 7 free. Unpinned leaves go in
    least-recently-used order until enough pages are free: X's old terminal 41 (frees
    nothing), Y's terminal 41 (nothing), then Y's prompt checkpoint (2 pages)."""
    d = Driver(small_manifest(tiny_core, num_pages=12, slots=1, snapshot_rows=8))
    x, y = [300 + i for i in range(40)], [500 + i for i in range(40)]
    d.add(req("X", x, 2, seed=1), req("Y", y, 2, seed=2))
    d.run()
    assert [(c.length, c.segment) for c in d.sched.checkpoints.cache.checkpoints()] == [
        (40, [1, 2]), (41, []), (40, [4, 5]), (41, [])]
    assert d.sched.page_usage() == (7, 0, 4)
    d.add(req("X2", x + [7] * 4, 2, seed=3))  # reuses X (and publishes 44, 45 under it)
    d.run()
    big = req("Z", [900 + i for i in range(120)], 2, seed=4)  # min(136, 122) tokens: 8 pages
    d.add(big)
    d.step()
    assert big.status == Status.PREFILLING and len(big.pages) == 8
    surviving = [(c.length, tuple(c.key[1][:1])) for c in d.sched.checkpoints.cache.checkpoints()]
    assert surviving == [(40, (300,)), (44, (300,)), (45, (300,))]
    assert d.sched.checkpoints.cache.evicted_for_pages == 3
    d.run()
    assert big.output == [token_fn(4, i) for i in range(2)]


def test_snapshot_pressure_thins_the_chain_and_skips_when_everything_is_pinned(tiny_core):
    d = Driver(small_manifest(tiny_core, num_pages=40, slots=1, snapshot_rows=4))  # budget 4
    a = req("A", CONV[:40], 5, seed=1, endpoints=(10, 25, 33))
    d.add(a)
    d.run()
    # Three message endpoints, two places: targets 13.3 and 26.7 pick 10 and 25.
    assert [c.length for c in d.sched.checkpoints.cache.checkpoints()] == [10, 25, 40, 44]
    b = req("B", CONV[:50], 2, seed=2, endpoints=(10, 25, 33, 46))
    n0 = len(d.steps)
    d.add(b)
    d.run()
    # B restores 40 (pinned) and captures 46, 50 and its terminal 51, each into a full
    # pool. 46: removable are 10 (a root) and 25 (interior, 40 - 10 = 30): 25 goes, row 2.
    # 50: 40 has two children now and 46 is B's anchor, so the root 10 goes, row 1; 40
    # inherits its segment. 51: 46 (one child, unpinned once 50 published) goes, row 2.
    assert trace(d.steps[n0:]) == [
        ("admit.128", ("B",)),
        ("restore.1", "B", (1, 3, 4, 40)),
        ("prefill.128", "B", 6), ("snapshot.1", "B", (1, 2, 4, 46)),
        ("prefill.128", "B", 4), ("snapshot.1", "B", (1, 1, 5, 50)),
        ("decode.1", ("B",)),
        ("snapshot.1", "B", (1, 2, 5, 51)),
    ]
    cache = d.sched.checkpoints.cache
    assert (cache.thinned, cache.evicted_for_rows) == (3, 0)
    # Sparse history, every conversation endpoint kept: the branch point 40, A's terminal,
    # B's prompt and terminal. Complete pages moved to the survivors, none was freed.
    assert ckpts(d) == [(40, 3, [1, 2], None), (44, 4, [], 40), (50, 1, [4], 40), (51, 2, [], 50)]
    assert b.output == [token_fn(2, i) for i in range(2)]
    # Now every row is a checkpoint and a request pins the only one it can use: one row,
    # one slot, and the restored checkpoint pinned -> its capture is skipped.
    d2 = Driver(small_manifest(tiny_core, num_pages=40, slots=1, snapshot_rows=1))  # budget 1: terminal
    d2.add(req("P", CONV[:40], 1, seed=5))
    d2.run()
    assert [c.length for c in d2.sched.checkpoints.cache.checkpoints()] == [40]
    q = req("Q", CONV[:40], 3, seed=6)
    d2.add(q)
    d2.run()
    assert q.output == [token_fn(6, i) for i in range(3)] and q.finish_reason == FinishReason.length
    assert d2.sched.checkpoints.skipped_total == 1
    assert [c.length for c in d2.sched.checkpoints.cache.checkpoints()] == [40]
    assert d2.sched.checkpoints.cache.rows.free == 0 and d2.sched.page_usage() == (37, 0, 2)


def test_cancel_with_a_queued_restore_releases_its_pin_and_pages(tiny_core):
    d = Driver(small_manifest(tiny_core, num_pages=40, slots=2, snapshot_rows=8))
    turn1(d)
    c = req("C", CONV[:40], 3, seed=7)
    d.add(c)
    assert d.step().kind == ProgramKind.admit  # restore and resume are queued behind it
    root = next(x for x in d.sched.checkpoints.cache.checkpoints() if x.length == 40)
    assert root.pins == 1 and d.sched.checkpoints.cache.rows.in_use(root.row)
    d.sched.cancel(c)
    assert d.step() is None
    assert c.finish_reason == FinishReason.cancelled and root.pins == 0
    assert not d.sched.checkpoints.cache.rows.in_use(root.row)
    assert d.sched.page_usage() == (37, 0, 2)


def test_single_output_token_shares_prompt_and_terminal_endpoint(tiny_core):
    d = Driver(small_manifest(tiny_core, num_pages=40, slots=2, snapshot_rows=8))
    a = req("A", CONV[:30], 1, seed=3, endpoints=(12,))
    d.add(a)
    d.run()
    assert trace(d.steps) == [
        ("admit.128", ("A",)),
        ("prefill.128", "A", 12), ("snapshot.1", "A", (1, 1, 1, 12)),
        ("prefill.128", "A", 18),
        # Finished at the prefill's sample: the terminal capture at 30 consumed tokens.
        ("snapshot.1", "A", (1, 2, 2, 30)),
    ]
    assert [c.length for c in d.sched.checkpoints.cache.checkpoints()] == [12, 30]


def test_cache_off_and_cache_on_give_identical_streams(tiny_core):
    """Preemption, readmission and growth with the cache on: the same tokens as with it
    off (the fake checks every restored state and page against the history)."""
    outs = []
    for on in (False, True):
        d = Driver(small_manifest(tiny_core, num_pages=12, slots=2, snapshot_rows=8), prefix_cache=on)
        a = req("A", CONV[:40], 70, seed=11)
        b = req("B", CONV[:16], 100, seed=22)
        d.add(a, b)
        d.run()
        assert b.preemptions == 1
        outs.append((a.output, b.output))
        if not on:
            assert not any(s.kind in (ProgramKind.snapshot, ProgramKind.restore) for s in d.steps)
            assert d.sched.checkpoints.cache is None
    assert outs[0] == outs[1]


def test_no_prefix_cache_flag(tiny_core):
    d = Driver(small_manifest(tiny_core, num_pages=40, slots=2, snapshot_rows=8), prefix_cache=False)
    turn1(d)
    c = req("C", CONV[:40], 3, seed=7)
    d.add(c)
    d.run()
    assert c.cached_tokens == 0 and d.sched.prefill_tokens_total == 80
    assert [s.program for s in d.steps].count("prefill.128") == 2
    assert np.array_equal(d.sched.page_usage(), (39, 0, 0))


def test_choices_of_one_prompt_capture_its_endpoint_once(tiny_core):
    # Two choices of one prompt are admitted together: neither can reuse the other's
    # prefill, but the prompt endpoint is captured once (the second choice takes no
    # snapshot row for it); each choice still captures its own terminal endpoint.
    d = Driver(small_manifest(tiny_core, num_pages=40, slots=2, snapshot_rows=8))
    c0, c1 = req("C0", CONV[:40], 3, seed=1), req("C1", CONV[:40], 3, seed=2)
    d.add(c0)
    d.add(c1)
    d.run()
    snaps = [(s.requests[0].id, s.endpoint) for s in d.steps if s.kind == ProgramKind.snapshot]
    assert sorted(snaps) == [("C0", 40), ("C0", 42), ("C1", 42)], snaps
    ck = d.sched.checkpoints
    assert ck.duplicates_avoided_total == 1 and ck.cache.duplicates == 0
    assert sorted(c[0] for c in ckpts(d)) == [40, 42, 42]
    # A later request with the same prompt restores the single prompt checkpoint.
    again = req("C2", CONV[:40] + [7, 8, 9], 2, seed=3)
    d.add(again)
    d.run()
    assert again.cached_tokens == 40
