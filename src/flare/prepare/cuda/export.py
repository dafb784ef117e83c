"""Walking a captured CUDA graph into a ``GraphSpec`` the runtime can rebuild.

Kernel parameters are copied verbatim, from ``kernelParams`` (one pointer per
parameter, laid out with ``cuFuncGetParamInfo``) or from ``extra`` (one
packed buffer; cuBLAS launches this way). Every 8-byte word of a parameter
buffer that holds a valid device pointer must lie inside the arena; anything
else (a pointer into memory the runtime will not have) fails the export with
the kernel and offset named. Host nodes, event nodes, allocation nodes and
child graphs are rejected.

One exception: ATen's TensorIterator elementwise and reduction kernels
(``at::native::elementwise_kernel``, ``vectorized_`` / ``unrolled_elementwise_kernel``,
``reduce_kernel``) and its copy-by-index and indexing kernels
(``index_elementwise_kernel``: ``index_copy``, ``index_fill``, ``index``, ``index_put``;
``tensor_iterator_stale_ok``) take an ``OffsetCalculator`` by value whose constructor
fills only the operands' own dimensions of its fixed-size arrays; the rest is whatever
the host stack held, now and then an address of a live allocation of the preparing
process (seen twice in ``elementwise_kernel`` on the 8B shape, and in an ``index_copy``
of the Mistral shape on 2026-12-04, where it failed that core's export). Such a word is
never read by the kernel, so it is zeroed in the export (and printed) instead of
failing it. (The indexing kernels' other fixed-size arrays, index sizes, strides and
pointers, are value-initialised: only the offset calculator carries stale words.) The
operands' own pointers sit in the same parameter, so a genuine operand outside the arena
in one of these kernels would be zeroed too; it would then fault on a null address at
its first replay (the GPU suite's replay tests, ``--qualify``), never read another
process's memory. Every other kernel, scatter/gather, sort, softmax and cat kernels among them,
fails the export, but for one more case made exact instead: ATen's ``index_select`` kernels
(``indexSelectSmallIndex``, ``indexSelectLargeIndex``) take their three operands as
``TensorInfo`` by value (``data``, 25 ``sizes``, 25 ``strides``, ``dims``), whose constructor
copies only the tensor's own dimensions and leaves the other entries and the padding after
``dims`` as the host stack held them (on the H200 on 2026-12-06 the word at offset 424 of 672 of
a Qwen3-30B-A3B-shape decode step's index_select, the source's ``dims`` = 2 below 0x7f28 of stale
padding, fell inside a live 32 MiB allocation and failed the export). A stale half shares its
8-byte word with a real field there (``dims``, the last size), so zeroing the word would break
the kernel: the export reads each operand's ``dims`` and zeroes exactly the entries past it and
the padding (``_clear_tensor_info_tails``), what value-initialisation would have left, before
the scan.
"""

from __future__ import annotations

import ctypes
import re
import struct

from cuda.bindings import driver as d

from flare.core import graph as G
from flare.prepare.cuda.images import ImageRecorder
from flare.runtime.cuda_driver import SUCCESS, ck

ATTR_RAW_SIZE = 64  # sizeof(CUlaunchAttributeValue)
_KERNEL_ATTRS = [a for a in d.CUkernelNodeAttrID if a.name != "CU_LAUNCH_ATTRIBUTE_IGNORE"]
_FUNC_ATTRS = [a for a in d.CUfunction_attribute if a.name != "CU_FUNC_ATTRIBUTE_MAX"]
_CU_LAUNCH_PARAM_BUFFER_POINTER = 1
_CU_LAUNCH_PARAM_BUFFER_SIZE = 2
_TENSOR_ITERATOR = re.compile(r"^_ZN2at6native\d+(elementwise_kernel|vectorized_elementwise_kernel|"
                              r"unrolled_elementwise_kernel|reduce_kernel|index_elementwise_kernel)I")


_INDEX_SELECT = re.compile(r"^_ZN2at6native\d+_GLOBAL__N__\w+?\d+indexSelect(Small|Large)IndexI")
_TENSOR_INFO_DIMS = 25  # ATen's MAX_TENSORINFO_DIMS
# sizeof(TensorInfo<T, IndexType>) by the index type's size: data, sizes, strides, dims, padding
_TENSOR_INFO_BYTES = {4: 216, 8: 416}


