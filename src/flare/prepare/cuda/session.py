"""The CUDA preparation session: arena, allocator, image capture, graph capture.

``CudaSession.begin()`` runs before torch is imported: it subscribes CUPTI to
module loads, makes the primary context current and reserves a large range of
device address space at a fixed address. Preparation then maps the planned
arena into that range, routes every torch allocation (model code, compiled
kernels' constants, library workspaces, graph pools) into its tail through a
``MemPool`` backed by ``allocator.c``, captures each program, and exports the
graphs. Nothing a graph can reference lives outside the arena; the exporter
checks every pointer it sees.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cuda.bindings import driver as d

from flare.prepare.cuda.images import ImageRecorder
from flare.runtime.cuda_driver import (SUCCESS, VA_HINTS, CoreCompatibilityError, Device, _alloc_prop, ck,
                                       free_memory, grant_access, granularity, open_device, round_up)

VA_RESERVE = 1 << 40  # address space only; physical memory is mapped as planned
TP_EXTRA_HINTS = (0x400000000000, 0x300000000000, 0x200000000000)  # more room for a rank group


def rank_base(hint: int, rank: int) -> int:
    """Rank ``rank``'s arena address for a rank-0 address ``hint``: one reservation
    below the previous rank's, so no two ranks' arenas can overlap."""
    return hint - rank * VA_RESERVE


def device_uuid(dev: Device) -> str:
    return bytes(ck(d.cuDeviceGetUuid(dev.device), "cuDeviceGetUuid").bytes).hex()


class _CudaArray:
    """Exposes a raw device range to torch.as_tensor without copying."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3, "strides": None,
        }


@dataclass
class CudaSession:
    device: Device
    recorder: ImageRecorder
    base: int
    reserved: int
    free_at_start: int
    mapped: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    _handles: list = field(default_factory=list)
    allocator: object = None
    pool: object = None
    pool_offset: int = 0

    @classmethod
    def begin(cls, rank: int = 0, agree=None) -> "CudaSession":
        """Reserve the arena's fixed address range. Tensor-parallel rank ``rank`` reserves
        ``rank`` reservations below a hint (``rank_base``), so every rank's arena has its
        own address; ``agree`` (every rank's string, in rank order) makes all ranks move
        to the next hint together until every rank holds its range."""
        recorder = ImageRecorder()
        recorder.install_cupti()
        dev = open_device(0)
        free, _ = free_memory()
        tried = []
        for hint in (*VA_HINTS, *TP_EXTRA_HINTS):
            want = rank_base(hint, rank)
            got = None
            if want > 0:
                r = d.cuMemAddressReserve(VA_RESERVE, 0, d.CUdeviceptr(want), 0)
                if r[0] == SUCCESS and int(r[1]) == want:
                    got = r[1]
                elif r[0] == SUCCESS:
                    d.cuMemAddressFree(r[1], VA_RESERVE)
            mine = "1" if got is not None else "0"
            if all(x == "1" for x in (agree(mine) if agree else [mine])):
                return cls(dev, recorder, want, VA_RESERVE, free)
            if got is not None:
                d.cuMemAddressFree(got, VA_RESERVE)
            tried.append(f"{want:#x}")
        raise CoreCompatibilityError(f"no fixed arena address could be reserved (tried {', '.join(tried)})",
                                     code="address_range_unavailable")

    def map(self, nbytes: int) -> None:
        """Back [base, base + nbytes) with physical device memory."""
        size = round_up(nbytes, granularity(self.device.ordinal))
        if size > self.reserved:
            raise ValueError(f"arena of {size} bytes exceeds the reserved address range")
        handle = ck(d.cuMemCreate(size, _alloc_prop(self.device.ordinal), 0), "cuMemCreate")
        ck(d.cuMemMap(d.CUdeviceptr(self.base), size, 0, handle, 0), "cuMemMap")
        grant_access(self.base, size, [self.device.ordinal])
        ck(d.cuMemsetD8(d.CUdeviceptr(self.base), 0, size), "cuMemsetD8")
        self._handles.append(handle)
        self.mapped = size

    def buffer_tensors(self, buffers) -> dict:
        """One tensor per planned buffer, each over its own storage (not views of one
        flat tensor): compiled forwards that mutate a buffer must not see it as a
        view aliasing every other buffer, nor as a view of a different dtype."""
        import torch

        from flare.prepare.programs import TORCH_DTYPES

        out = {}
        for b in buffers:
            dtype = TORCH_DTYPES[b.dtype.value]
            ptr = self.base + b.offset
            try:
                storage = torch._C._construct_storage_from_data_pointer(ptr, torch.device("cuda", 0), b.nbytes)
                t = torch.empty(0, dtype=dtype, device="cuda").set_(storage, 0, b.shape)
            except (AttributeError, TypeError, RuntimeError):
                t = torch.as_tensor(_CudaArray(ptr, b.nbytes), device="cuda").view(dtype).view(b.shape)
            if t.data_ptr() != ptr or t.nbytes != b.nbytes:
                raise RuntimeError(f"tensor for {b.name} does not cover its arena range")
            out[b.name] = t
        return out

    def start_torch(self, pool_offset: int):
        """Route torch allocations into the arena tail; returns the flat arena tensor."""
        import torch

        from flare.prepare.cuda.allocator import PoolAllocator

        self.recorder.install_triton_hook()
        self.pool_offset = pool_offset
        self.allocator = PoolAllocator(self.base + pool_offset, self.mapped - pool_offset)
        plug = torch.cuda.memory.CUDAPluggableAllocator(self.allocator.path, "flare_pool_malloc", "flare_pool_free")
        self.pool = torch.cuda.MemPool(plug.allocator())
        return torch.as_tensor(_CudaArray(self.base, self.mapped), device="cuda")

    def check_no_escapes(self, since: int = 0) -> None:
        """Raises if the scratch region refused more requests than ``since`` (a count from
        ``allocator.stats()`` taken earlier) over the whole preparation."""
        st = self.allocator.stats() if self.allocator is not None else None
        if st is not None and st["failed"] > since:
            raise MemoryError(f"the arena's scratch region ran out during preparation ({st['used'] / 2**30:.2f} of "
                              f"{st['reserved'] / 2**30:.2f} GiB used, {st['failed']} requests refused); raise "
                              f"--scratch-memory")

