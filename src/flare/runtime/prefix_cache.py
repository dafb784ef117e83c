"""The prefix cache: immutable, content-addressed conversation checkpoints.

A checkpoint at consumed count ``S`` is a chain of complete KV pages covering
tokens ``[0, S - S % page_size)`` plus one snapshot row (the continuation
state and a copy of the partial tail page, written by the ``snapshot``
program). Chains share their prefix: each checkpoint owns only its *segment*,
the complete pages after its parent's, and holds one page-pool reference on
each. A page therefore lies in at most one segment::

    A  S=40   segment [p1 p2]            chain(A) = p1 p2          (tail: row of A)
    └ B  S=100  segment [p3 p4 p5 p6]      chain(B) = p1 .. p6
      ├ C  S=130  segment [p7 p8]          chain(C) = p1 .. p6 p7 p8
      └ D  S=120  segment [p9]             a branch: its own private pages

Identity: chained digests over fixed 64-token blocks seeded with the model
fingerprint, ``d[0] = H(fingerprint)``, ``d[k+1] = H(d[k] || block k)``; a checkpoint's
key is ``(d[S // 64], tokens[64 * (S // 64) : S])``, independent of the page
size. Equal endpoints have equal keys and share one checkpoint.

Ownership: requests *pin* the checkpoint their pages extend (the one they
restored or last published); pinned checkpoints and their ancestors stay.
Under page pressure the least recently used unpinned leaf is evicted (its
segment pages return to the pool when no request holds them) until enough
pages are free. Under snapshot-row pressure chains are *thinned* first: an
unpinned checkpoint with exactly one child hands its segment to that child and
gives up only its row (interior checkpoints before roots, shortest surviving
interval first, then least recently used); when nothing can be thinned the
least recently used unpinned leaf goes. Removing an ancestor frees no page, so
page pressure retires leaves only. Snapshot rows come from a ``RowPool`` that
keeps a retired row until its outstanding device uses end.

The cache never branches on model identity: page size, row count and the
fingerprint come from the manifest.
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass, field
from typing import NewType, Sequence

import numpy as np

from flare.runtime.pages import PageId, PagePool, RowId, RowPool

BLOCK_TOKENS = 64
CheckpointId = NewType("CheckpointId", int)
Key = tuple[bytes, tuple[int, ...]]


def _h(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


class PrefixDigests:
    """Block digests of one token sequence, computed lazily (a request's history
    grows; digests of earlier blocks never change)."""

    def __init__(self, fingerprint: bytes):
        self._blocks = [_h(b"flare-prefix\0" + fingerprint)]

    def block(self, tokens: Sequence[int], k: int) -> bytes:
        """``d[k]``: the digest of ``tokens[: 64 * k]``."""
        if 64 * k > len(tokens):
            raise ValueError(f"block {k} lies beyond the {len(tokens)} tokens")
        first = len(self._blocks) - 1
        if first < k:  # one conversion for every missing block, then one hash per block
            data = np.asarray(tokens[BLOCK_TOKENS * first : BLOCK_TOKENS * k], dtype="<i4").tobytes()
            step = 4 * BLOCK_TOKENS
            for j in range(k - first):
                self._blocks.append(_h(self._blocks[-1] + data[step * j : step * (j + 1)]))
        return self._blocks[k]

    def key(self, tokens: Sequence[int], length: int) -> Key:
        k = length // BLOCK_TOKENS
        return self.block(tokens, k), tuple(tokens[BLOCK_TOKENS * k : length])


@dataclass(eq=False)
class Checkpoint:
    """A published endpoint. An opaque handle outside this module: callers read
    ``length`` and ``row`` and pass it back, nothing else."""

    id: CheckpointId
    length: int  # consumed tokens the checkpoint describes
    key: Key
    row: RowId
    parent: "Checkpoint | None"
    segment: list[PageId]
    children: list["Checkpoint"] = field(default_factory=list)
    pins: int = 0
    last_use: int = 0

    @property
    def complete_pages(self) -> int:
        return (self.parent.complete_pages if self.parent else 0) + len(self.segment)

    def __repr__(self) -> str:
        return f"Checkpoint({self.id}, S={self.length}, row={self.row}, pins={self.pins})"


class CacheError(Exception):
    """A caller broke the cache's contract (a bug, never a request error)."""