def tensor_iterator_stale_ok(name: str) -> bool:
    """Whether a kernel (mangled name) is one of ATen's TensorIterator elementwise, reduction
    or indexing kernels, whose stale ``OffsetCalculator`` words are zeroed (module docstring)."""
    return _TENSOR_ITERATOR.match(name) is not None


def index_select_kernel(name: str) -> bool:
    """Whether a kernel (mangled name) is one of ATen's index_select kernels, whose ``TensorInfo``
    operands' unused entries are cleared (``_clear_tensor_info_tails``)."""
    return _INDEX_SELECT.match(name) is not None


def _clear_tensor_info_tails(buf: bytearray, layout: list[tuple[int, int]], where: str) -> None:
    """Zero the sizes and strides past each ``TensorInfo`` operand's ``dims`` and the padding after
    it, in an index_select kernel's parameters (its first three: dst, src, indices; module
    docstring): the entries its constructor leaves as the host stack held them, and the kernel
    never reads."""
    if len(layout) < 3:
        raise ExportError(f"{where}: an index_select kernel with {len(layout)} parameters")
    for off, size in layout[:3]:
        isz = next((i for i, n in _TENSOR_INFO_BYTES.items() if n == size), None)
        if isz is None:
            raise ExportError(f"{where}: a {size}-byte TensorInfo parameter (expected 216 or 416)")
        sizes, strides, at = off + 8, off + 8 + _TENSOR_INFO_DIMS * isz, off + 8 + 2 * _TENSOR_INFO_DIMS * isz
        dims = int.from_bytes(buf[at : at + 4], "little", signed=True)
        if not 0 < dims <= _TENSOR_INFO_DIMS:
            raise ExportError(f"{where}: a TensorInfo parameter at offset {off} with dims {dims}")
        for arr in (sizes, strides):
            buf[arr + dims * isz : arr + _TENSOR_INFO_DIMS * isz] = bytes((_TENSOR_INFO_DIMS - dims) * isz)
        buf[at + 4 : off + size] = bytes(off + size - at - 4)


class ExportError(RuntimeError):
    pass


class KernelTableBuilder:
    def __init__(self, recorder: ImageRecorder):
        self.recorder = recorder
        self.functions: list[G.KernelFunction] = []
        self._index: dict[tuple[str, str], int] = {}
        self._by_handle: dict[int, int] = {}

    def index_of(self, func) -> int:
        handle = int(func)
        if handle in self._by_handle:
            return self._by_handle[handle]
        image, name = self.recorder.resolve(func)
        key = (image, name)
        if key not in self._index:
            self._index[key] = len(self.functions)
            self.functions.append(G.KernelFunction(image=image, name=name, attributes=function_attributes(func)))
        self._by_handle[handle] = self._index[key]
        return self._index[key]

    def table(self) -> G.KernelTable:
        used = sorted({f.image for f in self.functions})
        images = tuple(G.KernelImage(sha=s, nbytes=len(self.recorder.images[s].data)) for s in used)
        return G.KernelTable(images=images, functions=tuple(self.functions))


def function_attributes(func) -> dict[str, int]:
    out = {}
    for a in _FUNC_ATTRS:
        r = d.cuFuncGetAttribute(a, func)
        if r[0] == SUCCESS:
            out[a.name] = int(r[1])
    return out


