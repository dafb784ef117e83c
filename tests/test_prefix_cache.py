"""The prefix cache and the snapshot-placement policy, on their own, with tiny pools.

Page size 4 and 64-token hash blocks: a checkpoint's chain is ``length // 4``
pages. Every page id below follows from the page pool's FIFO order (1, 2, ...
then released pages in release order). ``check_integrity`` runs after every
operation (the ``ops`` helper)."""

from __future__ import annotations

import pytest

from flare.runtime.snapshot_plan import SnapshotPlan, snapshot_budget, plan_snapshots
from flare.runtime.pages import PagePool, RowPool
from flare.runtime.prefix_cache import BLOCK_TOKENS, CacheError, PrefixCache, PrefixDigests

PS = 4
FINGERPRINT = b"fingerprint"


def toks(n: int, salt: int = 0) -> list[int]:
    return [(7 * i + 3 + salt) % 997 for i in range(n)]


class Rig:
    """A page pool, a cache, and 'requests' as plain page lists (each holding one
    reference per page, as the scheduler's requests do)."""

    def __init__(self, pages: int = 16, rows: int = 4):
        self.pool = PagePool(pages)
        self.cache = PrefixCache(self.pool, rows, PS, FINGERPRINT)

    def check(self) -> None:
        self.pool.check_integrity()
        self.cache.check_integrity()

    def publish(self, tokens, length, pages, parent=None):
        row = self.cache.acquire_row()
        assert row is not None
        c = self.cache.insert(tokens, self.cache.digests(), length, row, parent, pages)
        self.check()
        return c

    def match(self, tokens):
        c = self.cache.match(tokens, self.cache.digests())
        return None if c is None else c.length


# ---------------------------------------------------------------------------
# Identity


def test_digests_are_chained_64_token_blocks_seeded_with_the_fingerprint():
    a = toks(200)
    d = PrefixDigests(FINGERPRINT)
    assert BLOCK_TOKENS == 64
    blocks = [d.block(a, k) for k in range(4)]
    assert len(set(blocks)) == 4
    # Independent of how far it was computed, and of the page size (no page here at all).
    assert PrefixDigests(FINGERPRINT).block(a[:128], 2) == blocks[2]
    # Changing one token of block 0 changes every later block digest; changing a token
    # of block 2 leaves blocks 0..2 alone.
    b = list(a)
    b[5] += 1
    assert all(PrefixDigests(FINGERPRINT).block(b, k) != blocks[k] for k in (1, 2, 3))
    c = list(a)
    c[130] += 1
    assert [PrefixDigests(FINGERPRINT).block(c, k) for k in range(3)] == blocks[:3]
    # Another model (fingerprint) never shares a key.
    assert PrefixDigests(b"other").block(a, 0) != blocks[0]
    # Keys: block digest at length // 64 plus the tail tokens.
    assert d.key(a, 70) == (blocks[1], tuple(a[64:70]))
    assert d.key(a, 64) == (blocks[1], ())
    with pytest.raises(ValueError, match="beyond"):
        d.block(a, 4)


# ---------------------------------------------------------------------------
# Publication, lookup, sharing


def test_insert_match_and_page_sharing():
    r = Rig()
    a = toks(30)
    req = r.pool.allocate(8)  # pages 1..8: positions 0..31
    c10 = r.publish(a, 10, req)  # complete pages: 2 (positions 0..7)
    assert (c10.length, c10.segment, c10.parent, c10.row) == (10, [1, 2], None, 1)
    assert [r.pool.refcount(p) for p in range(1, 9)] == [2, 2, 1, 1, 1, 1, 1, 1]
    c22 = r.publish(a, 22, req, parent=c10)  # complete pages 5: segment = pages 3..5
    assert (c22.segment, c22.parent, c22.row) == ([3, 4, 5], c10, 2)
    assert r.cache.chain(c22) == [1, 2, 3, 4, 5]
    assert c10.children == [c22]
    # Lookups: the deepest checkpoint that prefixes the tokens and is not longer than them.
    assert r.match(a) == 22
    assert r.match(a[:22]) == 22  # a full-prompt hit
    assert r.match(a[:21]) == 10
    assert r.match(a[:10] + [999] * 15) == 10
    assert r.match(a[:9]) is None
    assert r.match(toks(30, salt=1)) is None
    # Equal endpoints share one checkpoint: a second publication is a duplicate.
    row = r.cache.acquire_row()
    assert r.cache.insert(a, r.cache.digests(), 22, row, None, r.pool.allocate(6)) is None
    assert r.cache.duplicates == 1 and len(r.cache) == 2
    r.cache.release_row(row)
    r.check()
    # The request ends: its pages stay where a checkpoint holds them.
    r.pool.release(req)
    assert [r.pool.refcount(p) for p in range(1, 9)] == [1, 1, 1, 1, 1, 0, 0, 0]
    r.check()


