"""Host staging space for asynchronous host-to-device copies, reclaimed per program.

The CUDA executor copies every write through one pinned buffer: the bytes are
placed there and a copy is queued on the stream. A region can be reused once
that copy has run, which the executor knows only when a later event completes.
With two programs in flight the stream never drains while a decode batch stays
ahead, so instead of rewinding when nothing is in flight, the ring reclaims
what each completed program's writes used: bytes staged before ``submitted(t)``
are free once ``completed(t)``. Positions are counted monotonically (``head``
and ``tail``); a region never wraps around the end of the buffer, the rest of
the lap is skipped instead. Pure bookkeeping, no CUDA, so it is tested alone.
"""

from __future__ import annotations

from collections import deque

ALIGN = 256


class StagingRing:
    def __init__(self, size: int):
        self.size = size
        self.head = 0  # next byte to hand out (monotonic)
        self.tail = 0  # oldest byte possibly still read by a queued copy (monotonic)
        self._marks: deque[tuple[int, int]] = deque()  # (ticket, head when it was submitted)

    def alloc(self, n: int) -> int | None:
        """Offset of ``n`` free bytes, or None when the ring is full of bytes whose
        copies may not have run (the caller waits for the stream, then ``drain``)."""
        n = -(-n // ALIGN) * ALIGN
        if n > self.size:
            raise ValueError(f"{n} bytes do not fit a staging ring of {self.size}")
        pos = self.head % self.size
        skip = self.size - pos if pos + n > self.size else 0
        if self.head + skip + n - self.tail > self.size:
            return None
        self.head += skip
        offset = self.head % self.size
        self.head += n
        return offset

    def submitted(self, ticket: int) -> None:
        """A program was queued: every byte handed out so far is read before it runs."""
        self._marks.append((ticket, self.head))

    def completed(self, ticket: int) -> None:
        """Program ``ticket`` (and every earlier one) ran: their writes' bytes are free."""
        while self._marks and self._marks[0][0] <= ticket:
            self.tail = self._marks.popleft()[1]

    def drain(self) -> None:
        """The stream is idle: every queued copy has run. The next lap starts empty."""
        self._marks.clear()
        self.head = self.tail = -(-self.head // self.size) * self.size

    @property
    def in_use(self) -> int:
        return self.head - self.tail
