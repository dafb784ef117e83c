"""Recording every kernel binary loaded while preparing.

Two sources, installed before torch initialises CUDA:

* CUPTI's resource callback (MODULE_LOADED) copies every module image the
  driver loads: torch-native kernels, cuBLAS, and anything else.
* Triton's ``CompiledKernel._init_handles`` is wrapped to record the exact
  (function handle -> cubin) pair for every Triton kernel, including
  Inductor's, because names alone do not identify a Triton kernel (two
  kernels compiled for different shapes can share a name).

``resolve`` then maps a kernel node's function handle to (image, name).
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import os
import struct
import sys
from dataclasses import dataclass, field

from cuda.bindings import driver as d

from flare.runtime.cuda_driver import SUCCESS, ck


class ImageCaptureError(RuntimeError):
    pass


class _ResourceData(ctypes.Structure):
    _fields_ = [("context", ctypes.c_void_p), ("resourceHandle", ctypes.c_void_p),
                ("resourceDescriptor", ctypes.c_void_p)]


class _ModuleResourceData(ctypes.Structure):
    _fields_ = [("moduleId", ctypes.c_uint32), ("cubinSize", ctypes.c_size_t), ("pCubin", ctypes.c_void_p)]


_DOMAIN_RESOURCE = 3
_CBID_MODULE_LOADED = 6
_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p)


def sha256(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


@dataclass
class Image:
    sha: str
    data: bytes
    functions: dict[str, str] | None  # ELF function symbol -> sha of its .text section (None: not ELF)


@dataclass
class ImageRecorder:
    images: dict[str, Image] = field(default_factory=dict)
    triton: dict[int, tuple[str, str]] = field(default_factory=dict)  # function handle -> (image sha, name)
    callback_errors: list[str] = field(default_factory=list)
    _cupti: object = None
    _sub: ctypes.c_void_p = field(default_factory=ctypes.c_void_p)
    _cb: object = None

    # -- installation -------------------------------------------------------

    def install_cupti(self) -> str:
        libs = _find_libcupti()
        if not libs:
            raise ImageCaptureError("libcupti not found (pip package nvidia-cuda-cupti or the CUDA toolkit)")
        lib = ctypes.CDLL(libs[0])
        lib.cuptiSubscribe.argtypes = [ctypes.POINTER(ctypes.c_void_p), _CALLBACK, ctypes.c_void_p]
        lib.cuptiSubscribe.restype = ctypes.c_int
        lib.cuptiEnableCallback.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32]
        lib.cuptiEnableCallback.restype = ctypes.c_int
        self._cb = _CALLBACK(self._on_callback)
        rc = lib.cuptiSubscribe(ctypes.byref(self._sub), self._cb, None)
        if rc != 0:
            raise ImageCaptureError(f"cuptiSubscribe failed ({rc})")
        rc = lib.cuptiEnableCallback(1, self._sub, _DOMAIN_RESOURCE, _CBID_MODULE_LOADED)
        if rc != 0:
            raise ImageCaptureError(f"cuptiEnableCallback(MODULE_LOADED) failed ({rc})")
        self._cupti = lib
        return libs[0]

    def install_triton_hook(self) -> None:
        from triton.compiler.compiler import CompiledKernel

        if getattr(CompiledKernel._init_handles, "_flare_wrapped", False):
            return
        original = CompiledKernel._init_handles
        recorder = self

        def _init_handles(kernel_self):
            original(kernel_self)
            fn = getattr(kernel_self, "function", None)
            binary = getattr(kernel_self, "kernel", None)
            if fn and isinstance(binary, (bytes, bytearray)):
                img = recorder._add(bytes(binary))
                recorder.triton[int(fn)] = (img.sha, kernel_self.name)

        _init_handles._flare_wrapped = True
        CompiledKernel._init_handles = _init_handles

    def _on_callback(self, userdata, domain, cbid, cbdata):
        try:
            if domain != _DOMAIN_RESOURCE or cbid != _CBID_MODULE_LOADED or not cbdata:
                return
            rd = _ResourceData.from_address(cbdata)
            if not rd.resourceDescriptor:
                return
            md = _ModuleResourceData.from_address(rd.resourceDescriptor)
            if md.pCubin and md.cubinSize:
                self._add(ctypes.string_at(md.pCubin, md.cubinSize))
        except Exception as e:  # never raise into CUPTI
            self.callback_errors.append(repr(e))

    def _add(self, data: bytes) -> Image:
        key = sha256(data)
        img = self.images.get(key)
        if img is None:
            img = Image(key, data, elf_functions(data))
            self.images[key] = img
        return img

    # -- resolution -----------------------------------------------------------

    def resolve(self, func) -> tuple[str, str]:
        """(image sha, function name) for a CUfunction handle, unambiguously or not at all."""
        handle = int(func)
        if handle in self.triton:
            return self.triton[handle]
        name = _func_name(func)
        candidates = [i for i in self.images.values() if i.functions and name in i.functions]
        if len(candidates) > 1:
            module_names = _module_function_names(func)
            if module_names:
                narrowed = [i for i in candidates if module_names <= set(i.functions)]
                candidates = narrowed or candidates
        if len(candidates) > 1 and len({i.functions[name] for i in candidates}) == 1:
            candidates = candidates[:1]  # byte-identical code: any copy is the same kernel
        if len(candidates) > 1:
            # Last resort: load each candidate privately and keep those whose compiled
            # function reports the same resource attributes as the launched one.
            want = _identity_attributes(func)
            candidates = [i for i in candidates if _trial_attributes(i.data, name) == want]
        if not candidates:
            raise ImageCaptureError(f"no recorded binary defines kernel {name!r}")
        if len(candidates) > 1:
            raise ImageCaptureError(f"kernel {name!r} is defined differently by {len(candidates)} recorded binaries")
        return candidates[0].sha, name


_IDENTITY = ("CU_FUNC_ATTRIBUTE_NUM_REGS", "CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES",
             "CU_FUNC_ATTRIBUTE_CONST_SIZE_BYTES", "CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES",
             "CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK", "CU_FUNC_ATTRIBUTE_BINARY_VERSION")


def _identity_attributes(func) -> tuple:
    out = []
    for name in _IDENTITY:
        r = d.cuFuncGetAttribute(getattr(d.CUfunction_attribute, name), func)
        out.append(int(r[1]) if r[0] == SUCCESS else None)
    return tuple(out)


def _trial_attributes(image: bytes, name: str) -> tuple | None:
    r = d.cuModuleLoadData(image)
    if r[0] != SUCCESS:
        return None
    try:
        f = d.cuModuleGetFunction(r[1], name.encode())
        return _identity_attributes(f[1]) if f[0] == SUCCESS else None
    finally:
        d.cuModuleUnload(r[1])


def _func_name(func) -> str:
    name = ck(d.cuFuncGetName(func), "cuFuncGetName")
    return name.decode() if isinstance(name, (bytes, bytearray)) else str(name)


def _module_function_names(func) -> set[str] | None:
    r = d.cuFuncGetModule(func)
    if r[0] != SUCCESS:
        return None
    n = d.cuModuleGetFunctionCount(r[1])
    if n[0] != SUCCESS:
        return None
    fns = d.cuModuleEnumerateFunctions(n[1], r[1])
    if fns[0] != SUCCESS:
        return None
    return {_func_name(f) for f in fns[1]}


def _find_libcupti() -> list[str]:
    found: set[str] = set()
    for p in sys.path:
        if p and os.path.isdir(os.path.join(p, "nvidia")):
            found.update(glob.glob(os.path.join(p, "nvidia", "**", "libcupti.so*"), recursive=True))
    found.update(glob.glob("/usr/local/cuda*/extras/CUPTI/lib64/libcupti.so*"))
    found.update(glob.glob("/usr/local/cuda*/lib64/libcupti.so*"))
    return sorted(p for p in found if os.path.isfile(p))


def elf_functions(img: bytes) -> dict[str, str] | None:
    """Function symbols of an ELF64 image -> sha of the section holding them."""
    if len(img) < 64 or img[:4] != b"\x7fELF" or img[4] != 2:
        return None
    shoff = struct.unpack_from("<Q", img, 0x28)[0]
    shentsize, shnum, _ = struct.unpack_from("<HHH", img, 0x3A)
    secs = [struct.unpack_from("<IIQQQQIIQQ", img, shoff + i * shentsize) for i in range(shnum)]
    out: dict[str, str] = {}
    for s in secs:
        if s[1] != 2:  # SHT_SYMTAB
            continue
        strtab = secs[s[6]][4]
        for j in range(s[5] // 24):
            st_name, st_info, _, st_shndx, _, _ = struct.unpack_from("<IBBHQQ", img, s[4] + j * 24)
            if (st_info & 0xF) != 2 or not st_name:  # STT_FUNC
                continue
            end = img.index(b"\0", strtab + st_name)
            name = img[strtab + st_name : end].decode("latin1")
            text = b""
            if 0 < st_shndx < len(secs):
                sec = secs[st_shndx]
                text = img[sec[4] : sec[4] + sec[5]]
            out[name] = hashlib.sha256(text).hexdigest()[:16]
    return out
