"""The engine: the asyncio loop that drives the scheduler through an executor.

One task owns the scheduler and the executor. Each iteration asks the
scheduler for a step, stages its writes, launches its program, awaits the
completion and applies it; request sinks are called from here and must not
block. HTTP handlers only call ``submit`` and ``cancel``, which are
synchronous and never touch the executor.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time

from flare.core.errors import CapacityError, ExecutionError, FlareError
from flare.runtime.executor import Executor
from flare.runtime.request import Request
from flare.runtime.scheduler import Scheduler

log = logging.getLogger("flare.engine")


class EngineState(str, enum.Enum):
    starting = "starting"
    ready = "ready"
    stopping = "stopping"
    stopped = "stopped"
    failed = "failed"


class Engine:
    def __init__(self, executor: Executor, *, max_waiting: int = 256, prefix_cache: bool = True):
        self.executor = executor
        self.manifest = executor.manifest
        self.scheduler = Scheduler(self.manifest, max_waiting=max_waiting, prefix_cache=prefix_cache)
        self.state = EngineState.starting
        self.failure: Exception | None = None
        self.steps = 0
        self.started_wall = time.time()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        await self.executor.start()
        self._task = asyncio.create_task(self._run(), name="flare-engine")
        self.state = EngineState.ready

    @property
    def ready(self) -> bool:
        return self.state == EngineState.ready

    def submit(self, req: Request) -> None:
        """Queue a request (raises AdmissionError / FrontendError / CapacityError)."""
        if self.state == EngineState.failed:
            raise CapacityError(f"the engine failed: {self.failure}", code="engine_failed")
        if self.state != EngineState.ready:
            raise CapacityError(f"the server is {self.state.value}", code=f"engine_{self.state.value}")
        self.scheduler.add(req)
        self._wake.set()

    def cancel(self, req: Request) -> None:
        if not req.finished:
            self.scheduler.cancel(req)
            self._wake.set()

    async def _run(self) -> None:
        sched, ex = self.scheduler, self.executor
        try:
            while True:
                step = sched.schedule()
                if step is None:
                    if self.state != EngineState.ready and not sched.has_work():
                        return
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                for w in step.writes:
                    ex.write(w.buffer, w.value, w.row)
                ex.submit(step.program)
                await ex.wait()
                records = ex.read(step.completion) if step.completion else None
                sched.complete(step, records)
                self.steps += 1
                # Let HTTP handlers run between steps even when the executor answers instantly.
                await asyncio.sleep(0)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            err = e if isinstance(e, FlareError) else ExecutionError(f"engine loop failed: {e!r}")
            log.exception("engine failed: %s", err)
            self.failure = err
            self.state = EngineState.failed
            sched.fail_all(err)

    async def shutdown(self, grace_s: float = 10.0) -> None:
        """Stop admission, let running requests finish within the grace period, cancel
        the rest, drain the executor and release it."""
        if self.state in (EngineState.stopped,):
            return
        if self.state == EngineState.ready:
            self.state = EngineState.stopping
        deadline = time.monotonic() + grace_s
        while self.scheduler.has_work() and time.monotonic() < deadline and self.state == EngineState.stopping:
            await asyncio.sleep(0.02)
        for req in list(self.scheduler.running) + list(self.scheduler.waiting):
            self.scheduler.cancel(req)
        self._wake.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, timeout=max(5.0, grace_s))
            except asyncio.TimeoutError:
                self._task.cancel()
            except Exception:
                pass
        if self.state != EngineState.failed:
            self.state = EngineState.stopped
        await self.executor.close()
