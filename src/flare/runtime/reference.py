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

Tensor-parallel cores (docs/tensor-parallel.md): one arena and one worker per
rank, the workers joined in a gloo group. Every write goes to every rank's
arena and every launch to every rank, in the same order, so admission is
identical on every rank; reads return rank 0's outputs. A rank that exits or
fails stops every rank (its peers would otherwise wait inside a collective).
"""

from __future__ import annotations

import asyncio
import mmap
import os
import socket
import tempfile
import time
from collections import deque
from pathlib import Path

import numpy as np

from flare.core.errors import ExecutionError, ManifestError
from flare.core.image import iter_image
from flare.core.manifest import Manifest, rank_images
from flare.runtime.executor import MAX_IN_FLIGHT, NUMPY_DTYPES, check_row
from flare.zygote import worker_command

READY_TIMEOUT_S = 300.0
PEER_DEATH_GRACE_S = 1.0  # how long a rank's error waits to be explained by a peer's death
PEER_DEATH_POLL_S = 4.0  # and then how long it looks for a peer's process gone (CI: 1 s was not always enough)


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


def _exited(proc: asyncio.subprocess.Process | None) -> bool:
    """Whether the process has exited, reaped or not (a zombie until the event loop reaps it)."""
    if proc is None or proc.returncode is not None:
        return True
    try:
        stat = Path(f"/proc/{proc.pid}/stat").read_text()
    except OSError:  # gone, where /proc exists (elsewhere: not known, so not exited)
        return Path("/proc/self").exists()
    return stat.rsplit(")", 1)[-1].split()[:1] in (["Z"], ["X"])


class _Rank:
    """One rank's shared arena file, its host views and its worker process."""

    def __init__(self, path: str, mm: mmap.mmap, views: dict[str, np.ndarray]):
        self.path = path
        self.mm = mm
        self.views = views
        self.proc: asyncio.subprocess.Process | None = None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def stop(self, *, kill: bool) -> None:
        """Ask the worker to exit (or kill it at once) and reap it."""
        if self.alive and not kill:
            try:
                self.proc.stdin.write(b"exit\n")
                await self.proc.stdin.drain()
                await asyncio.wait_for(self.proc.wait(), 10)
            except (BrokenPipeError, ConnectionResetError, asyncio.TimeoutError):
                pass
        if self.alive:
            self.proc.kill()
            await self.proc.wait()
        self.proc = None

    def release(self) -> None:
        self.views.clear()
        try:
            self.mm.close()
        except BufferError:  # a view is still alive somewhere; the mapping goes with the process
            pass
        if os.path.exists(self.path):
            os.unlink(self.path)


