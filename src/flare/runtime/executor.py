"""The executor interface: how the scheduler drives prepared programs.

Two implementations share it: the reference executor (eager torch in a worker
subprocess over a shared-memory arena) and the CUDA graph executor (cuda-python
replay of exported graphs). The scheduler and server never know which one runs.

Ordering contract: ``write`` is ordered after every previously submitted
program and before every later one; ``read`` returns what the last completed
program left in an output buffer. Programs execute in submission order.

``submit`` returns a ticket, ``wait(ticket)`` waits for that program (and every
earlier one), and ``completion(ticket)`` is the host copy of the completion
buffer (the manifest's ``completion`` of its program) as that very program left
it, even when a later program has already overwritten the buffer on the device,
for the last ``MAX_IN_FLIGHT`` submissions (the engine keeps at most that many
in flight; a benchmark may queue more and read none).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from flare.core.errors import ExecutionError
from flare.core.manifest import DType, Manifest

NUMPY_DTYPES = {
    DType.float32: np.float32,
    DType.float16: np.float16,
    DType.bfloat16: np.uint16,  # raw bits: the runtime never does bfloat16 arithmetic
    DType.int32: np.int32,
    DType.int64: np.int64,
    DType.uint8: np.uint8,
}


MAX_IN_FLIGHT = 2


def check_row(buffer: str, shape: tuple[int, ...], row) -> None:
    """A row write (``row``: a row index, or (row, slice of the last dimension)) inside the
    buffer's shape: a device write past it would land in the next row or buffer."""
    r, sl = row if isinstance(row, tuple) else (row, None)
    if isinstance(r, slice):
        return
    inside = 0 <= r < shape[0] and (sl is None or 0 <= sl.start <= sl.stop <= shape[-1])
    if not inside:
        where = f"[{r}, {sl.start}:{sl.stop}]" if sl is not None else f"[{r}]"
        raise ExecutionError(f"a write of {buffer}{where} lies outside its shape {tuple(shape)}", code="bad_write")


class Executor(Protocol):
    manifest: Manifest

    async def start(self) -> None:
        """Load the core; after this returns no allocation, module load or graph
        instantiation happens until close()."""

    async def close(self) -> None: ...

    def write(self, buffer: str, value: np.ndarray, row: int | slice | None = None) -> None:
        """Stage ``value`` into ``buffer`` (or one of its rows)."""

    def submit(self, program: str) -> int:
        """Launch a program; its inputs are what was written before. Returns its ticket
        (tickets count submissions from 0)."""

    async def wait(self, ticket: int | None = None) -> None:
        """Wait until the program with ``ticket`` (default: every submitted program) and
        every earlier one have completed; raises ExecutionError."""

    def completion(self, ticket: int) -> np.ndarray:
        """The completion record the program with ``ticket`` wrote, after ``wait(ticket)``,
        while it is among the last MAX_IN_FLIGHT submissions."""

    def read(self, buffer: str) -> np.ndarray:
        """A host copy of an output buffer after wait()."""

    def stats(self) -> dict[str, int]:
        """Counters (programs launched, device allocations after readiness, ...)."""