def export_graph(program: str, graph_handle: int, kernels: KernelTableBuilder, arena: tuple[int, int]) -> G.GraphSpec:
    graph = d.CUgraph(graph_handle)
    n = ck(d.cuGraphGetNodes(graph, 0), "cuGraphGetNodes")[-1]
    nodes = list(ck(d.cuGraphGetNodes(graph, n), "cuGraphGetNodes")[0]) if n else []
    index = {int(nd): i for i, nd in enumerate(nodes)}
    specs: list[G.Node] = []
    for i, nd in enumerate(nodes):
        t = ck(d.cuGraphNodeGetType(nd), "cuGraphNodeGetType")
        where = f"{program} node {i}"
        if t == d.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL:
            specs.append(_kernel_node(nd, kernels, arena, where))
        elif t == d.CUgraphNodeType.CU_GRAPH_NODE_TYPE_MEMSET:
            p = ck(d.cuGraphMemsetNodeGetParams(nd), "cuGraphMemsetNodeGetParams")
            node = G.MemsetNode(dst=int(p.dst), pitch=int(p.pitch), value=int(p.value),
                                element_size=int(p.elementSize), width=int(p.width), height=int(p.height))
            _check_span(node.dst, max(node.pitch, node.width * node.element_size) * node.height, arena,
                        f"{where} (memset)")
            specs.append(node)
        elif t == d.CUgraphNodeType.CU_GRAPH_NODE_TYPE_MEMCPY:
            specs.append(_memcpy_node(nd, arena, where))
        elif t == d.CUgraphNodeType.CU_GRAPH_NODE_TYPE_EMPTY:
            specs.append(G.EmptyNode())
        else:
            raise ExportError(f"{where}: node type {t.name} cannot be rebuilt by the runtime")
    edges = _edges(graph, index)
    return G.GraphSpec(program=program, nodes=tuple(specs), edges=tuple(edges))


def _kernel_node(nd, kernels: KernelTableBuilder, arena, where: str) -> G.KernelNode:
    p = ck(d.cuGraphKernelNodeGetParams(nd), "cuGraphKernelNodeGetParams")
    func = d.CUfunction(int(p.func))  # owned copy: p's fields alias p's storage
    if int(func) == 0:
        func = d.CUfunction(int(ck(d.cuKernelGetFunction(p.kern), "cuKernelGetFunction")))
    layout = []
    while True:
        r = d.cuFuncGetParamInfo(func, len(layout))
        if r[0] != SUCCESS:
            break
        layout.append((int(r[1]), int(r[2])))
    total = max((o + s for o, s in layout), default=0)
    buf = bytearray(total)
    kp, ex = int(p.kernelParams or 0), int(p.extra or 0)
    if kp:
        for j, (o, s) in enumerate(layout):
            ptr = ctypes.c_void_p.from_address(kp + 8 * j).value
            buf[o : o + s] = ctypes.string_at(ptr, s)
    elif ex:
        bptr, bsize, k = 0, 0, 0
        while True:
            key = ctypes.c_void_p.from_address(ex + 8 * k).value or 0
            if key == 0:
                break
            val = ctypes.c_void_p.from_address(ex + 8 * (k + 1)).value or 0
            if key == _CU_LAUNCH_PARAM_BUFFER_POINTER:
                bptr = val
            elif key == _CU_LAUNCH_PARAM_BUFFER_SIZE:
                bsize = ctypes.c_size_t.from_address(val).value
            k += 2
        if not bptr or bsize < total:
            raise ExportError(f"{where}: unreadable 'extra' parameter buffer")
        buf[:] = ctypes.string_at(bptr, total)
    elif total:
        raise ExportError(f"{where}: kernel node has parameters but neither kernelParams nor extra")
    fidx = kernels.index_of(func)
    name = kernels.functions[fidx].name
    if index_select_kernel(name):
        _clear_tensor_info_tails(buf, layout, f"{where} ({name[:80]})")
    for off in _scan_pointers(bytes(buf), arena, f"{where} ({name[:80]})", stale_ok=tensor_iterator_stale_ok(name)):
        buf[off : off + 8] = bytes(8)
    attrs = []
    for a in _KERNEL_ATTRS:
        r = d.cuGraphKernelNodeGetAttribute(nd, a)
        if r[0] != SUCCESS:
            continue
        raw = ctypes.string_at(r[1].getPtr(), ATTR_RAW_SIZE)
        if any(raw):
            attrs.append(G.LaunchAttribute(name=a.name, raw=raw))
    return G.KernelNode(
        function=fidx,
        grid=(int(p.gridDimX), int(p.gridDimY), int(p.gridDimZ)),
        block=(int(p.blockDimX), int(p.blockDimY), int(p.blockDimZ)),
        shared_bytes=int(p.sharedMemBytes),
        params=bytes(buf),
        param_layout=tuple(layout),
        attributes=tuple(attrs),
    )


