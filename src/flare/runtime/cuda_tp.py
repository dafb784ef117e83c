"""Tensor parallelism on CUDA: every rank's exported graphs driven from one process.

One ``CudaExecutor`` per rank, each with its own device context, arena (at the
rank's fixed address from ``manifest.parallel``), kernels, graphs, stream and
execution thread. The ranks start concurrently (each uploads its own image on
its own thread). Once every arena is mapped, each arena is made accessible to
every rank's device, so the captured collectives (``prepare/kernels/
collective.py``) load peer buffers through their fixed addresses: nothing is
patched per rank and no NCCL state exists at runtime (no multicast objects).

The executor interface is the single-rank one: ``write`` stages the same bytes
on every rank and ``submit`` launches the same program on every rank, in rank
order, so admission and packing are identical everywhere; launches are
asynchronous, so issuing them from the caller's thread costs microseconds and
the ranks' graphs run concurrently on their streams, meeting in the
collectives. Rank 0's sample decides every rank's state inside the graphs, so
``completion`` and ``read`` return rank 0's copies. ``wait`` waits on every
rank; a rank that fails raises ``ExecutionError`` naming it (a peer blocked in
a collective with it gives up after the kernel's spin bound instead of
hanging), and the engine stops serving as it does with one rank.

Ranks are placed on the visible GPUs round-robin: rank r on GPU r mod n. With
fewer GPUs than ranks several ranks share a GPU (a test configuration: it
exercises the per-rank graphs and collectives on one device).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
from cuda.bindings import driver as d

from flare.core.errors import ExecutionError
from flare.core.manifest import Manifest
from flare.runtime.cuda_driver import ck
from flare.runtime.cuda_executor import CudaExecutor


def device_count() -> int:
    ck(d.cuInit(0), "cuInit")
    return int(ck(d.cuDeviceGetCount(), "cuDeviceGetCount"))


def open_executor(core_dir: str | Path, manifest: Manifest):
    """The executor for a CUDA core: one rank's, or every rank's."""
    if manifest.parallel.tp_size == 1:
        return CudaExecutor(core_dir, manifest)
    return TensorParallelExecutor(core_dir, manifest)


class TensorParallelExecutor:
    def __init__(self, core_dir: str | Path, manifest: Manifest, *, devices: int | None = None):
        self.manifest = manifest
        n = devices if devices is not None else device_count()
        if n < 1:
            raise ExecutionError("no CUDA device is visible", code="no_device")
        self.ranks = [CudaExecutor(core_dir, manifest, device=r % n, rank=r)
                      for r in range(manifest.parallel.tp_size)]
        self.ready = False
        self._failed = ""

    @property
    def timings_ms(self) -> dict[str, float]:
        """Rank 0's startup phases (the ranks start concurrently)."""
        return self.ranks[0].timings_ms

    async def start(self) -> None:
        results = await asyncio.gather(*(r.start() for r in self.ranks), return_exceptions=True)
        failed = [(i, e) for i, e in enumerate(results) if isinstance(e, BaseException)]
        if failed:
            await self.close()
            raise failed[0][1]
        try:
            ordinals = sorted({r.ordinal for r in self.ranks})
            if len(ordinals) > 1:
                for r in self.ranks:
                    r.arena.grant(ordinals)
                    r.switch_context = True
        except BaseException:
            await self.close()
            raise
        for r in self.ranks:  # every rank's baseline after all of them started
            r.mark_ready()
        self.ready = True

    def write(self, buffer: str, value: np.ndarray, row=None) -> None:
        if self._failed:
            raise ExecutionError(f"a rank failed earlier: {self._failed}", code="rank_failed")
        for r in self.ranks:
            r.write(buffer, value, row)

    def submit(self, program: str) -> int:
        if self._failed:
            raise ExecutionError(f"a rank failed earlier: {self._failed}", code="rank_failed")
        tickets = []
        for i, r in enumerate(self.ranks):
            try:
                tickets.append(r.submit(program))
            except Exception as e:
                # The ranks launched before it wait in its collectives until they trap.
                self._failed = f"rank {i}: {e}"
                raise ExecutionError(f"rank {i} could not launch {program}: {e}", code="rank_failed") from e
        if len(set(tickets)) != 1:
            raise ExecutionError(f"ranks disagree on the program count: {tickets}", code="rank_divergence")
        return tickets[0]

    async def wait(self, ticket: int | None = None) -> None:
        results = await asyncio.gather(*(r.wait(ticket) for r in self.ranks), return_exceptions=True)
        for i, e in enumerate(results):
            if isinstance(e, BaseException):
                self._failed = self._failed or f"rank {i}: {e}"
                code = getattr(e, "code", "execution_failed")
                raise ExecutionError(f"rank {i}: {e}", code=code) from e

    def sync(self) -> None:
        for r in self.ranks:
            r.sync()

    def completion(self, ticket: int) -> np.ndarray:
        return self.ranks[0].completion(ticket)

    def read(self, buffer: str) -> np.ndarray:
        return self.ranks[0].read(buffer)

    def read_bytes(self, buffer: str) -> bytes:
        return self.ranks[0].read_bytes(buffer)

    def stats(self) -> dict[str, int]:
        out = dict(self.ranks[0].stats())
        for r in self.ranks[1:]:
            for k, v in r.stats().items():
                if k.endswith("_after_ready"):
                    out[k] += v
        out["tp_size"] = len(self.ranks)
        return out

    async def close(self) -> None:
        for r in self.ranks:
            await r.close()
        self.ready = False
