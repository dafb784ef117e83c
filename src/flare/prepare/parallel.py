"""Tensor parallelism: a rank's place in its group, its weight shards, and the
collectives the programs call (see docs/tensor-parallel.md).

Collectives are recipe-level operations inside the programs: every rank runs the
same program sequence, hence the same collective sequence. On the CPU reference
path they are ``torch.distributed`` over gloo; with one rank they are identities,
so a TP=1 program is exactly the single-rank program.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch

# CUDA collective kernels (prepare/kernels/collective.py): what the ranks' values become.
SUM, GATHER, FROM_ZERO = 0, 1, 2

# How long a rank waits in a collective for a peer that never arrives (a peer that
# died is normally noticed sooner: the executor and the prepare CLI kill the group).
COLLECTIVE_TIMEOUT_S = 300


class ShardingError(ValueError):
    """A model whose declared sharding does not divide by the TP size (or a recipe
    that declares none)."""


@dataclass(frozen=True)
class Shard:
    """This rank's slice of a weight: the ``rank``-th of ``size`` equal contiguous
    slices along ``dim``; or, where the weight is consecutive ``blocks`` along ``dim``
    (sizes, e.g. a projection whose rows are q | k | v), the ``rank``-th slice of each
    block, in order."""

    dim: int
    rank: int
    size: int
    blocks: tuple[int, ...] = ()

    def shape(self, full: tuple[int, ...]) -> tuple[int, ...]:
        out = list(full)
        out[self.dim] //= self.size
        return tuple(out)

    def full(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        out = list(shape)
        out[self.dim] *= self.size
        return tuple(out)

    def of(self, full: torch.Tensor) -> torch.Tensor:
        blocks = self.blocks or (full.shape[self.dim],)
        if sum(blocks) != full.shape[self.dim] or any(b % self.size for b in blocks):
            raise ShardingError(f"blocks {blocks} do not cut dimension {self.dim} of {tuple(full.shape)} "
                                f"into parts of {self.size} equal slices")
        parts, start = [], 0
        for b in blocks:
            n = b // self.size
            parts.append(full.narrow(self.dim, start + self.rank * n, n))
            start += b
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.dim)


@dataclass(frozen=True)
class CudaTransport:
    """This rank's collective buffers in its arena (``prepare/kernels/collective.py``):
    the two exchange slots, the flag words, and the peers' arena offsets."""

    exchange: torch.Tensor  # uint8
    flags: torch.Tensor  # int32 [BLOCKS]
    peers: torch.Tensor  # int64 [size]: base_s - base_self in bytes (zeros while preparing)


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    _cuda: list = field(default_factory=list, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ShardingError(f"tensor-parallel rank {self.rank} of {self.size} is not a rank")

    @property
    def active(self) -> bool:
        return self.size > 1

    def attach_cuda(self, transport: CudaTransport) -> None:
        """From now on collectives are the captured kernels over ``transport``."""
        self._cuda[:] = [transport]

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over ranks (in place where the input is contiguous); returns the sum."""
        if self.active:
            if self._cuda:
                return _cuda_collective(self, SUM, t)
            import torch.distributed as dist

            dist.all_reduce(t)
        return t

    def all_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """Concatenate every rank's ``t`` along ``dim`` in rank order (identical bytes on
        every rank)."""
        if not self.active:
            return t
        if self._cuda:
            if dim not in (-1, t.dim() - 1):
                raise ShardingError("CUDA all-gather concatenates along the last dimension only")
            return _cuda_collective(self, GATHER, t)
        import torch.distributed as dist

        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t.contiguous())
        return torch.cat(parts, dim=dim)

    def from_rank_zero(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``t`` on every rank (in place where contiguous; returns it)."""
        if self.active:
            if self._cuda:
                return _cuda_collective(self, FROM_ZERO, t)
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


@torch.compiler.disable
def _cuda_collective(tp: TensorParallel, mode: int, t: torch.Tensor) -> torch.Tensor:
    """A collective on CUDA: the kernel is what a captured graph records. Outside a
    capture (preparation's warmup runs) the peers' arenas are not mapped in this
    process, so ``peers`` holds zeros and the kernel is a loopback that completes on
    its own (it compiles and loads the exact kernel the capture records); the value
    returned is then the true one, computed over the gloo group from host copies."""
    from flare.prepare.kernels import collective as C

    tr = tp._cuda[0]
    x = t.contiguous()
    out = x.new_empty(*x.shape[:-1], x.shape[-1] * tp.size) if mode == GATHER else x
    host = None if torch.cuda.is_current_stream_capturing() else _host_collective(tp, mode, x)
    C.launch(mode, x, out, tr.exchange, tr.flags, tr.peers, rank=tp.rank, size=tp.size)
    if host is not None:
        out.copy_(host)
    return out


def _host_collective(tp: TensorParallel, mode: int, x: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    h = x.detach().cpu()
    if h.is_floating_point():
        h = h.float()  # gloo's reductions and gathers in float32 (exact for bfloat16 copies)
    if mode == SUM:
        dist.all_reduce(h)
        return h
    if mode == GATHER:
        parts = [torch.empty_like(h) for _ in range(tp.size)]
        dist.all_gather(parts, h)
        return torch.cat(parts, dim=-1)
    dist.broadcast(h, src=0)
    return h


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
