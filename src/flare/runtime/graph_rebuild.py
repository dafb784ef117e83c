"""Rehydrating exported graphs: kernel images loaded, graphs rebuilt node by node.

The export (``prepare/cuda/export.py``) walked each captured graph and recorded
every node verbatim (``flare.core.graph``); this module turns those records back
into a live graph in a process without torch: load every kernel image of the
kernel table (checking that the compiled code is the one prepared), re-apply
the function attributes the launches need (dynamic shared memory, cluster
policy), add each node with its raw parameter bytes and launch attributes,
restore the edges, and instantiate. Everything here allocates, loads or
instantiates, so it runs only before the executor is ready; the counters say
so (``counts``).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

from cuda.bindings import driver as d

from flare.core import graph as G
from flare.core.errors import ManifestError
from flare.runtime.cuda_driver import SUCCESS, ck

ATTR_RAW_SIZE = 64
_SETTABLE_FUNC_ATTRS = {
    "CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES",
    "CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT",
    "CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED",
    "CU_FUNC_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE",
    "CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_WIDTH",
    "CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_HEIGHT",
    "CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_DEPTH",
}
# Read-only attributes that identify the compiled code: a mismatch means the wrong binary.
_IDENTITY_FUNC_ATTRS = (
    "CU_FUNC_ATTRIBUTE_NUM_REGS",
    "CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES",
    "CU_FUNC_ATTRIBUTE_CONST_SIZE_BYTES",
    "CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES",
    "CU_FUNC_ATTRIBUTE_BINARY_VERSION",
)


class GraphRebuilder:
    """One rank's kernels and graphs in the current context. Owns what it creates
    (modules, graphs, executables, the parameter buffers nodes point at) until
    ``destroy``."""

    def __init__(self, rank_dir: Path, kernel_table: str, context):
        self.rank_dir = rank_dir
        self.kernel_table_file = kernel_table
        self.context = context
        self.counts = {"module_loads": 0, "instantiations": 0}
        self.functions: list = []  # function handles by kernel-table index
        self.table: G.KernelTable | None = None
        self._modules: list = []
        self._graphs: list = []
        self._execs: list = []
        self._keep: list = []

    def load_kernels(self) -> list:
        """Load every kernel image and look up every function; returns the handles."""
        table = G.load_kernel_table(self.rank_dir / self.kernel_table_file)
        modules = {}
        for img in table.images:
            data = (self.rank_dir / "kernels" / f"{img.sha}.cubin").read_bytes()
            if len(data) != img.nbytes:
                raise ManifestError(f"kernel image {img.sha} is {len(data)} bytes, expected {img.nbytes}",
                                    param="kernels")
            modules[img.sha] = ck(d.cuModuleLoadData(data), f"cuModuleLoadData {img.sha[:12]}")
            self._modules.append(modules[img.sha])  # owned (unloaded by destroy) as soon as loaded
            self.counts["module_loads"] += 1
        functions = []
        for kf in table.functions:
            r = d.cuModuleGetFunction(modules[kf.image], kf.name.encode())
            if r[0] != SUCCESS:
                raise ManifestError(f"kernel {kf.name!r} not found in image {kf.image[:12]}", param="kernels")
            f = r[1]
            for name in _IDENTITY_FUNC_ATTRS:
                if name in kf.attributes:
                    have = ck(d.cuFuncGetAttribute(getattr(d.CUfunction_attribute, name), f), "cuFuncGetAttribute")
                    if int(have) != kf.attributes[name]:
                        raise ManifestError(f"kernel {kf.name!r}: {name} is {have}, prepared {kf.attributes[name]}",
                                            param="kernels", code="kernel_mismatch")
            functions.append(f)
        self.table = table
        self.functions = functions
        return functions

    def build(self, spec: G.GraphSpec, stream):
        """The program's graph rebuilt, instantiated and uploaded: its executable."""
        graph = ck(d.cuGraphCreate(0), "cuGraphCreate")
        self._graphs.append(graph)
        self.apply_attributes_for(spec)
        handles = [self.add_node(graph, node) for node in spec.nodes]
        if spec.edges:
            frm = [handles[e.src] for e in spec.edges]
            to = [handles[e.dst] for e in spec.edges]
            data = []
            for e in spec.edges:
                ed = d.CUgraphEdgeData()
                ed.from_port, ed.to_port, ed.type = e.src_port, e.dst_port, e.type
                data.append(ed)
            ck(d.cuGraphAddDependencies(graph, frm, to, data, len(frm)), "cuGraphAddDependencies")
        flags = int(d.CUgraphInstantiate_flags.CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY.value)
        gexec = ck(d.cuGraphInstantiate(graph, flags), f"cuGraphInstantiate {spec.program}")
        self._execs.append(gexec)
        self.counts["instantiations"] += 1
        ck(d.cuGraphUpload(gexec, stream), "cuGraphUpload")
        return gexec

    def apply_attributes_for(self, spec: G.GraphSpec) -> None:
        """Function attributes for every kernel of ``spec``, with the largest dynamic
        shared memory any of its launches of that function needs."""
        smem_needed: dict[int, int] = {}
        for node in spec.nodes:
            if isinstance(node, G.KernelNode):
                smem_needed[node.function] = max(smem_needed.get(node.function, 0), node.shared_bytes)
        for fidx, smem in smem_needed.items():
            self._apply_function_attributes(fidx, smem)

    def add_node(self, graph, node):
        """One exported node added to ``graph`` with no dependencies; returns its handle."""
        if isinstance(node, G.KernelNode):
            return self._kernel_node(graph, node)
        if isinstance(node, G.MemsetNode):
            p = d.CUDA_MEMSET_NODE_PARAMS()
            p.dst = d.CUdeviceptr(node.dst)
            p.pitch, p.value, p.elementSize = node.pitch, node.value, node.element_size
            p.width, p.height = node.width, node.height
            return ck(d.cuGraphAddMemsetNode(graph, None, 0, p, self.context), "memset node")
        if isinstance(node, G.MemcpyNode):
            p = d.CUDA_MEMCPY3D()
            p.srcMemoryType = d.CUmemorytype.CU_MEMORYTYPE_DEVICE
            p.dstMemoryType = d.CUmemorytype.CU_MEMORYTYPE_DEVICE
            p.srcDevice, p.dstDevice = d.CUdeviceptr(node.src), d.CUdeviceptr(node.dst)
            p.srcPitch, p.dstPitch = node.src_pitch, node.dst_pitch
            p.srcHeight, p.dstHeight = node.src_height, node.dst_height
            p.WidthInBytes, p.Height, p.Depth = node.width, node.height, node.depth
            return ck(d.cuGraphAddMemcpyNode(graph, None, 0, p, self.context), "memcpy node")
        return ck(d.cuGraphAddEmptyNode(graph, None, 0), "empty node")

    def function_name(self, index: int) -> str:
        return self.table.functions[index].name

    def _apply_function_attributes(self, fidx: int, smem: int) -> None:
        kf = self.table.functions[fidx]
        f = self.functions[fidx]
        for name, want in kf.attributes.items():
            if name not in _SETTABLE_FUNC_ATTRS:
                continue
            if name == "CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES":
                want = max(want, smem)
            attr = getattr(d.CUfunction_attribute, name, None)
            if attr is None:
                continue
            r = d.cuFuncGetAttribute(attr, f)
            if r[0] == SUCCESS and int(r[1]) == want:
                continue
            ck(d.cuFuncSetAttribute(f, attr, want), f"cuFuncSetAttribute {name} on {kf.name[:60]}")

    def _kernel_node(self, graph, node: G.KernelNode):
        p = d.CUDA_KERNEL_NODE_PARAMS()
        p.func = self.functions[node.function]
        p.gridDimX, p.gridDimY, p.gridDimZ = node.grid
        p.blockDimX, p.blockDimY, p.blockDimZ = node.block
        p.sharedMemBytes = node.shared_bytes
        buf = ctypes.create_string_buffer(node.params, max(len(node.params), 8))
        ptrs = (ctypes.c_void_p * max(len(node.param_layout), 1))()
        for j, (off, _) in enumerate(node.param_layout):
            ptrs[j] = ctypes.addressof(buf) + off
        self._keep += [buf, ptrs]
        p.kernelParams = ctypes.addressof(ptrs)
        handle = ck(d.cuGraphAddKernelNode(graph, None, 0, p), "cuGraphAddKernelNode")
        for a in node.attributes:
            aid = getattr(d.CUkernelNodeAttrID, a.name, None)
            if aid is None:
                raise ManifestError(f"launch attribute {a.name} is unknown to this driver binding", param="graphs")
            r = d.cuGraphKernelNodeGetAttribute(handle, aid)
            if r[0] == SUCCESS and ctypes.string_at(r[1].getPtr(), ATTR_RAW_SIZE) == a.raw:
                continue
            v = d.CUkernelNodeAttrValue()
            ctypes.memmove(v.getPtr(), a.raw, ATTR_RAW_SIZE)
            ck(d.cuGraphKernelNodeSetAttribute(handle, aid, v), f"set {a.name}")
        return handle

    def destroy(self) -> None:
        for gexec in self._execs:
            d.cuGraphExecDestroy(gexec)
        for g in self._graphs:
            d.cuGraphDestroy(g)
        for mod in self._modules:
            d.cuModuleUnload(mod)
        self._execs, self._graphs, self._modules, self._keep = [], [], [], []