class PrefixCache:
    def __init__(self, pages: PagePool, rows: int, page_size: int, fingerprint: bytes):
        self.pool = pages
        self.rows = RowPool(rows)
        self.page_size = page_size
        self.fingerprint = fingerprint
        self._by_key: dict[Key, Checkpoint] = {}
        self._buckets: dict[bytes, list[Checkpoint]] = {}
        self._ids = itertools.count(1)
        self._clock = 0
        # Counters (reported as metrics; pressure is reported per resource).
        self.published = 0
        self.duplicates = 0
        self.evicted_for_pages = 0
        self.evicted_for_rows = 0
        self.thinned = 0

    # -- lookup ------------------------------------------------------------

    def digests(self) -> PrefixDigests:
        return PrefixDigests(self.fingerprint)

    def match(self, tokens: Sequence[int], digests: PrefixDigests) -> Checkpoint | None:
        """The deepest checkpoint whose tokens prefix ``tokens`` (length <= len(tokens))."""
        n = len(tokens)
        for k in range(n // BLOCK_TOKENS, -1, -1):
            bucket = self._buckets.get(digests.block(tokens, k))
            if not bucket:
                continue
            base = BLOCK_TOKENS * k
            best = None
            for c in bucket:
                if c.length <= n and (best is None or c.length > best.length) \
                        and c.key[1] == tuple(tokens[base : c.length]):
                    best = c
            if best is not None:
                return best
        return None

    def chain(self, c: Checkpoint) -> list[PageId]:
        """Every complete page of ``c`` in token order."""
        segments = []
        while c is not None:
            segments.append(c.segment)
            c = c.parent
        return [p for seg in reversed(segments) for p in seg]

    def checkpoints(self) -> list[Checkpoint]:
        return sorted(self._by_key.values(), key=lambda c: c.id)

    def __len__(self) -> int:
        return len(self._by_key)

    def __contains__(self, key: Key) -> bool:
        """An endpoint with this key is published."""
        return key in self._by_key

    def cached_pages(self) -> set[PageId]:
        """The pages checkpoints hold (a segment's null entries, pages its request released when they
        left every layer's sliding window, are none)."""
        return {p for c in self._by_key.values() for p in c.segment if p != self.pool.null_page}

    # -- publication and pins ------------------------------------------------

    def insert(self, tokens: Sequence[int], digests: PrefixDigests, length: int, row: RowId,
               parent: Checkpoint | None, pages: Sequence[PageId]) -> Checkpoint | None:
        """Publish the endpoint ``tokens[:length]`` whose snapshot copy into ``row`` has
        completed. ``pages`` are the publishing request's pages in token order and
        extend ``parent``'s chain (the checkpoint the request restored or last
        published). Returns None for a duplicate: the caller keeps its row and
        pages, and the existing checkpoint stays as it is."""
        key = digests.key(tokens, length)
        if key in self._by_key:
            self.duplicates += 1
            return None
        if not self.rows.is_owned(row):
            raise CacheError(f"publication into snapshot row {row}, which nobody owns")
        base = parent.complete_pages if parent else 0
        own = length // self.page_size
        if parent is not None and (parent.length > length or self._by_key.get(parent.key) is not parent
                                   or self.chain(parent) != list(pages[:base])):
            raise CacheError(f"{parent} is not the published prefix of this request's pages")
        if len(pages) < own:
            raise CacheError(f"an endpoint at {length} needs {own} complete pages, the request holds {len(pages)}")
        segment = list(pages[base:own])
        self.pool.retain_held(segment)
        c = Checkpoint(CheckpointId(next(self._ids)), length, key, row, parent, segment)
        if parent is not None:
            parent.children.append(c)
        self._by_key[key] = c
        self._buckets.setdefault(key[0], []).append(c)
        self._touch(c)
        self.published += 1
        return c

    def pin(self, c: Checkpoint) -> None:
        self._check_live(c)
        c.pins += 1
        self._touch(c)

    def unpin(self, c: Checkpoint) -> None:
        self._check_live(c)
        if c.pins <= 0:
            raise CacheError(f"unpin of unpinned {c}")
        c.pins -= 1

    def release_row(self, row: RowId) -> None:
        """Give back a row acquired for a snapshot that was not published."""
        self.rows.retire(row)

    # -- eviction ------------------------------------------------------------

    def acquire_row(self) -> RowId | None:
        """A snapshot row for a new snapshot, thinning chains and then evicting the least
        recently used unpinned leaf when none is free. None when every row is pinned
        or busy: the caller continues without publishing."""
        row = self.rows.allocate()
        while row is None:
            victim = self._thinning_candidate()
            if victim is not None:
                self._thin(victim)
                self.thinned += 1
            else:
                leaf = self._lru_leaf()
                if leaf is None:
                    return None
                self._remove_leaf(leaf)
                self.evicted_for_rows += 1
            row = self.rows.allocate()
        return row

    def reclaimable_pages(self) -> int:
        """Pages that evicting every unprotected checkpoint would free: segment pages no
        request holds, outside pinned checkpoints and their ancestors."""
        protected = set()
        for c in self._by_key.values():
            if c.pins:
                while c is not None and c.id not in protected:
                    protected.add(c.id)
                    c = c.parent
        return sum(1 for c in self._by_key.values() if c.id not in protected
                   for p in c.segment if self.pool.refcount(p) == 1)

    def evict_pages(self, need: int) -> bool:
        """Evict least recently used unpinned leaves until ``need`` pages are free.
        Evicts nothing when even evicting everything evictable could not get there."""
        if self.pool.free + self.reclaimable_pages() < need:
            return False
        while self.pool.free < need:
            leaf = self._lru_leaf()
            if leaf is None:
                break
            self._remove_leaf(leaf)
            self.evicted_for_pages += 1
        return self.pool.free >= need

    # -- internals -----------------------------------------------------------

    def _touch(self, c: Checkpoint) -> None:
        self._clock += 1
        c.last_use = self._clock

    def _check_live(self, c: Checkpoint) -> None:
        if self._by_key.get(c.key) is not c:
            raise CacheError(f"{c} is not in the cache")

    def _lru_leaf(self) -> Checkpoint | None:
        leaves = [c for c in self._by_key.values()
                  if not c.children and not c.pins and not self.rows.in_use(c.row)]
        return min(leaves, key=lambda c: c.last_use) if leaves else None

    def _thinning_candidate(self) -> Checkpoint | None:
        def interval(c: Checkpoint) -> int:
            return c.children[0].length - (c.parent.length if c.parent else 0)

        removable = [c for c in self._by_key.values()
                     if len(c.children) == 1 and not c.pins and not self.rows.in_use(c.row)]
        if not removable:
            return None
        return min(removable, key=lambda c: (c.parent is None, interval(c), c.last_use))

    def _unindex(self, c: Checkpoint) -> None:
        del self._by_key[c.key]
        bucket = self._buckets[c.key[0]]
        bucket.remove(c)
        if not bucket:
            del self._buckets[c.key[0]]

    def _remove_leaf(self, c: Checkpoint) -> None:
        self._unindex(c)
        if c.parent is not None:
            c.parent.children.remove(c)
        self.pool.release_held(c.segment)
        self.rows.retire(c.row)

    def _thin(self, a: Checkpoint) -> None:
        """Bypass ``a``: its only child inherits its segment and parent; descendants'
        chains, ids and rows are unchanged, and ``a``'s prefix no longer matches."""
        (child,) = a.children
        child.segment = a.segment + child.segment
        child.parent = a.parent
        if a.parent is not None:
            siblings = a.parent.children
            siblings[siblings.index(a)] = child
        self._unindex(a)
        self.rows.retire(a.row)

    # -- invariants ----------------------------------------------------------

    def check_integrity(self) -> None:
        self.rows.check_integrity()
        seen_pages: set[PageId] = set()
        rows = set()
        for key, c in self._by_key.items():
            if c.key != key or c not in self._buckets.get(key[0], ()):
                raise AssertionError(f"{c} is indexed under the wrong key")
            if c.complete_pages != c.length // self.page_size:
                raise AssertionError(f"{c}: chain of {c.complete_pages} pages for {c.length} tokens")
            if c.parent is not None and (c.parent.length > c.length or c not in c.parent.children
                                         or self._by_key.get(c.parent.key) is not c.parent):
                raise AssertionError(f"{c}: broken parent link")
            if any(ch.parent is not c for ch in c.children):
                raise AssertionError(f"{c}: broken child link")
            if c.pins < 0 or not self.rows.is_owned(c.row) or c.row in rows:
                raise AssertionError(f"{c}: bad pin count or snapshot row")
            rows.add(c.row)
            for p in c.segment:
                if p == self.pool.null_page:  # released out of every layer's window before publication
                    continue
                if p in seen_pages:
                    raise AssertionError(f"page {p} lies in two checkpoint segments")
                if self.pool.refcount(p) < 1:
                    raise AssertionError(f"page {p} of {c} is free")
                seen_pages.add(p)
        if sum(len(b) for b in self._buckets.values()) != len(self._by_key):
            raise AssertionError("bucket index and key index disagree")