def _memcpy_node(nd, arena, where: str) -> G.MemcpyNode:
    p = ck(d.cuGraphMemcpyNodeGetParams(nd), "cuGraphMemcpyNodeGetParams")
    device = d.CUmemorytype.CU_MEMORYTYPE_DEVICE
    unified = d.CUmemorytype.CU_MEMORYTYPE_UNIFIED
    if p.srcMemoryType not in (device, unified) or p.dstMemoryType not in (device, unified):
        raise ExportError(f"{where}: memcpy involving host or array memory cannot be replayed from another process")
    if any(int(getattr(p, f)) for f in ("srcXInBytes", "srcY", "srcZ", "dstXInBytes", "dstY", "dstZ")):
        raise ExportError(f"{where}: offset memcpy nodes are not supported")
    node = G.MemcpyNode(src=int(p.srcDevice), dst=int(p.dstDevice), src_pitch=int(p.srcPitch),
                        dst_pitch=int(p.dstPitch), width=int(p.WidthInBytes), height=int(p.Height),
                        depth=int(p.Depth), src_height=int(p.srcHeight), dst_height=int(p.dstHeight))
    rows = max(node.height, 1) * max(node.depth, 1)
    _check_span(node.src, max(node.src_pitch, node.width) * rows, arena, f"{where} (memcpy source)")
    _check_span(node.dst, max(node.dst_pitch, node.width) * rows, arena, f"{where} (memcpy destination)")
    return node


def _edges(graph, index: dict[int, int]) -> list[G.Edge]:
    r = d.cuGraphGetEdges(graph, 0)
    ck(r, "cuGraphGetEdges")
    n = r[-1]
    if not n:
        return []
    r = ck(d.cuGraphGetEdges(graph, n), "cuGraphGetEdges")
    frm, to = r[0], r[1]
    data = r[2] if len(r) == 4 else None
    out = []
    for k in range(n):
        e = G.Edge(src=index[int(frm[k])], dst=index[int(to[k])])
        if data is not None:
            ed = data[k]
            e = G.Edge(src=e.src, dst=e.dst, src_port=int(ed.from_port), dst_port=int(ed.to_port), type=int(ed.type))
        out.append(e)
    return out


def _check_span(ptr: int, nbytes: int, arena: tuple[int, int], where: str) -> None:
    base, size = arena
    if not (base <= ptr and ptr + nbytes <= base + size):
        raise ExportError(f"{where}: touches {ptr:#x}+{nbytes}, outside the arena [{base:#x}, {base + size:#x})")


def _scan_pointers(buf: bytes, arena: tuple[int, int], where: str, stale_ok: bool = False) -> list[int]:
    """Offsets of 8-byte words of ``buf`` that point at device memory outside the arena. With
    ``stale_ok`` (a TensorIterator kernel, module docstring) they are returned, to be zeroed,
    and printed; otherwise the first one fails the export."""
    base, size = arena
    attr = d.CUpointer_attribute.CU_POINTER_ATTRIBUTE_RANGE_START_ADDR
    stale = []
    for off in range(0, len(buf) - 7, 8):
        v = struct.unpack_from("<Q", buf, off)[0]
        if v == 0 or base <= v < base + size or v < 0x10000 or v >= 1 << 57:
            continue
        err, start = d.cuPointerGetAttribute(attr, d.CUdeviceptr(v))
        if err == SUCCESS:
            # The allocation it falls in, for the diagnosis: a word the kernel never reads as a
            # pointer (padding, an unused slot) can hold a stale address too.
            span = d.cuPointerGetAttribute(d.CUpointer_attribute.CU_POINTER_ATTRIBUTE_RANGE_SIZE, d.CUdeviceptr(v))[1]
            what = (f"{where}: parameter word at offset {off} of {len(buf)} points at {v:#x}, device memory outside "
                    f"the arena [{base:#x}, {base + size:#x}) (in an allocation of {int(span)} bytes at {int(start):#x})")
            if not stale_ok:
                raise ExportError(what)
            print(f"[flare-prepare] zeroed a stale host-stack word of a TensorIterator kernel: {what}", flush=True)
            stale.append(off)
    return stale
