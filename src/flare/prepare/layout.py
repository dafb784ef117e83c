"""Arena planning: place every buffer a program can touch at a fixed offset.

Torch-free. The plan is the manifest's ``buffers`` list; preparation creates
views at these offsets and the runtime recreates the same views from the
manifest alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flare.core.manifest import Buffer, BufferRole, DType

ALIGNMENT = 256
# Roles are laid out in this order (see the arena map in flare.core.manifest).
_ROLE_ORDER = (
    BufferRole.weight,
    BufferRole.kv,
    BufferRole.state,
    BufferRole.snapshot,
    BufferRole.input,
    BufferRole.output,
    BufferRole.scratch,
)


@dataclass(frozen=True)
class BufferRequest:
    name: str
    role: BufferRole
    dtype: DType
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def align(n: int, a: int = ALIGNMENT) -> int:
    return (n + a - 1) // a * a


def plan(requests: list[BufferRequest], *, alignment: int = ALIGNMENT, tail: int = 0) -> tuple[tuple[Buffer, ...], int]:
    """Returns the placed buffers and the arena size. ``tail`` bytes are left free at
    the end (graph pool and operator scratch on CUDA)."""
    names = [r.name for r in requests]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"buffers requested twice: {dup}")
    order = {role: i for i, role in enumerate(_ROLE_ORDER)}
    placed = []
    offset = 0
    for r in sorted(requests, key=lambda r: order[r.role]):  # stable within a role
        offset = align(offset, alignment)
        placed.append(Buffer(name=r.name, role=r.role, dtype=r.dtype, shape=r.shape, offset=offset, nbytes=r.nbytes))
        offset += r.nbytes
    return tuple(placed), align(offset + tail, alignment)
