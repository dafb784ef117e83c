"""The CUDA executor's staging ring (flare.runtime.staging), without CUDA: a simulated
stream of writes, launches and completions with two programs in flight must never
hand out bytes that a queued copy may still read, and must not stall a steady
pipeline (the ring keeps going without ever draining)."""

from __future__ import annotations

import random

import pytest

from flare.runtime.staging import ALIGN, StagingRing


class Pipeline:
    """The engine's pattern: stage writes, launch N+1, then N completes. Tracks which
    regions a queued copy may still read and checks every new region against them."""

    def __init__(self, ring: StagingRing):
        self.ring = ring
        self.live: dict[int, list[tuple[int, int]]] = {}  # ticket -> regions its copies read
        self.pending: list[tuple[int, int]] = []  # staged for the next launch
        self.ticket = 0

    def stage(self, n: int) -> int | None:
        off = self.ring.alloc(n)
        if off is None:
            return None
        region = (off, off + -(-n // ALIGN) * ALIGN)
        assert region[1] <= self.ring.size
        for a, b in [r for regions in [*self.live.values(), self.pending] for r in regions]:
            assert region[1] <= a or b <= region[0], (self.ticket, region, (a, b))
        self.pending.append(region)
        return off

    def drain(self) -> None:
        """The executor waits for the stream: every queued copy has run, those of the
        writes staged for the next launch too."""
        self.ring.drain()
        self.live.clear()
        self.pending.clear()

    def launch(self) -> None:
        self.live[self.ticket], self.pending = self.pending, []
        self.ring.submitted(self.ticket)
        if self.ticket - 1 in self.live:
            self.ring.completed(self.ticket - 1)
            del self.live[self.ticket - 1]
        self.ticket += 1


def test_steady_two_in_flight_never_fills_and_never_overlaps():
    p = Pipeline(StagingRing(1024 * ALIGN))  # laps every ~100 steps; at most ~150 units in use
    rng = random.Random(0)
    for step in range(20000):
        for _ in range(rng.randint(1, 3)):
            assert p.stage(rng.choice([16, 256, 300, 1024, 4096])) is not None, step  # never a drain
        p.launch()
    assert p.ring.in_use <= p.ring.size


@pytest.mark.parametrize("seed", range(5))
def test_tight_ring_reuses_only_what_completed(seed):
    """A ring barely larger than two steps' writes: regions are reused as soon as their
    program completes, never earlier; when it is full, a drain completes everything."""
    rng = random.Random(seed)
    p = Pipeline(StagingRing(12 * ALIGN))
    drains, reused, seen = 0, 0, set()
    for _ in range(5000):
        for _ in range(rng.randint(1, 2)):
            n = rng.randint(1, 3) * ALIGN
            off = p.stage(n)
            if off is None:
                p.drain()
                drains += 1
                off = p.stage(n)
            reused += off in seen
            seen.add(off)
        p.launch()
    assert reused > 1000 and drains < 500


def test_full_ring_asks_for_a_drain():
    ring = StagingRing(4 * ALIGN)
    assert [ring.alloc(ALIGN) for _ in range(4)] == [0, ALIGN, 2 * ALIGN, 3 * ALIGN]
    ring.submitted(0)
    assert ring.alloc(1) is None  # every byte may still be read by ticket 0's copies
    ring.completed(0)
    assert ring.alloc(2 * ALIGN) == 0  # the lap wraps to the start
    ring.submitted(1)
    assert ring.alloc(3 * ALIGN) is None  # 2 * ALIGN at the end are free, but not contiguous
    ring.drain()
    assert ring.in_use == 0 and ring.alloc(3 * ALIGN) == 0


def test_region_never_wraps_and_oversize_is_refused():
    ring = StagingRing(10 * ALIGN)
    assert ring.alloc(8 * ALIGN) == 0
    ring.submitted(0)
    ring.completed(0)
    assert ring.alloc(4 * ALIGN) == 0  # the 2 * ALIGN left before the end are skipped
    with pytest.raises(ValueError):
        ring.alloc(11 * ALIGN)
