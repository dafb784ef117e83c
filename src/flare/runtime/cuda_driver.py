"""Thin helpers over cuda-python's driver API (torch-free; used by both sides).

Every call's status is checked; a failure raises ``CudaError`` carrying the
operation, the numeric code and the driver's name and description.
"""

from __future__ import annotations

from dataclasses import dataclass

from cuda.bindings import driver as d

from flare.core.errors import CoreCompatibilityError, ExecutionError

SUCCESS = d.CUresult.CUDA_SUCCESS
# Fixed arena addresses tried in order by preparation; the runtime uses exactly
# the one recorded in the manifest.
VA_HINTS = (0x7F0000000000, 0x600000000000, 0x500000000000, 0x10000000000)


class CudaError(ExecutionError):
    default_code = "cuda_error"

    def __init__(self, op: str, result):
        try:
            name = d.cuGetErrorName(result)[1].decode()
            desc = d.cuGetErrorString(result)[1].decode()
        except Exception:
            name, desc = str(result), ""
        super().__init__(f"{op} failed: {name} ({int(result)}) {desc}")
        self.op = op
        self.result = int(result)
        self.name = name


def ck(ret, op: str):
    """Check a cuda-python return tuple and return its payload."""
    if isinstance(ret, tuple):
        err, rest = ret[0], ret[1:]
    else:
        err, rest = ret, ()
    if err != SUCCESS:
        raise CudaError(op, err)
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest


@dataclass
class Device:
    ordinal: int
    device: object
    context: object
    name: str
    compute_capability: str


def open_device(ordinal: int = 0) -> Device:
    """Initialise the driver and make the device's primary context current (the one
    torch uses too, so preparation and runtime see the same kind of context)."""
    ck(d.cuInit(0), "cuInit")
    dev = ck(d.cuDeviceGet(ordinal), "cuDeviceGet")
    ctx = ck(d.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    ck(d.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    name = ck(d.cuDeviceGetName(256, dev), "cuDeviceGetName")
    name = name.split(b"\0")[0].decode() if isinstance(name, (bytes, bytearray)) else str(name)
    major = ck(d.cuDeviceGetAttribute(d.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev), "cc")
    minor = ck(d.cuDeviceGetAttribute(d.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev), "cc")
    return Device(ordinal, dev, ctx, name, f"{major}.{minor}")


def driver_version() -> int:
    return int(ck(d.cuDriverGetVersion(), "cuDriverGetVersion"))


def _alloc_prop(ordinal: int):
    prop = d.CUmemAllocationProp()
    prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = ordinal
    return prop


def grant_access(base: int, nbytes: int, ordinals) -> None:
    """Make [base, base + nbytes) readable and writable from every device in ``ordinals``."""
    descs = []
    for o in ordinals:
        acc = d.CUmemAccessDesc()
        acc.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        acc.location.id = o
        acc.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        descs.append(acc)
    ck(d.cuMemSetAccess(d.CUdeviceptr(base), nbytes, descs, len(descs)), "cuMemSetAccess")


def granularity(ordinal: int = 0) -> int:
    return int(ck(d.cuMemGetAllocationGranularity(
        _alloc_prop(ordinal), d.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM),
        "cuMemGetAllocationGranularity"))


def round_up(x: int, g: int) -> int:
    return (x + g - 1) // g * g


class DeviceArena:
    """A device memory range at a fixed virtual address (reserve + create + map)."""

    def __init__(self, base: int, nbytes: int, ordinal: int, handle):
        self.base = base
        self.nbytes = nbytes
        self.ordinal = ordinal
        self._handle = handle

    @classmethod
    def reserve(cls, nbytes: int, *, at: int | None = None, hints=VA_HINTS, ordinal: int = 0) -> "DeviceArena":
        """Reserve and map ``nbytes`` at ``at`` exactly (runtime) or at the first hint
        the driver honours (preparation). Raises CoreCompatibilityError otherwise."""
        g = granularity(ordinal)
        size = round_up(max(nbytes, 1), g)
        tried = []
        for hint in ([at] if at is not None else list(hints)):
            r = d.cuMemAddressReserve(size, 0, d.CUdeviceptr(hint), 0)
            if r[0] != SUCCESS:
                tried.append(f"{hint:#x}: {r[0].name}")
                continue
            got = int(r[1])
            if got != hint:
                ck(d.cuMemAddressFree(r[1], size), "cuMemAddressFree")
                tried.append(f"{hint:#x}: driver offered {got:#x}")
                continue
            try:
                handle = ck(d.cuMemCreate(size, _alloc_prop(ordinal), 0), "cuMemCreate")
            except CudaError:
                ck(d.cuMemAddressFree(d.CUdeviceptr(hint), size), "cuMemAddressFree")
                raise
            ck(d.cuMemMap(d.CUdeviceptr(hint), size, 0, handle, 0), "cuMemMap")
            grant_access(hint, size, [ordinal])
            return cls(hint, size, ordinal, handle)
        raise CoreCompatibilityError(
            f"cannot reserve {size} bytes of device address space at the core's fixed address "
            f"({'; '.join(tried)})", param="arena.base_address", code="address_range_unavailable")

    def grant(self, ordinals) -> None:
        """Make the range readable and writable from every device in ``ordinals`` (peer
        mapping of a tensor-parallel rank's arena)."""
        grant_access(self.base, self.nbytes, ordinals)

    def release(self) -> None:
        if self._handle is None:
            return
        d.cuMemUnmap(d.CUdeviceptr(self.base), self.nbytes)
        d.cuMemRelease(self._handle)
        d.cuMemAddressFree(d.CUdeviceptr(self.base), self.nbytes)
        self._handle = None


def free_memory() -> tuple[int, int]:
    free, total = ck(d.cuMemGetInfo(), "cuMemGetInfo")
    return int(free), int(total)
