"""Build and load the pool allocator (allocator.c) used for every torch allocation."""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
from pathlib import Path

from flare.prepare.sources import cache_dir

_SRC = Path(__file__).with_name("allocator.c")


class PoolAllocator:
    def __init__(self, base: int, size: int):
        src = _SRC.read_bytes()
        so = cache_dir() / "build" / f"flare_pool_{hashlib.sha256(src).hexdigest()[:12]}.so"
        if not so.is_file():
            so.parent.mkdir(parents=True, exist_ok=True)
            # Prepares run side by side on a cold machine: each compiles to its own file and the
            # rename (atomic) publishes whichever finishes; a shared temporary name raced.
            tmp = so.with_name(f"{so.stem}.{os.getpid()}.tmp.so")
            subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", str(tmp), str(_SRC)], check=True)
            os.replace(tmp, so)
        self.path = str(so)
        self.lib = ctypes.CDLL(self.path)
        self.lib.flare_pool_set.argtypes = [ctypes.c_size_t, ctypes.c_size_t]
        for fn in ("flare_pool_used", "flare_pool_nalloc", "flare_pool_nfree", "flare_pool_failed"):
            getattr(self.lib, fn).restype = ctypes.c_size_t
        self.base = base
        self.size = size
        self.lib.flare_pool_set(base, size)

    @property
    def used(self) -> int:
        return int(self.lib.flare_pool_used())

    def stats(self) -> dict[str, int]:
        return {
            "used": self.used,
            "reserved": self.size,
            "segments": int(self.lib.flare_pool_nalloc()),
            "frees": int(self.lib.flare_pool_nfree()),
            "failed": int(self.lib.flare_pool_failed()),
        }
