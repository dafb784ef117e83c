"""The CUDA graph executor: replays exported graphs through cuda-python only.

Startup (everything that allocates, loads or instantiates happens here):
reserve and map the arena at the core's fixed address, upload the arena
image, zero the runtime-owned regions, load every kernel image and re-apply
function attributes, rebuild every program's graph node by node and
instantiate it once. Kernels and graphs do not depend on the arena's contents,
so they load and build on a second thread while the image uploads; the upload
reads the image with several threads, each through its own pinned buffers and
stream (reads and copies release the GIL). After ``start`` returns the
executor only copies staged inputs, launches graph executables, records events
and copies completion records back, all on one stream. Counters prove it: device memory and the
allocation / module-load / instantiation counts are reported by ``stats``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import os
import threading
import time
from pathlib import Path

import numpy as np
from cuda.bindings import driver as d

from flare.core import graph as G
from flare.core.errors import CoreCompatibilityError, ExecutionError, ManifestError
from flare.core.image import iter_image
from flare.core.manifest import BufferRole, Manifest, check_device
from flare.runtime.cuda_driver import SUCCESS, DeviceArena, ck, free_memory, open_device
from flare.runtime.executor import MAX_IN_FLIGHT, NUMPY_DTYPES, check_row
from flare.runtime.graph_rebuild import GraphRebuilder
from flare.runtime.staging import StagingRing

STAGING_BYTES = 16 << 20
UPLOAD_CHUNK = 8 << 20  # one read + one host-to-device copy of the image
UPLOAD_WORKERS = 4  # reader threads of the image, each with two pinned chunks and a stream


class _Pinned:
    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.ptr = int(ck(d.cuMemHostAlloc(nbytes, 0), "cuMemHostAlloc"))
        self.array = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(self.ptr))

    def free(self) -> None:
        if self.ptr:
            d.cuMemFreeHost(self.ptr)
            self.ptr = 0


class CudaExecutor:
    """One rank's graphs on one device. A tensor-parallel core is driven by
    ``TensorParallelExecutor`` (``runtime/cuda_tp.py``), one of these per rank."""

    def __init__(self, core_dir: str | Path, manifest: Manifest, *, device: int = 0, rank: int | None = None):
        if rank is None and manifest.parallel.tp_size > 1:
            raise CoreCompatibilityError(
                f"the core is tensor-parallel (tp_size {manifest.parallel.tp_size}): open it with "
                f"flare.runtime.cuda_tp.open_executor", param="parallel.tp_size", code="tensor_parallel_core")
        self.rank = rank or 0
        self.core_dir = Path(core_dir)
        self.rank_dir = self.core_dir / manifest.parallel.ranks[self.rank].dir
        self.base_address = manifest.parallel.ranks[self.rank].base_address
        self.manifest = manifest
        self.ordinal = device
        self.switch_context = False  # set when ranks of one process live on different devices
        self.ready = False
        self.timings_ms: dict[str, float] = {}
        self._counts = {"allocations": 0}
        self._counts_at_ready: dict[str, int] = {}
        self._launches = 0
        self._buffers = {b.name: b for b in manifest.buffers}
        self._execs: dict[str, object] = {}
        self.rebuilder: GraphRebuilder | None = None
        # Per completion buffer, one pinned host copy per in-flight position (ticket % depth).
        self._completion_copies: dict[str, list[_Pinned]] = {}
        self._pending_completion: str | None = None
        self._tickets = 0  # programs submitted
        self._done = 0  # programs known complete (they complete in ticket order)
        self._slots: list[tuple[int, str | None]] = [(-1, None)] * MAX_IN_FLIGHT  # (ticket, completion)
        self.events: list = []
        self._thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="flare-cuda")
        self.arena: DeviceArena | None = None
        self._free_at_ready = 0

    # -- startup -------------------------------------------------------------

    async def start(self) -> None:
        await asyncio.get_running_loop().run_in_executor(self._thread, self._start)
        # The context is current per thread: the loop's thread issues copies and launches.
        ck(d.cuCtxSetCurrent(self.device.context), "cuCtxSetCurrent")

    def _start(self) -> None:
        m = self.manifest
        t = time.perf_counter()

        def mark(name):
            nonlocal t
            now = time.perf_counter()
            self.timings_ms[name] = round((now - t) * 1000, 2)
            t = now

        if m.kernels is None:
            raise ManifestError("this core has no exported graphs (a reference core): use --executor reference",
                                param="kernels", code="not_a_cuda_core")
        self.device = open_device(self.ordinal)
        check_device(m, device="cuda", compute_capability=self.device.compute_capability)
        mark("context")
        self.arena = DeviceArena.reserve(m.arena.nbytes, at=self.base_address, ordinal=self.ordinal)
        self._counts["allocations"] += 1
        self.stream = ck(d.cuStreamCreate(int(d.CUstream_flags.CU_STREAM_NON_BLOCKING.value)), "cuStreamCreate")
        flags = int(d.CUevent_flags.CU_EVENT_DISABLE_TIMING.value)
        self.events = [ck(d.cuEventCreate(flags), "cuEventCreate") for _ in range(MAX_IN_FLIGHT)]
        self.staging = _Pinned(STAGING_BYTES)
        self.readback = _Pinned(max(b.nbytes for b in m.buffers if b.role == BufferRole.output))
        for p in m.programs:
            if p.completion and p.completion not in self._completion_copies:
                n = self._buffers[p.completion].nbytes
                self._completion_copies[p.completion] = [_Pinned(n) for _ in range(MAX_IN_FLIGHT)]
        self._counts["allocations"] += 3 + MAX_IN_FLIGHT * len(self._completion_copies)
        self._ring = StagingRing(STAGING_BYTES)
        self.rebuilder = GraphRebuilder(self.rank_dir, m.kernels, self.device.context)
        mark("reserve_map")
        failure: list[BaseException] = []
        builder = threading.Thread(target=self._load_and_build, args=(failure,), name="flare-cuda-build")
        builder.start()
        try:
            t_upload = time.perf_counter()
            self._upload_image()
            self.timings_ms["arena_upload"] = round((time.perf_counter() - t_upload) * 1000, 2)
        finally:
            builder.join()
        if failure:
            raise failure[0]
        # Both parts synchronised their own streams (the upload self.stream, the builder its own).
        mark("upload_and_build")  # wall time of the two overlapped parts
        self.mark_ready()

    def mark_ready(self) -> None:
        """The baseline that ``stats`` compares against: device memory and counters now
        (a tensor-parallel executor marks every rank again once all ranks started, since
        ranks that share a GPU see each other's startup)."""
        self._make_current()
        self._free_at_ready = free_memory()[0]
        self._counts_at_ready = self._all_counts()
        self.ready = True

    def _all_counts(self) -> dict[str, int]:
        return {**self._counts, **(self.rebuilder.counts if self.rebuilder else
                                   {"module_loads": 0, "instantiations": 0})}

    def _load_and_build(self, failure: list[BaseException]) -> None:
        """Load every kernel image and build every graph (the builder thread)."""
        try:
            ck(d.cuCtxSetCurrent(self.device.context), "cuCtxSetCurrent")
            t = time.perf_counter()
            self.rebuilder.load_kernels()
            self.timings_ms["module_load"] = round((time.perf_counter() - t) * 1000, 2)
            t = time.perf_counter()
            stream = ck(d.cuStreamCreate(int(d.CUstream_flags.CU_STREAM_NON_BLOCKING.value)), "cuStreamCreate")
            try:
                for p in self.manifest.programs:
                    spec = G.load_graph(self.rank_dir / p.graph)
                    self._execs[p.name] = self.rebuilder.build(spec, stream)
                ck(d.cuStreamSynchronize(stream), "cuStreamSynchronize")
            finally:
                d.cuStreamDestroy(stream)
            self.timings_ms["graph_build"] = round((time.perf_counter() - t) * 1000, 2)
        except BaseException as e:  # re-raised on the starting thread
            failure.append(e)

    def _upload_image(self) -> None:
        m = self.manifest
        # Runtime-owned regions start zeroed (state rows, inputs, outputs, KV pages).
        for b in m.buffers:
            if b.role not in (BufferRole.weight, BufferRole.scratch):
                ck(d.cuMemsetD8Async(d.CUdeviceptr(self.arena.base + b.offset), 0, b.nbytes, self.stream), "memset")
        image = self.rank_dir / m.arena.image
        chunks = [(off + start, self.arena.base + b.offset + start, min(UPLOAD_CHUNK, n - start))
                  for b, off, n in iter_image(image, m) for start in range(0, n, UPLOAD_CHUNK)]
        self._counts["allocations"] += 2 * UPLOAD_WORKERS  # the readers' pinned chunks, freed before ready
        fd = os.open(image, os.O_RDONLY)
        try:
            # Interleaved shares keep every reader busy to the end.
            with concurrent.futures.ThreadPoolExecutor(UPLOAD_WORKERS, thread_name_prefix="flare-upload") as pool:
                for f in [pool.submit(self._upload_share, fd, chunks[w::UPLOAD_WORKERS])
                          for w in range(UPLOAD_WORKERS)]:
                    f.result()
        finally:
            os.close(fd)
        ck(d.cuStreamSynchronize(self.stream), "cuStreamSynchronize")

    def _upload_share(self, fd: int, chunks: list[tuple[int, int, int]]) -> None:
        """Read and copy ``chunks`` ((file offset, device address, bytes)) through two
        pinned buffers: a buffer is refilled once the copy out of it has completed."""
        ck(d.cuCtxSetCurrent(self.device.context), "cuCtxSetCurrent")
        stream = ck(d.cuStreamCreate(int(d.CUstream_flags.CU_STREAM_NON_BLOCKING.value)), "cuStreamCreate")
        flags = int(d.CUevent_flags.CU_EVENT_DISABLE_TIMING.value)
        bufs = [_Pinned(UPLOAD_CHUNK), _Pinned(UPLOAD_CHUNK)]
        events = [ck(d.cuEventCreate(flags), "cuEventCreate") for _ in bufs]
        try:
            for i, (off, dst, n) in enumerate(chunks):
                k = i % 2
                if i >= 2:
                    ck(d.cuEventSynchronize(events[k]), "cuEventSynchronize")
                view = memoryview(bufs[k].array)[:n]
                done = 0
                while done < n:
                    got = os.preadv(fd, [view[done:]], off + done)
                    if got <= 0:
                        raise ManifestError("arena image is truncated", param="arena.image")
                    done += got
                ck(d.cuMemcpyHtoDAsync(d.CUdeviceptr(dst), bufs[k].ptr, n, stream), "cuMemcpyHtoDAsync")
                ck(d.cuEventRecord(events[k], stream), "cuEventRecord")
            ck(d.cuStreamSynchronize(stream), "cuStreamSynchronize")
        finally:
            d.cuStreamSynchronize(stream)
            for e in events:
                d.cuEventDestroy(e)
            d.cuStreamDestroy(stream)
            for b in bufs:
                b.free()

    # -- executor interface ------------------------------------------------------

    def _address(self, buffer: str, row) -> tuple[int, int]:
        b = self._buffers[buffer]
        if row is None:
            return self.arena.base + b.offset, b.nbytes
        check_row(buffer, b.shape, row)
        itemsize = b.dtype.itemsize
        strides = [itemsize]
        for dim in reversed(b.shape[1:]):
            strides.insert(0, strides[0] * dim)
        if isinstance(row, tuple):  # (row, slice of the last dimension)
            r, sl = row
            start = r * strides[0] + sl.start * itemsize
            return self.arena.base + b.offset + start, (sl.stop - sl.start) * itemsize
        return self.arena.base + b.offset + row * strides[0], strides[0]

    def _make_current(self) -> None:
        """Ranks of one process on different devices: this rank's context for the
        caller's next driver calls (the loop thread serves every rank)."""
        if self.switch_context:
            ck(d.cuCtxSetCurrent(self.device.context), "cuCtxSetCurrent")

    def write(self, buffer: str, value: np.ndarray, row=None) -> None:
        self._make_current()
        b = self._buffers[buffer]
        data = np.ascontiguousarray(np.asarray(value, dtype=NUMPY_DTYPES[b.dtype])).reshape(-1).view(np.uint8)
        dst, extent = self._address(buffer, row)
        n = data.nbytes
        if n > extent:
            raise ExecutionError(f"write of {n} bytes into {buffer}[{row}] ({extent} bytes)", code="bad_write")
        if n > STAGING_BYTES:
            ck(d.cuStreamSynchronize(self.stream), "cuStreamSynchronize")
            self._ring.drain()
            for start in range(0, n, STAGING_BYTES):
                k = min(STAGING_BYTES, n - start)
                self.staging.array[:k] = data[start : start + k]
                ck(d.cuMemcpyHtoDAsync(d.CUdeviceptr(dst + start), self.staging.ptr, k, self.stream), "HtoD")
                ck(d.cuStreamSynchronize(self.stream), "cuStreamSynchronize")
            return
        at = self._ring.alloc(n)
        if at is None:  # every staged byte may still be read by a queued copy
            ck(d.cuStreamSynchronize(self.stream), "cuStreamSynchronize")
            self._ring.drain()
            at = self._ring.alloc(n)
        self.staging.array[at : at + n] = data
        ck(d.cuMemcpyHtoDAsync(d.CUdeviceptr(dst), self.staging.ptr + at, n, self.stream), "HtoD")

    def submit(self, program: str) -> int:
        self._make_current()
        p = self.manifest.program(program)
        ticket = self._tickets
        pos = ticket % MAX_IN_FLIGHT
        ck(d.cuGraphLaunch(self._execs[program], self.stream), f"cuGraphLaunch {program}")
        self._launches += 1
        self._tickets += 1
        if p.completion:
            host = self._completion_copies[p.completion][pos]
            b = self._buffers[p.completion]
            ck(d.cuMemcpyDtoHAsync(host.ptr, d.CUdeviceptr(self.arena.base + b.offset), b.nbytes, self.stream),
               "DtoH")
        self._pending_completion = p.completion
        self._slots[pos] = (ticket, p.completion)
        self._ring.submitted(ticket)
        ck(d.cuEventRecord(self.events[pos], self.stream), "cuEventRecord")
        return ticket

    async def wait(self, ticket: int | None = None) -> None:
        t = self._tickets - 1 if ticket is None else ticket
        if t >= self._done:
            event = self.events[t % MAX_IN_FLIGHT]
            err = await asyncio.get_running_loop().run_in_executor(self._thread, d.cuEventSynchronize, event)
            if err[0] != SUCCESS:
                raise ExecutionError(f"program failed on the device: {err[0].name}", code="device_error")
            self._done = t + 1
            self._ring.completed(t)  # the writes staged before it have been copied

    def sync(self) -> None:
        """Everything submitted and written so far has completed (the whole stream)."""
        self._make_current()
        ck(d.cuStreamSynchronize(self.stream), "cuStreamSynchronize")
        self._done = self._tickets
        self._ring.drain()

    def completion(self, ticket: int) -> np.ndarray:
        pos = ticket % MAX_IN_FLIGHT
        owner, name = self._slots[pos]
        if owner != ticket or name is None or ticket >= self._done:
            raise ExecutionError(f"no completion record for ticket {ticket}", code="bad_completion")
        b = self._buffers[name]
        raw = self._completion_copies[name][pos].array[: b.nbytes]
        return np.frombuffer(bytes(raw), NUMPY_DTYPES[b.dtype]).reshape(b.shape).copy()

    def read(self, buffer: str) -> np.ndarray:
        b = self._buffers[buffer]
        if buffer == self._pending_completion and self._done == self._tickets:
            raw = self._completion_copies[buffer][(self._tickets - 1) % MAX_IN_FLIGHT].array[: b.nbytes]
        else:
            self._make_current()
            ck(d.cuStreamSynchronize(self.stream), "cuStreamSynchronize")
            raw = self.read_bytes(buffer)
        return np.frombuffer(bytes(raw), NUMPY_DTYPES[b.dtype]).reshape(b.shape).copy()

    def read_bytes(self, buffer: str) -> bytes:
        """Synchronous copy of a buffer's bytes (diagnostics and qualification)."""
        self._make_current()
        b = self._buffers[buffer]
        out = bytearray()
        for start in range(0, b.nbytes, self.readback.nbytes):
            k = min(self.readback.nbytes, b.nbytes - start)
            ck(d.cuMemcpyDtoHAsync(self.readback.ptr, d.CUdeviceptr(self.arena.base + b.offset + start), k,
                                   self.stream), "DtoH")
            ck(d.cuStreamSynchronize(self.stream), "cuStreamSynchronize")
            out += self.readback.array[:k].tobytes()
        return bytes(out)

    def stats(self) -> dict[str, int]:
        after = {f"{k}_after_ready": v - self._counts_at_ready.get(k, v) for k, v in self._all_counts().items()}
        if self.ready:
            self._make_current()
        free = free_memory()[0] if self.ready else 0
        return {
            "launches": self._launches,
            "device_free_at_ready": self._free_at_ready,
            "device_free_now": free,
            **after,
            **{f"startup_{k}_ms": int(v) for k, v in self.timings_ms.items()},
        }

    async def close(self) -> None:
        if self.arena is None:
            self._thread.shutdown(wait=False)
            return
        try:
            self._make_current()
            d.cuStreamSynchronize(self.stream)
        finally:
            for event in self.events:
                d.cuEventDestroy(event)
            if self.rebuilder is not None:
                self.rebuilder.destroy()
            for pinned in [self.staging, self.readback, *(c for cs in self._completion_copies.values() for c in cs)]:
                pinned.free()
            self.arena.release()
            self.arena = None
            self.ready = False
            self._thread.shutdown(wait=False)