def test_match_across_hash_blocks():
    """Endpoints on both sides of a 64-token block boundary and exactly on it."""
    r = Rig(pages=64, rows=8)
    a = toks(200)
    pages = r.pool.allocate(50)
    prev = None
    for length in (63, 64, 65, 128, 150):
        prev = r.publish(a, length, pages, parent=prev)
    for n, expected in ((62, None), (63, 63), (64, 64), (100, 65), (128, 128), (149, 128), (200, 150)):
        assert r.match(a[:n]) == expected, n
    b = list(a)
    b[100] += 1  # differs inside block 1: only endpoints up to 100 can match
    assert r.match(b) == 65


def test_branches_share_the_parent_chain():
    r = Rig(pages=20, rows=4)
    base = toks(13)
    first = r.pool.allocate(5)  # a request: positions 0..19
    root = r.publish(base, 13, first)  # 3 complete pages, tail in the row
    # Two branches restore the root: share its chain [1, 2, 3], each with a private
    # tail page holding a copy of positions 12..12 and its own suffix.
    b1 = r.cache.chain(root) + r.pool.allocate(3)
    b2 = r.cache.chain(root) + r.pool.allocate(3)
    r.pool.retain(r.cache.chain(root) * 2)
    assert (b1, b2) == ([1, 2, 3, 6, 7, 8], [1, 2, 3, 9, 10, 11])
    t1 = base + toks(10, salt=1)
    t2 = base + toks(10, salt=2)
    c1 = r.publish(t1, 21, b1, parent=root)
    c2 = r.publish(t2, 23, b2, parent=root)
    assert (c1.segment, c2.segment) == ([6, 7], [9, 10])
    assert root.children == [c1, c2]
    assert r.cache.chain(c1) == [1, 2, 3, 6, 7] and r.cache.chain(c2) == [1, 2, 3, 9, 10]
    assert (r.match(t1), r.match(t2), r.match(base + [5] * 10)) == (21, 23, 13)
    # A chain that does not extend the claimed parent is refused.
    row = r.cache.acquire_row()
    with pytest.raises(CacheError, match="not the published prefix"):
        r.cache.insert(t1 + [1, 2, 3], r.cache.digests(), 24, row, c2, b1)
    with pytest.raises(CacheError, match="not the published prefix"):
        r.cache.insert(base, r.cache.digests(), 12, row, c1, b1)  # parent longer than the endpoint
    r.cache.release_row(row)
    r.check()


def test_insert_needs_an_owned_row_and_enough_pages():
    r = Rig()
    a = toks(20)
    with pytest.raises(CacheError, match="nobody owns"):
        r.cache.insert(a, r.cache.digests(), 8, 3, None, r.pool.allocate(2))
    row = r.cache.acquire_row()
    with pytest.raises(CacheError, match="needs 4 complete pages"):
        r.cache.insert(a, r.cache.digests(), 16, row, None, [1, 2])
    r.cache.release_row(row)
    r.check()


# ---------------------------------------------------------------------------
# Eviction under page pressure


def test_page_pressure_evicts_lru_unpinned_leaves():
    """Three conversations, one checkpoint each (pages 1-2, 3-4, 5-6), requests gone.
    Lookups refresh recency; the pinned one never goes."""
    r = Rig(pages=9, rows=4)  # 8 usable pages
    convs = [toks(9, salt=s) for s in range(3)]
    ck = []
    for t in convs:
        req = r.pool.allocate(2)
        ck.append(r.publish(t, 8, req))
        r.pool.release(req)
    assert [c.segment for c in ck] == [[1, 2], [3, 4], [5, 6]]
    assert r.pool.free == 2
    r.cache.pin(ck[0])  # a request restored conversation 0: most recent, and pinned
    r.cache.pin(ck[2])
    r.cache.unpin(ck[2])  # conversation 2 was used after conversation 1
    assert r.cache.reclaimable_pages() == 4  # 1's and 2's pages; 0 is pinned
    assert r.cache.evict_pages(4)  # 2 free + 2 from the least recent leaf: conversation 1
    r.check()
    assert [c.length for c in r.cache.checkpoints()] == [8, 8] and r.cache.checkpoints() == [ck[0], ck[2]]
    assert r.pool.free == 4 and list(r.pool._free)[-2:] == [3, 4]
    # Asking for more than could ever be freed evicts nothing.
    assert not r.cache.evict_pages(7)
    assert r.cache.checkpoints() == [ck[0], ck[2]] and r.cache.evicted_for_pages == 1
    assert r.cache.evict_pages(6)  # conversation 2 goes; 0 stays pinned
    assert r.cache.checkpoints() == [ck[0]] and r.pool.free == 6
    r.cache.unpin(ck[0])
    r.check()


