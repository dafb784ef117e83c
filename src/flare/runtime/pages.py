"""KV page and request-slot ownership.

Pages are reference-counted so the prefix cache and several requests can
share immutable pages; a page returns to the free list when its last
reference is dropped. Page 0 is the null page and slot 0 the null slot: they
are never handed out (padded rows of every program read and write only there).

Free pages are kept in a FIFO: allocation takes the oldest freed page, so page
ids are deterministic for a given sequence of operations (tests assert them).
"""

from __future__ import annotations

from collections import deque
from typing import NewType

PageId = NewType("PageId", int)
SlotId = NewType("SlotId", int)


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