class ReferenceExecutor:
    def __init__(self, core_dir: str | Path, manifest: Manifest, *, torch_threads: int | None = None):
        self.core_dir = Path(core_dir)
        self.manifest = manifest
        self.torch_threads = torch_threads
        self._ranks: list[_Rank] = []
        self._sent: deque[tuple[int, str]] = deque()  # (ticket, program) sent to the workers
        self._queue: deque[tuple] = deque()  # ops waiting for in-flight programs
        self._tickets = 0  # programs submitted
        self._done = 0  # programs completed (they complete in ticket order)
        self._completions: dict[int, np.ndarray] = {}
        self._completion_of = {p.name: p.completion for p in manifest.programs}
        self._stats = {"programs": 0, "startup_ms": 0, "tp_size": manifest.parallel.tp_size}

    # -- lifecycle ---------------------------------------------------------

    async def start(self) -> None:
        t0 = time.perf_counter()
        m = self.manifest
        try:
            for image in rank_images(self.core_dir, m):
                self._ranks.append(self._map_arena(image))
            await self._start_workers()
        except BaseException:
            await self.close()
            raise
        self._stats["startup_ms"] = int((time.perf_counter() - t0) * 1000)

    def _map_arena(self, image: Path) -> _Rank:
        m = self.manifest
        fd, path = tempfile.mkstemp(prefix="flare-arena-", dir=_arena_dir(m.arena.nbytes))
        try:
            os.ftruncate(fd, m.arena.nbytes)
            mm = mmap.mmap(fd, m.arena.nbytes)
        finally:
            os.close(fd)
        rank = _Rank(path, mm, {})
        arena = np.frombuffer(mm, dtype=np.uint8)
        for b in m.buffers:
            rank.views[b.name] = arena[b.offset : b.offset + b.nbytes].view(NUMPY_DTYPES[b.dtype]).reshape(b.shape)
        with image.open("rb") as f:
            for b, off, n in iter_image(image, m):
                f.seek(off)
                if f.readinto(memoryview(mm)[b.offset : b.offset + n]) != n:
                    raise ManifestError(f"arena image is truncated at {b.name}", param="arena.image")
        return rank

    async def _start_workers(self) -> None:
        env = dict(os.environ)
        if self.torch_threads:
            env["OMP_NUM_THREADS"] = str(self.torch_threads)
        group = []
        if len(self._ranks) > 1:
            with socket.socket() as s:  # rank 0's gloo store
                s.bind(("127.0.0.1", 0))
                addr = f"127.0.0.1:{s.getsockname()[1]}"
        for r, rank in enumerate(self._ranks):
            if len(self._ranks) > 1:
                group = [str(r), addr]
            rank.proc = await asyncio.create_subprocess_exec(
                *worker_command("flare.prepare.reference_worker"), str(self.core_dir), rank.path, *group,
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env,
            )

        await self._collect(b"ready", starting=True)

    async def close(self) -> None:
        for rank in self._ranks:
            await rank.stop(kill=False)
        for rank in self._ranks:
            rank.release()
        self._ranks.clear()

    # -- executor interface ------------------------------------------------

    def write(self, buffer: str, value: np.ndarray, row: int | slice | None = None) -> None:
        if row is not None:
            check_row(buffer, self._ranks[0].views[buffer].shape, row)
        if self._sent or self._queue:
            self._queue.append(("write", buffer, np.array(value, copy=True), row))
        else:
            self._apply(buffer, value, row)

    def submit(self, program: str) -> int:
        ticket = self._tickets
        self._tickets += 1
        if self._sent or self._queue:
            self._queue.append(("run", program, ticket))
        else:
            self._send(program, ticket)
        return ticket

    async def wait(self, ticket: int | None = None) -> None:
        target = self._tickets if ticket is None else ticket + 1
        while self._done < target and self._sent:
            await self._collect(b"ok")
            t, program = self._sent.popleft()
            self._done = t + 1
            # The workers run one program at a time and the next one is sent only now,
            # so the completion buffer still holds what this program wrote.
            name = self._completion_of.get(program)
            if name:
                self._completions[t] = self._ranks[0].views[name].copy()
            for old in [k for k in self._completions if k <= t - MAX_IN_FLIGHT]:
                del self._completions[old]
            while self._queue and not self._sent:
                op = self._queue.popleft()
                if op[0] == "write":
                    self._apply(op[1], op[2], op[3])
                else:
                    self._send(op[1], op[2])

    def completion(self, ticket: int) -> np.ndarray:
        if ticket not in self._completions:
            raise ExecutionError(f"no completion record for ticket {ticket}", code="bad_completion")
        return self._completions[ticket].copy()

    def read(self, buffer: str) -> np.ndarray:
        return self._ranks[0].views[buffer].copy()

    def view(self, buffer: str, rank: int = 0) -> np.ndarray:
        """Direct host view (reference arena only; tests and diagnostics)."""
        return self._ranks[rank].views[buffer]

    def worker_pids(self) -> list[int]:
        """Each rank's worker process id, in rank order (tests and diagnostics); with a zygote
        (``flare.zygote``), its client's, whose end is the worker's."""
        return [rank.proc.pid for rank in self._ranks if rank.proc is not None]

    def stats(self) -> dict[str, int]:
        return dict(self._stats)

    # -- internals ---------------------------------------------------------

    async def _collect(self, expected: bytes, *, starting: bool = False) -> None:
        """One line from every rank, which must be ``expected``. The first rank that
        exits, reports an error or fails to start stops every rank: a peer blocked in a
        collective (or in joining the group) would never answer."""
        pending = {asyncio.ensure_future(rank.proc.stdout.readline()): r for r, rank in enumerate(self._ranks)}
        failure: ExecutionError | None = None
        try:
            while pending and failure is None:
                done, _ = await asyncio.wait(pending, timeout=READY_TIMEOUT_S if starting else None,
                                             return_when=asyncio.FIRST_COMPLETED)
                if not done:
                    failure = ExecutionError("reference workers did not start in time", code="worker_start_failed")
                for task in done:
                    r = pending.pop(task)
                    line = task.result()
                    if line.strip() == expected or failure is not None:
                        continue
                    which = f" (rank {r})" if len(self._ranks) > 1 else ""
                    if starting:
                        failure = ExecutionError(f"reference worker{which} failed to start: "
                                                 f"{line.decode(errors='replace').strip()!r}", code="worker_start_failed")
                    elif not line:
                        failure = ExecutionError(f"reference worker exited{which}", code="worker_died")
                    else:
                        failure = ExecutionError(
                            f"program failed in the reference worker{which}: {line[6:].decode().strip()}")
                        failure = await self._peer_death(pending) or failure
        finally:
            for task in pending:
                task.cancel()
        if failure is not None:
            self._kill_all()
            for rank in self._ranks:
                await rank.stop(kill=True)
            raise failure

    async def _peer_death(self, pending: dict) -> ExecutionError | None:
        """A rank's error can be its collective failing because a peer died: the peer's
        death, seen within a moment (its stdout closes when it dies, or its process is gone
        or a zombie: a child still holding the pipe keeps it open), is the cause to report."""
        if not pending:
            return None
        done, _ = await asyncio.wait(pending, timeout=PEER_DEATH_GRACE_S)
        for task in done:
            r = pending.pop(task)
            if not task.result():
                return ExecutionError(f"reference worker exited (rank {r})", code="worker_died")
        # A killed peer can take longer to be seen gone on a loaded machine (its memory torn down
        # before it becomes a zombie): look again for a few seconds before blaming the rank.
        loop = asyncio.get_running_loop()
        until = loop.time() + PEER_DEATH_POLL_S
        while pending:
            for task, r in pending.items():
                if (task.done() and not task.result()) or _exited(self._ranks[r].proc):
                    return ExecutionError(f"reference worker exited (rank {r})", code="worker_died")
            if loop.time() >= until:
                break
            await asyncio.sleep(0.05)
        return None

    def _kill_all(self) -> None:
        """Stop every rank now (the executor is broken from here on; close() reaps)."""
        self._sent.clear()
        self._queue.clear()
        for rank in self._ranks:
            if rank.alive:
                rank.proc.kill()

    def _apply(self, buffer: str, value: np.ndarray, row: int | slice | None) -> None:
        for rank in self._ranks:
            view = rank.views[buffer]
            if row is None:
                flat = np.asarray(value, dtype=view.dtype).reshape(-1)
                view.reshape(-1)[: flat.size] = flat
            else:
                view[row] = value

    def _send(self, program: str, ticket: int) -> None:
        for r, rank in enumerate(self._ranks):
            if not rank.alive:
                self._kill_all()
                raise ExecutionError(f"reference worker (rank {r}) is not running", code="worker_died")
        for rank in self._ranks:
            rank.proc.stdin.write(f"run {program}\n".encode())
        self._sent.append((ticket, program))
        self._stats["programs"] += 1