def test_page_pressure_keeps_ancestors_of_pinned_and_frees_shared_pages_only_when_unheld():
    r = Rig(pages=12, rows=4)
    a = toks(20)
    req = r.pool.allocate(5)  # still running: holds pages 1..5
    c4 = r.publish(a, 4, req)
    c8 = r.publish(a, 8, req, parent=c4)
    c12 = r.publish(a, 12, req, parent=c8)
    r.cache.pin(c8)
    # c12 is the only unprotected checkpoint, and its page is still held by the request.
    assert r.cache.reclaimable_pages() == 0
    assert not r.cache.evict_pages(r.pool.free + 1)
    r.pool.release(req)
    assert r.cache.reclaimable_pages() == 1  # page 3 (c12's segment)
    assert r.cache.evict_pages(r.pool.free + 1)
    assert r.cache.checkpoints() == [c4, c8] and c8.children == []
    r.check()
    assert c12.length == 12 and r.match(a) == 8


# ---------------------------------------------------------------------------
# Snapshot-row pressure: thinning


def _chain(r: Rig, tokens, lengths, pages, parent=None):
    out = []
    for n in lengths:
        parent = r.publish(tokens, n, pages, parent=parent)
        out.append(parent)
    return out


def test_snapshot_pressure_thins_interior_checkpoints_shortest_interval_first():
    r = Rig(pages=32, rows=4)
    a = toks(60)
    req = r.pool.allocate(15)
    c8, c12, c30, c40 = _chain(r, a, (8, 12, 30, 40), req)
    r.pool.release(req)
    assert r.cache.rows.free == 0
    # Removable (exactly one child, no pin): c8 (a root), c12, c30. Interior first, and
    # the surviving neighbours' interval: c12 -> 30 - 8 = 22, c30 -> 40 - 12 = 28.
    row = r.cache.acquire_row()
    assert row == c12.row and r.cache.thinned == 1
    r.check()
    assert r.cache.checkpoints() == [c8, c30, c40]
    # The child took the segment: chains, ids and rows of descendants are unchanged.
    assert c30.parent is c8 and c30.segment == [3, 4, 5, 6, 7] and r.cache.chain(c40) == list(range(1, 11))
    assert r.match(a[:29]) == 8  # the removed prefix no longer matches
    # Next (row 2 still taken by the snapshot that asked for it): c30 (interior,
    # 40 - 8 = 32) before the root c8.
    assert r.cache.acquire_row() == c30.row
    assert r.cache.checkpoints() == [c8, c40] and c40.segment == [3, 4, 5, 6, 7, 8, 9, 10]
    r.check()
    # Then the root (its child inherits everything), then only the leaf is left: evicted.
    assert r.cache.acquire_row() == c8.row and r.cache.checkpoints() == [c40] and c40.parent is None
    assert c40.segment == list(range(1, 11)) and r.cache.thinned == 3
    assert r.cache.acquire_row() == c40.row and len(r.cache) == 0 and r.cache.evicted_for_rows == 1
    assert r.pool.free == 31
    r.check()


def test_thinning_ties_break_by_least_recent_use_and_spare_pinned():
    r = Rig(pages=40, rows=5)
    a = toks(60)
    req = r.pool.allocate(15)
    c10, c20, c30, c40, c50 = _chain(r, a, (10, 20, 30, 40, 50), req)
    # Intervals: c20, c30, c40 -> 20 each. Pin c30; touch c20 after c40.
    r.cache.pin(c30)
    r.cache.pin(c20)
    r.cache.unpin(c20)
    row = r.cache.acquire_row()
    assert row == c40.row  # equal interval, least recently used, unpinned
    assert r.cache.checkpoints() == [c10, c20, c30, c50]
    r.check()


def test_snapshot_pressure_evicts_lru_leaf_when_nothing_can_be_thinned():
    r = Rig(pages=16, rows=2)
    x, y = toks(9, salt=1), toks(9, salt=2)
    cx = r.publish(x, 8, r.pool.allocate(2))
    cy = r.publish(y, 8, r.pool.allocate(2))
    r.cache.pin(cy)
    row = r.cache.acquire_row()
    assert row == cx.row and r.cache.evicted_for_rows == 1 and r.cache.checkpoints() == [cy]
    # Pinned everywhere: no row, and the caller continues without publishing.
    assert r.cache.acquire_row() is None
    r.cache.release_row(row)
    r.check()


