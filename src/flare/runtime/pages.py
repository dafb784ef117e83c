"""KV page, request-slot and snapshot-row ownership.

Pages are reference-counted so the prefix cache and several requests can
share immutable pages; a page returns to the free list when its last
reference is dropped. Page 0 is the null page, slot 0 the null slot and
snapshot row 0 the null row: they are never handed out (padded rows of every
program read and write only there).

Free pages are kept in a FIFO: allocation takes the oldest freed page, so page
ids are deterministic for a given sequence of operations (tests assert them).

Snapshot rows separate the logical owner (a checkpoint, or a snapshot that is
not published yet) from outstanding device use (submitted or queued programs
that read or write the row): a row becomes reusable only when both have ended
(the original design: "Track logical references separately from outstanding GPU use";
docs/prefix-cache.md). Pages
need no such count today because the scheduler changes page ownership only at
submission boundaries, when nothing that reads a page is in flight or queued.
"""

from __future__ import annotations

from collections import deque
from typing import NewType

PageId = NewType("PageId", int)
SlotId = NewType("SlotId", int)
RowId = NewType("RowId", int)


def window_released(position: int, window: int, page_size: int) -> int:
    """How many of a slot's first pages a query at ``position`` and every later one never read under
    a sliding window of ``window`` tokens (keys at positions > position - window), less one page kept
    as margin: the pages ``Scheduler._release_window`` gives back."""
    return max(0, (position - window + 1) // page_size - 1)


class PoolExhausted(Exception):
    """Not enough free pages / slots right now (the caller decides: wait, evict, preempt)."""


class PagePool:
    def __init__(self, num_pages: int, null_page: int = 0):
        if num_pages < 2:
            raise ValueError("a page pool needs the null page and at least one page")
        self.num_pages = num_pages
        self.null_page = PageId(null_page)
        self._refs = [0] * num_pages
        self._free: deque[PageId] = deque(PageId(p) for p in range(num_pages) if p != null_page)

    @property
    def total(self) -> int:
        """Pages that can ever be allocated (the null page excluded)."""
        return self.num_pages - 1

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.total - self.free

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[PageId]:
        if n > len(self._free):
            raise PoolExhausted(f"need {n} pages, {len(self._free)} free")
        out = [self._free.popleft() for _ in range(n)]
        for p in out:
            self._refs[p] = 1
        return out

    def retain(self, pages: list[PageId]) -> None:
        for p in pages:
            if self._refs[p] <= 0:
                raise ValueError(f"retain of free page {p}")
            self._refs[p] += 1

    def release(self, pages: list[PageId]) -> None:
        for p in pages:
            if self._refs[p] <= 0:
                raise ValueError(f"release of free page {p}")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)

    def retain_held(self, pages: list[PageId]) -> None:
        """``retain`` of a request's or a checkpoint's pages: their null entries (pages given back when
        they left every layer's sliding window, ``Scheduler._release_window``) are nobody's."""
        self.retain([p for p in pages if p != self.null_page])

    def release_held(self, pages: list[PageId]) -> None:
        """``release`` of a request's or a checkpoint's pages, their null entries skipped."""
        self.release([p for p in pages if p != self.null_page])

    def refcount(self, page: PageId) -> int:
        return self._refs[page]

    def check_integrity(self) -> None:
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a page is on the free list twice")
        if self.null_page in free or self._refs[self.null_page] != 0:
            raise AssertionError("the null page was handed out")
        for p in range(self.num_pages):
            if p == self.null_page:
                continue
            if (self._refs[p] == 0) != (p in free):
                raise AssertionError(f"page {p}: refcount {self._refs[p]} disagrees with the free list")


class SlotPool:
    """Request slots 1..n (0 is the null slot)."""

    def __init__(self, slots: int):
        self.total = slots
        self._free: deque[SlotId] = deque(SlotId(s) for s in range(1, slots + 1))
        self._used: set[SlotId] = set()

    @property
    def free(self) -> int:
        return len(self._free)

    def allocate(self) -> SlotId:
        if not self._free:
            raise PoolExhausted("no free request slot")
        s = self._free.popleft()
        self._used.add(s)
        return s

    def release(self, slot: SlotId) -> None:
        if slot not in self._used:
            raise ValueError(f"release of free slot {slot}")
        self._used.remove(slot)
        self._free.append(slot)

    def check_integrity(self) -> None:
        if len(self._free) + len(self._used) != self.total or set(self._free) & self._used:
            raise AssertionError("slot accounting is inconsistent")
        if 0 in self._used or 0 in self._free:
            raise AssertionError("the null slot was handed out")


class RowPool:
    """Snapshot rows 1..n (0 is the null row), FIFO like the page pool."""

    def __init__(self, rows: int):
        if rows < 0:
            raise ValueError("a row pool cannot have a negative size")
        self.total = rows
        self._free: deque[RowId] = deque(RowId(r) for r in range(1, rows + 1))
        self._owned: set[RowId] = set()  # held by a logical owner
        self._uses: dict[RowId, int] = {}  # outstanding device uses (owned or retired)

    @property
    def free(self) -> int:
        return len(self._free)

    def allocate(self) -> RowId | None:
        if not self._free:
            return None
        r = self._free.popleft()
        self._owned.add(r)
        return r

    def retire(self, row: RowId) -> None:
        """The logical owner is gone; the row is free once no device use remains."""
        if row not in self._owned:
            raise ValueError(f"retire of unowned snapshot row {row}")
        self._owned.remove(row)
        if not self._uses.get(row):
            self._free.append(row)

    def begin_use(self, row: RowId) -> None:
        if row not in self._owned:
            raise ValueError(f"device use of unowned snapshot row {row}")
        self._uses[row] = self._uses.get(row, 0) + 1

    def end_use(self, row: RowId) -> None:
        n = self._uses.get(row, 0)
        if n <= 0:
            raise ValueError(f"end of device use of idle snapshot row {row}")
        if n == 1:
            del self._uses[row]
            if row not in self._owned:
                self._free.append(row)
        else:
            self._uses[row] = n - 1

    def in_use(self, row: RowId) -> bool:
        return bool(self._uses.get(row))

    def is_owned(self, row: RowId) -> bool:
        return row in self._owned

    def check_integrity(self) -> None:
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a snapshot row is on the free list twice")
        if 0 in free or 0 in self._owned or 0 in self._uses:
            raise AssertionError("the null snapshot row was handed out")
        busy = self._owned | set(self._uses)
        if free & busy or len(free) + len(busy) != self.total:
            raise AssertionError("snapshot row accounting is inconsistent")
