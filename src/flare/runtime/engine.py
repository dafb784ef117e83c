"""The engine: the asyncio loop that drives the scheduler through an executor.

One task owns the scheduler and the executor. Each iteration asks the
scheduler for a step, stages its writes, launches its program, awaits the
completion and applies it; request sinks are called from here and must not
block. HTTP handlers only call ``submit`` and ``cancel``, which are
synchronous and never touch the executor.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time

from flare.core import interface as io
from flare.core.errors import CapacityError, ExecutionError, FlareError
from flare.core.manifest import ProgramKind
from flare.runtime.executor import MAX_IN_FLIGHT, Executor
from flare.runtime.metrics import ServingMetrics
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
    def __init__(self, executor: Executor, *, max_waiting: int = 256, prefix_cache: bool = True,
                 steps_in_flight: int = MAX_IN_FLIGHT, prefill_while_decoding: int = 0,
                 decode_with_prefill: bool = False, draft_tokens: int = 0, speculate_always: bool = False,
                 learned_drafts: bool = False, admission_window_s: float = 0.0):
        if not 1 <= steps_in_flight <= MAX_IN_FLIGHT:
            raise ValueError(f"steps_in_flight must be 1 or {MAX_IN_FLIGHT}, not {steps_in_flight}")
        self.executor = executor
        self.manifest = executor.manifest
        self.metrics = ServingMetrics()
        self.scheduler = Scheduler(self.manifest, max_waiting=max_waiting, metrics=self.metrics,
                                   prefix_cache=prefix_cache, prefill_while_decoding=prefill_while_decoding,
                                   decode_with_prefill=decode_with_prefill, draft_tokens=draft_tokens,
                                   speculate_always=speculate_always, learned_drafts=learned_drafts)
        self.state = EngineState.starting
        self.failure: Exception | None = None
        self.steps = 0
        self.steps_in_flight = steps_in_flight
        # Host gap: time from a step's completion being seen with nothing left in flight
        # to the next launch, when that next step was ready (the device idled on the host).
        self.host_gap_s_total = 0.0
        self.host_gaps = 0
        self.started_wall = time.time()
        # Requests between their HTTP body and their submit (rendering and tokenizing run in
        # threads, so prompts sent together reach the scheduler one by one): an idle engine
        # holds its first step up to admission_window_s while any is on its way (``arriving``).
        self.admission_window_s = admission_window_s
        self.arrivals = 0
        self.admission_waits = 0
        self.admission_wait_s_total = 0.0
        self._hold_until: float | None = None  # the current idle period's deadline for arrivals
        self._arrived = asyncio.Event()
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

    @contextlib.contextmanager
    def arriving(self):
        """Brackets one HTTP request from its parsed body to its submit (or its refusal).
        Prompts sent together are rendered in threads and submitted one by one, a few
        milliseconds apart; an idle engine would start the first alone and the others only
        after it (a program each, or one pack program). So when nothing is running or
        queued to run, prompts wait and others are on their way, the engine waits for them,
        up to ``admission_window_s`` in all until it admits, and starts them together. A
        lone request never waits: nothing else is arriving."""
        self.arrivals += 1
        try:
            yield
        finally:
            self.arrivals -= 1
            if not self.arrivals:
                self._arrived.set()

    def _holds(self, sched: Scheduler) -> bool:
        """Whether to wait for arrivals before the next step (``arriving``): prompts wait,
        nothing is running or queued to run (state copies go first), others are on their
        way, and this idle period's window is not spent."""
        if not (sched.waiting and not sched.running and not sched.maintenance_queued
                and self.state == EngineState.ready and self.admission_window_s > 0):
            self._hold_until = None  # the next wait starts a new window
            return False
        return bool(self.arrivals) and (self._hold_until is None
                                        or asyncio.get_running_loop().time() < self._hold_until)

    async def _await_arrivals(self) -> None:
        loop = asyncio.get_running_loop()
        start = loop.time()
        if self._hold_until is None:
            self._hold_until = start + self.admission_window_s
            self.admission_waits += 1
        while self.arrivals and loop.time() < self._hold_until:
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), self._hold_until - loop.time())
            except asyncio.TimeoutError:
                break
        self.admission_wait_s_total += loop.time() - start

    def cancel(self, req: Request) -> None:
        if not req.finished:
            self.scheduler.cancel(req)
            self._wake.set()

    async def _run(self) -> None:
        sched = self.scheduler
        idle_since: float | None = None  # the device ran out of work at this time
        try:
            while True:
                if self._holds(sched):
                    await self._await_arrivals()
                    if idle_since is not None:  # the device waited by choice, not on the host
                        idle_since = time.perf_counter()
                step = sched.schedule()
                if step is None:
                    idle_since = None
                    if self.state != EngineState.ready and not sched.has_work():
                        return
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                if idle_since is not None:
                    self.host_gap_s_total += time.perf_counter() - idle_since
                    self.host_gaps += 1
                ticket = self._launch(step)
                while step is not None:
                    # Two steps in flight: the next decode is queued behind this one, so the
                    # host's completion handling and HTTP delivery overlap the device's work.
                    ahead = sched.schedule_ahead(step) if self.steps_in_flight > 1 else None
                    ahead_ticket = self._launch(ahead) if ahead is not None else None
                    await self.executor.wait(ticket)
                    if ahead is None:
                        idle_since = time.perf_counter()
                    records = self.executor.completion(ticket) if step.completion else None
                    if step.kind == ProgramKind.score:  # never a step ahead: nothing overwrote them
                        step.scores = self.executor.read(io.SCORES)
                    sched.complete(step, records)
                    self.steps += 1
                    # Let HTTP handlers run between steps even when the executor answers instantly.
                    await asyncio.sleep(0)
                    step, ticket = ahead, ahead_ticket
        except asyncio.CancelledError:
            raise
        except Exception as e:
            err = e if isinstance(e, FlareError) else ExecutionError(f"engine loop failed: {e!r}")
            log.exception("engine failed: %s", err)
            self.failure = err
            self.state = EngineState.failed
            sched.fail_all(err)

    def _launch(self, step) -> int:
        ex = self.executor
        for w in step.writes:
            ex.write(w.buffer, w.value, w.row)
        return ex.submit(step.program)

    def stop_admission(self) -> None:
        """New requests get 503 from now on; admitted and queued ones keep running."""
        if self.state == EngineState.ready:
            self.state = EngineState.stopping

    async def drain(self, grace_s: float) -> None:
        """Stop admission, give running and queued requests ``grace_s`` to finish, then
        cancel the rest (their streams end with a terminal error event)."""
        self.stop_admission()
        deadline = time.monotonic() + grace_s
        while self.scheduler.has_work() and time.monotonic() < deadline and self.state == EngineState.stopping:
            await asyncio.sleep(0.02)
        for req in list(self.scheduler.running) + list(self.scheduler.waiting):
            self.scheduler.cancel(req)
        self._wake.set()

    async def shutdown(self, grace_s: float = 10.0) -> None:
        """Drain (see ``drain``), stop the loop once no submitted work remains, and
        release the executor."""
        if self.state == EngineState.stopped:
            return
        await self.drain(grace_s)
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

    def gauges(self) -> dict[str, float]:
        sched = self.scheduler
        free, used, cached = sched.page_usage()
        ck = sched.checkpoints
        cache = ck.cache
        return {
            "flare_requests_running": len(sched.running),
            "flare_requests_waiting": len(sched.waiting),
            "flare_kv_pages_total": sched.pages.total,
            "flare_kv_pages_free": free,
            "flare_kv_pages_used": used,  # held by requests
            "flare_kv_pages_cached": cached,  # held only by prefix-cache checkpoints
            "flare_prefix_cache_enabled": int(ck.enabled),
            "flare_prefix_cache_hit_tokens_total": ck.hit_tokens_total,
            "flare_prefix_cache_checkpoints": len(cache) if cache else 0,
            "flare_prefix_cache_published_total": cache.published if cache else 0,
            "flare_prefix_cache_duplicates_total": cache.duplicates if cache else 0,
            # Page pressure and snapshot pressure, separately.
            "flare_prefix_cache_page_evictions_total": cache.evicted_for_pages if cache else 0,
            "flare_prefix_cache_snapshot_rows_total": cache.rows.total if cache else 0,
            "flare_prefix_cache_snapshot_rows_free": cache.rows.free if cache else 0,
            "flare_prefix_cache_snapshot_evictions_total": cache.evicted_for_rows if cache else 0,
            "flare_prefix_cache_thinned_total": cache.thinned if cache else 0,
            "flare_prefix_cache_captures_skipped_total": ck.skipped_total,
            "flare_prefix_cache_duplicate_captures_avoided_total": ck.duplicates_avoided_total,
            "flare_engine_steps_total": self.steps,
            "flare_engine_steps_ahead_total": sched.steps_ahead_total,
            "flare_engine_steps_in_flight_max": self.steps_in_flight,
            "flare_engine_host_gap_seconds_total": round(self.host_gap_s_total, 6),
            "flare_engine_host_gaps_total": self.host_gaps,
            "flare_engine_admission_waits_total": self.admission_waits,
            "flare_engine_admission_wait_seconds_total": round(self.admission_wait_s_total, 6),
            "flare_prefill_tokens_total": sched.prefill_tokens_total,
            "flare_preemptions_total": sched.preemptions_total,
            "flare_kv_window_pages_released_total": sched.window_pages_released_total,
            "flare_engine_ready": int(self.ready),
            **{f"flare_executor_{k}": v for k, v in self.executor.stats().items()},
        }