def test_retired_rows_wait_for_outstanding_device_use():
    rows = RowPool(2)
    a, b = rows.allocate(), rows.allocate()
    assert (a, b, rows.allocate()) == (1, 2, None)
    rows.begin_use(a)  # a restore reading row 1 is queued
    rows.retire(a)  # its checkpoint is evicted meanwhile
    assert rows.free == 0 and rows.in_use(a)
    rows.check_integrity()
    rows.end_use(a)
    assert rows.free == 1 and rows.allocate() == 1
    with pytest.raises(ValueError, match="end of device use of idle"):
        rows.end_use(b)
    with pytest.raises(ValueError, match="retire of unowned"):
        rows.retire(RowPool(3).allocate() + 2)
    rows.check_integrity()


def test_busy_rows_are_never_chosen_for_eviction():
    r = Rig(pages=16, rows=1)
    c = r.publish(toks(9), 8, r.pool.allocate(2))
    r.cache.rows.begin_use(c.row)
    assert r.cache.acquire_row() is None and len(r.cache) == 1
    r.cache.rows.end_use(c.row)
    assert r.cache.acquire_row() == c.row and len(r.cache) == 0
    r.check()


def test_integrity_detects_corruption():
    r = Rig()
    c = r.publish(toks(9), 8, r.pool.allocate(2))
    c.segment.append(7)  # a free page in a segment, and a chain longer than the length says
    with pytest.raises(AssertionError, match="chain of 3 pages for 8 tokens"):
        r.cache.check_integrity()
    c.segment.pop()
    c.pins = -1
    with pytest.raises(AssertionError, match="bad pin count"):
        r.cache.check_integrity()
    c.pins = 0
    with pytest.raises(CacheError, match="unpin of unpinned"):
        r.cache.unpin(c)
    r.check()


# ---------------------------------------------------------------------------
# Capture placement


@pytest.mark.parametrize("rows,slots,budget", [(0, 4, 0), (3, 4, 1), (4, 4, 1), (16, 4, 4), (64, 4, 8), (9, 1, 8)])
def test_snapshot_budget(rows, slots, budget):
    assert snapshot_budget(rows, slots) == budget


def test_plan_reserves_terminal_then_prompt():
    kw = dict(reused=0, prompt_len=100, endpoints=(20, 40, 60, 80))
    assert plan_snapshots(budget=0, max_tokens=5, **kw) == SnapshotPlan((), False, False)
    assert plan_snapshots(budget=1, max_tokens=5, **kw) == SnapshotPlan((), False, True)
    assert plan_snapshots(budget=2, max_tokens=5, **kw) == SnapshotPlan((), True, True)
    # A single output token: the terminal endpoint is the prompt endpoint, and the spare
    # snapshot goes to the message endpoint nearest the middle (a 40/60 tie: the earlier).
    assert plan_snapshots(budget=2, max_tokens=1, **kw) == SnapshotPlan((40,), False, True)
    assert plan_snapshots(budget=6, max_tokens=5, **kw) == SnapshotPlan((20, 40, 60, 80), True, True)
    # A full-prompt hit snapshots no prompt or message endpoint.
    assert plan_snapshots(budget=8, max_tokens=5, reused=100, prompt_len=100, endpoints=(20,)) == \
        SnapshotPlan((), False, True)


def test_plan_selects_only_the_uncached_suffix_and_spreads_targets():
    ends = (5, 12, 30, 31, 44, 58, 70, 90, 97)
    # Everything after the reused prefix fits: all of it.
    assert plan_snapshots(budget=5, reused=58, prompt_len=100, max_tokens=9, endpoints=ends).messages == (70, 90, 97)
    # Three slots over (0, 100): targets 25, 50, 75 -> 30 (|5|), 44 (|6|, not 58 at |8|), 70.
    assert plan_snapshots(budget=5, reused=0, prompt_len=100, max_tokens=9, endpoints=ends).messages == (30, 44, 70)
    # Ties choose the earlier endpoint: target 50 between 44 and 56.
    assert plan_snapshots(budget=3, reused=0, prompt_len=100, max_tokens=9, endpoints=(44, 56, 99)).messages == (44,)
    # Targets that pick the same endpoint are deduplicated: 20, 40, 60, 80 -> 3, 50, 50, 97.
    assert plan_snapshots(budget=6, reused=0, prompt_len=100, max_tokens=9, endpoints=(3, 50, 97, 98, 99)
                         ).messages == (3, 50, 97)
    # Endpoints at or before the reused prefix, and the prompt end itself, are never message snapshots.
    assert plan_snapshots(budget=8, reused=30, prompt_len=90, max_tokens=9, endpoints=(10, 30, 60, 90)
                         ).messages == (60,)
