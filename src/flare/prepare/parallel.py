"""Tensor parallelism: a rank's place in its group, its weight shards, and the
collectives the programs call (see docs/tensor-parallel.md).

Collectives are recipe-level operations inside the programs: every rank runs the
same program sequence, hence the same collective sequence. On the CPU reference
path they are ``torch.distributed`` over gloo; with one rank they are identities,
so a TP=1 program is exactly the single-rank program.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch

# How long a rank waits in a collective for a peer that never arrives (a peer that
# died is normally noticed sooner: the executor and the prepare CLI kill the group).
COLLECTIVE_TIMEOUT_S = 300


class ShardingError(ValueError):
    """A model whose declared sharding does not divide by the TP size (or a recipe
    that declares none)."""


@dataclass(frozen=True)
class Shard:
    """This rank's slice of a weight: the ``rank``-th of ``size`` equal contiguous
    slices along ``dim``."""

    dim: int
    rank: int
    size: int

    def shape(self, full: tuple[int, ...]) -> tuple[int, ...]:
        out = list(full)
        out[self.dim] //= self.size
        return tuple(out)

    def full(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        out = list(shape)
        out[self.dim] *= self.size
        return tuple(out)

    def of(self, full: torch.Tensor) -> torch.Tensor:
        n = full.shape[self.dim] // self.size
        return full.narrow(self.dim, self.rank * n, n)


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ShardingError(f"tensor-parallel rank {self.rank} of {self.size} is not a rank")

    @property
    def active(self) -> bool:
        return self.size > 1

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place; returns ``t``."""
        if self.active:
            import torch.distributed as dist

            dist.all_reduce(t)
        return t

    def all_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """Concatenate every rank's ``t`` along ``dim`` in rank order (identical bytes on
        every rank)."""
        if not self.active:
            return t
        import torch.distributed as dist

        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t.contiguous())
        return torch.cat(parts, dim=dim)

    def from_rank_zero(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``t`` on every rank (in place; returns ``t``)."""
        if self.active:
            import torch.distributed as dist

            dist.broadcast(t, src=0)
        return t

    def gather_strings(self, value: str) -> list[str]:
        """Every rank's ``value`` in rank order (host-side agreement during preparation)."""
        if not self.active:
            return [value]
        import torch.distributed as dist

        out: list = [None] * self.size
        dist.all_gather_object(out, value)
        return out


SINGLE = TensorParallel()


def join_group(rank: int, size: int, addr: str | None) -> TensorParallel:
    """Join this process's gloo group (``addr``: host:port of rank 0's store, chosen by
    the launcher); SINGLE for one rank."""
    if size == 1:
        return SINGLE
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://{addr}", rank=rank, world_size=size,
                            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    return TensorParallel(rank, size)


def leave_group(tp: TensorParallel) -> None:
    if tp.active:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
