"""The reference executor: eager programs in a torch worker subprocess.

The serving process owns the arena: a shared-memory file with exactly the
manifest's layout, loaded from the arena image here. The worker
(``flare.prepare.reference_worker``) maps the same file, binds the model to
it and runs programs on request. The serving process itself never imports
torch; it talks to the worker over a line protocol on stdin/stdout::

    -> run <program>          <- ok | error <message>
    -> exit

Writes are applied to the shared arena directly when nothing is in flight;
otherwise they are queued with the launches that follow them, so the
executor contract (writes ordered between launches) holds.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

import numpy as np

from flare.core.errors import ExecutionError, ManifestError
from flare.core.image import iter_image
from flare.core.manifest import Manifest
from flare.runtime.executor import NUMPY_DTYPES

READY_TIMEOUT_S = 300.0


def _arena_dir(nbytes: int) -> str:
    env = os.environ.get("FLARE_SHM_DIR")
    if env:
        return env
    try:
        st = os.statvfs("/dev/shm")
        if st.f_bavail * st.f_frsize > nbytes * 1.2:
            return "/dev/shm"
    except OSError:
        pass
    return tempfile.gettempdir()


class ReferenceExecutor:
    def __init__(self, core_dir: str | Path, manifest: Manifest, *, torch_threads: int | None = None):
        self.core_dir = Path(core_dir)
        self.manifest = manifest
        self.torch_threads = torch_threads
        self._path: str | None = None
        self._mm: mmap.mmap | None = None
        self._views: dict[str, np.ndarray] = {}
        self._proc: asyncio.subprocess.Process | None = None
        self._inflight = 0
        self._queue: deque[tuple] = deque()  # ops waiting for in-flight programs
        self._stats = {"programs": 0, "startup_ms": 0}

    # -- lifecycle ---------------------------------------------------------

    async def start(self) -> None:
        t0 = time.perf_counter()
        m = self.manifest
        fd, self._path = tempfile.mkstemp(prefix="flare-arena-", dir=_arena_dir(m.arena.nbytes))
        try:
            os.ftruncate(fd, m.arena.nbytes)
            self._mm = mmap.mmap(fd, m.arena.nbytes)
        finally:
            os.close(fd)
        arena = np.frombuffer(self._mm, dtype=np.uint8)
        for b in m.buffers:
            self._views[b.name] = arena[b.offset : b.offset + b.nbytes].view(NUMPY_DTYPES[b.dtype]).reshape(b.shape)
        image = self.core_dir / m.arena.image
        with image.open("rb") as f:
            for b, off, n in iter_image(image, m):
                f.seek(off)
                if f.readinto(memoryview(self._mm)[b.offset : b.offset + n]) != n:
                    raise ManifestError(f"arena image is truncated at {b.name}", param="arena.image")
        env = dict(os.environ)
        if self.torch_threads:
            env["OMP_NUM_THREADS"] = str(self.torch_threads)
        self._proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "flare.prepare.reference_worker", str(self.core_dir), self._path,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env,
        )
        try:
            line = await asyncio.wait_for(self._proc.stdout.readline(), READY_TIMEOUT_S)
        except asyncio.TimeoutError:
            line = b""
        if line.strip() != b"ready":
            await self.close()
            raise ExecutionError(f"reference worker failed to start: {line.decode(errors='replace').strip()!r}",
                                 code="worker_start_failed")
        self._stats["startup_ms"] = int((time.perf_counter() - t0) * 1000)

    async def close(self) -> None:
        if self._proc is not None and self._proc.returncode is None:
            try:
                self._proc.stdin.write(b"exit\n")
                await self._proc.stdin.drain()
                await asyncio.wait_for(self._proc.wait(), 10)
            except (BrokenPipeError, ConnectionResetError, asyncio.TimeoutError):
                self._proc.kill()
                await self._proc.wait()
        self._proc = None
        self._views.clear()
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # a view is still alive somewhere; the mapping goes with the process
                pass
            self._mm = None
        if self._path and os.path.exists(self._path):
            os.unlink(self._path)
        self._path = None

    # -- executor interface ------------------------------------------------

    def write(self, buffer: str, value: np.ndarray, row: int | slice | None = None) -> None:
        if self._inflight or self._queue:
            self._queue.append(("write", buffer, np.array(value, copy=True), row))
        else:
            self._apply(buffer, value, row)

    def submit(self, program: str) -> None:
        if self._inflight or self._queue:
            self._queue.append(("run", program))
        else:
            self._send(program)

    async def wait(self) -> None:
        while self._inflight:
            line = await self._proc.stdout.readline()
            self._inflight -= 1
            if not line:
                raise ExecutionError("reference worker exited", code="worker_died")
            if line.startswith(b"error"):
                raise ExecutionError(f"program failed in the reference worker: {line[6:].decode().strip()}")
            while self._queue and not self._inflight:
                op = self._queue.popleft()
                if op[0] == "write":
                    self._apply(op[1], op[2], op[3])
                else:
                    self._send(op[1])

    def read(self, buffer: str) -> np.ndarray:
        return self._views[buffer].copy()

    def view(self, buffer: str) -> np.ndarray:
        """Direct host view (reference arena only; tests and diagnostics)."""
        return self._views[buffer]

    def stats(self) -> dict[str, int]:
        return dict(self._stats)

    # -- internals ---------------------------------------------------------

    def _apply(self, buffer: str, value: np.ndarray, row: int | slice | None) -> None:
        view = self._views[buffer]
        if row is None:
            flat = np.asarray(value, dtype=view.dtype).reshape(-1)
            view.reshape(-1)[: flat.size] = flat
        else:
            view[row] = value

    def _send(self, program: str) -> None:
        if self._proc is None or self._proc.returncode is not None:
            raise ExecutionError("reference worker is not running", code="worker_died")
        self._proc.stdin.write(f"run {program}\n".encode())
        self._inflight += 1
        self._stats["programs"] += 1
