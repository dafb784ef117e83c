"""Exported CUDA graphs and kernel binaries: the part of the contract a CUDA core adds.

A graph file holds one captured program: its nodes (kernel, memset, memcpy,
empty) and edges, with kernel parameters as raw bytes exactly as the driver
saw them. Device pointers inside those bytes are valid in the runtime because
the arena is mapped at the same virtual address. Kernels refer to entries of
the core's kernel table by index; each entry names a function inside a
binary image stored under ``kernels/`` by content hash.
"""

from __future__ import annotations

from pathlib import Path
from typing import Union

import msgspec

from flare.core.errors import ManifestError


class _Frozen(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    pass


class KernelImage(_Frozen):
    sha: str  # sha256 of the image bytes (file kernels/<sha>.cubin)
    nbytes: int


class KernelFunction(_Frozen):
    image: str  # KernelImage.sha
    name: str
    # Function attributes observed at capture (CU_FUNC_ATTRIBUTE_* name -> value).
    # Settable ones are re-applied at load; read-only ones must match (a mismatch
    # means the wrong binary was resolved).
    attributes: dict[str, int]


class LaunchAttribute(_Frozen):
    name: str  # CU_LAUNCH_ATTRIBUTE_* name
    raw: bytes  # the 64-byte CUlaunchAttributeValue union


class KernelNode(_Frozen, tag="kernel"):
    function: int  # index into the kernel table
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_bytes: int
    params: bytes  # the parameter buffer, laid out by param_layout
    param_layout: tuple[tuple[int, int], ...]  # (offset, size) of each parameter
    attributes: tuple[LaunchAttribute, ...]  # only the ones that differ from the default


class MemsetNode(_Frozen, tag="memset"):
    dst: int
    pitch: int
    value: int
    element_size: int
    width: int
    height: int


class MemcpyNode(_Frozen, tag="memcpy"):
    """Device-to-device copy (the only kind a program may contain)."""

    src: int
    dst: int
    src_pitch: int
    dst_pitch: int
    width: int
    height: int
    depth: int
    src_height: int
    dst_height: int


class EmptyNode(_Frozen, tag="empty"):
    pass


Node = Union[KernelNode, MemsetNode, MemcpyNode, EmptyNode]


class Edge(_Frozen):
    src: int
    dst: int
    src_port: int = 0
    dst_port: int = 0
    type: int = 0  # CUgraphDependencyType (0 = default, 1 = programmatic)


class GraphSpec(_Frozen):
    program: str
    nodes: tuple[Node, ...]
    edges: tuple[Edge, ...]


class KernelTable(_Frozen):
    images: tuple[KernelImage, ...]
    functions: tuple[KernelFunction, ...]


def save(path: Path, obj) -> None:
    path.write_bytes(msgspec.json.encode(obj))


def load_graph(path: Path) -> GraphSpec:
    try:
        g = msgspec.json.decode(path.read_bytes(), type=GraphSpec)
    except (OSError, msgspec.DecodeError) as e:
        raise ManifestError(f"cannot load graph {path}: {e}", param=str(path)) from e
    n = len(g.nodes)
    for e in g.edges:
        if not (0 <= e.src < n and 0 <= e.dst < n):
            raise ManifestError(f"graph {g.program}: edge {e} refers to a missing node", param=str(path))
    return g


def load_kernel_table(path: Path) -> KernelTable:
    try:
        t = msgspec.json.decode(path.read_bytes(), type=KernelTable)
    except (OSError, msgspec.DecodeError) as e:
        raise ManifestError(f"cannot load kernel table {path}: {e}", param=str(path)) from e
    shas = {i.sha for i in t.images}
    for f in t.functions:
        if f.image not in shas:
            raise ManifestError(f"kernel {f.name} refers to missing image {f.image}", param=str(path))
    return t
