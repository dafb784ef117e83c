"""The checkpoint lifecycle of requests: reuse at admission, snapshots at selected
endpoints, publication after the copy completes, release.

The scheduler owns admission order, pages, slots and step selection; this
module owns what a request does with the prefix cache, and hands the
scheduler ready-made steps. Lifecycle of one request::

    admission  lookup: deepest checkpoint prefixing the history, pinned; its complete
               pages are shared, the rest of the reservation is private
               restore: continuation rows + tail page -> the request's slot and its
               first private page; resume when the whole prompt matched
    prefill    chunks stop at the selected message endpoints and the prompt end;
               at each one: snapshot (a row from the cache, thinning/evicting
               under snapshot pressure; none left -> continue unpublished)
    completion of a snapshot: validate the record (slot, row, consumed count), then
               publish: the checkpoint pins its parent chain and takes the
               request's completed private pages as its segment; the request now
               anchors (pins) the new checkpoint
    finish     terminal snapshot at the consumed count (the sampled pending token is
               not consumed); the request keeps its slot and pages until it completes
    release    unpin the anchor

Nothing is visible to lookups before its snapshot completed: publication
happens in the completion of the snapshot step, and the engine runs one
program at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from flare.core import interface as io
from flare.core.errors import ExecutionError
from flare.core.manifest import Manifest, ProgramKind
from flare.runtime.snapshot_plan import SnapshotPlan, snapshot_budget, plan_snapshots
from flare.runtime.encoder import StepEncoder
from flare.runtime.pages import PageId, PagePool
from flare.runtime.prefix_cache import Checkpoint, Key, PrefixCache, PrefixDigests
from flare.runtime.request import Request
from flare.runtime.steps import Step

TERMINAL_ONLY = SnapshotPlan((), False, True)


@dataclass
class Reuse:
    """The outcome of a lookup: a pinned checkpoint (or none) and its complete pages."""

    checkpoint: Checkpoint | None
    pages: list[PageId]
    digests: PrefixDigests | None

    @property
    def length(self) -> int:
        return self.checkpoint.length if self.checkpoint else 0


NO_REUSE = Reuse(None, [], None)


@dataclass
class _Track:
    digests: PrefixDigests
    plan: SnapshotPlan
    stops: list[int]  # selected endpoints not reached yet, ascending
    anchor: Checkpoint | None  # pinned: the checkpoint whose chain the request's pages extend
    queued: list[int] = field(default_factory=list)  # endpoints of snapshot steps not completed


class Checkpoints:
    def __init__(self, manifest: Manifest, pages: PagePool, encode: StepEncoder, *, enabled: bool = True):
        caps = manifest.capacities
        self.encode = encode
        on = enabled and caps.snapshot_rows > 0
        self.cache = PrefixCache(pages, caps.snapshot_rows, manifest.pages.page_size,
                                 manifest.identity.fingerprint.encode()) if on else None
        self.budget = snapshot_budget(caps.snapshot_rows, caps.slots) if on else 0
        self._tracks: dict[Request, _Track] = {}
        # Block digests per request, kept while it waits (a blocked request is looked up
        # at every admission pass) and across preemption (its history only grows).
        self._digests: dict[Request, PrefixDigests] = {}
        self.hit_tokens_total = 0
        self.skipped_total = 0  # selected endpoints not snapshotted: every snapshot row pinned
        # Keys of queued snapshots: an endpoint published or being snapshotted by another
        # request (n > 1 choices of one prompt, identical concurrent prompts) is not
        # snapshotted twice, so a duplicate never takes a row or thins another chain.
        self._snapshotting: dict[Key, int] = {}
        self.duplicates_avoided_total = 0

    @property
    def enabled(self) -> bool:
        return self.cache is not None

    # -- admission -----------------------------------------------------------

    def lookup(self, req: Request) -> Reuse:
        if self.cache is None:
            return NO_REUSE
        digests = self._digests.setdefault(req, self.cache.digests())
        hit = self.cache.match(req.target, digests)
        if hit is None:
            return Reuse(None, [], digests)
        self.cache.pin(hit)  # before any eviction the admission may cause
        return Reuse(hit, self.cache.chain(hit), digests)

    def no_hit(self, req: Request) -> Reuse:
        """A lookup that restores nothing (the prompt must be computed whole), keeping the
        request's digests so that its own checkpoints are published as usual."""
        if self.cache is None:
            return NO_REUSE
        return Reuse(None, [], self._digests.setdefault(req, self.cache.digests()))

    def abandon(self, reuse: Reuse) -> None:
        """The request could not be admitted after its lookup."""
        if reuse.checkpoint is not None:
            self.cache.unpin(reuse.checkpoint)

    def evict_pages(self, need: int) -> bool:
        return self.cache is not None and self.cache.evict_pages(need)

    def start(self, req: Request, reuse: Reuse) -> list[Step]:
        """The request holds its slot and pages (``reuse.pages`` first): plan its
        snapshots and return the restore (and resume) steps that follow its admit steps."""
        if self.cache is None:
            return []
        reused = reuse.length
        if req.output:  # readmission: its prompt endpoints were planned at first admission
            plan = TERMINAL_ONLY
        else:
            plan = plan_snapshots(budget=self.budget, reused=reused, prompt_len=len(req.prompt),
                                 max_tokens=req.params.max_tokens, endpoints=req.endpoints)
        stops = [*plan.messages, *([len(req.prompt)] if plan.prompt else [])]
        self._tracks[req] = _Track(reuse.digests, plan, stops, reuse.checkpoint)
        self.hit_tokens_total += reused
        hit = reuse.checkpoint
        if hit is None:
            return []
        self.cache.rows.begin_use(hit.row)
        steps = [self.encode.state_step(ProgramKind.restore, req, hit.row, reused)]
        if reused == len(req.target) and not req.output:
            steps.append(self.encode.resume(req))
        return steps

    # -- prefill and finish --------------------------------------------------

    def next_stop(self, req: Request) -> int | None:
        """The next selected endpoint after the consumed count: prefill chunks end there."""
        t = self._tracks.get(req)
        return next((e for e in t.stops if e > req.consumed), None) if t else None

    def after_prefill(self, req: Request) -> Step | None:
        t = self._tracks.get(req)
        if t is None or not t.stops or t.stops[0] != req.consumed:
            return None
        t.stops.pop(0)
        return self._snapshot(req, t)

    def on_finish(self, req: Request) -> Step | None:
        """The terminal snapshot of a request that finished (stop or length)."""
        t = self._tracks.get(req)
        if t is None or not t.plan.terminal or req.consumed == 0:
            return None
        if req.consumed in t.queued or (t.anchor is not None and t.anchor.length == req.consumed):
            return None  # a single output token: the prompt endpoint is the terminal one
        return self._snapshot(req, t)

    def busy(self, req: Request) -> bool:
        """Snapshot steps of this request are queued: it must keep its slot and pages."""
        t = self._tracks.get(req)
        return bool(t and t.queued)

    # -- completion ------------------------------------------------------------

    def complete(self, step: Step, record: np.ndarray) -> None:
        """Apply a finished snapshot or restore, validating its record first."""
        req = step.requests[0]
        r = io.unpack(io.StateCompletion, record[0])
        if (r.slot, r.row, r.consumed) != (req.slot, step.row, step.endpoint):
            raise ExecutionError(
                f"{step.program}: record (slot {r.slot}, row {r.row}, consumed {r.consumed}), expected "
                f"(slot {req.slot}, row {step.row}, consumed {step.endpoint})", code="bad_completion")
        self.cache.rows.end_use(step.row)
        if step.kind == ProgramKind.restore:
            return
        t = self._tracks[req]
        self._snapshotted(req, t, step.endpoint)
        history = req.prompt + req.output  # consumed tokens are a prefix of it
        c = self.cache.insert(history, t.digests, step.endpoint, step.row, t.anchor, req.pages)
        if c is None:  # an equal endpoint is published already: keep ours private
            self.cache.release_row(step.row)
            return
        self.cache.pin(c)
        if t.anchor is not None:
            self.cache.unpin(t.anchor)
        t.anchor = c

    def drop(self, step: Step) -> None:
        """A queued step that will never run (its request was cancelled or preempted)."""
        if step.kind not in (ProgramKind.snapshot, ProgramKind.restore):
            return
        self.cache.rows.end_use(step.row)
        if step.kind == ProgramKind.snapshot:
            req = step.requests[0]
            self._snapshotted(req, self._tracks[req], step.endpoint)
            self.cache.release_row(step.row)

    def release(self, req: Request, *, finished: bool = True) -> None:
        if finished:
            self._digests.pop(req, None)
        t = self._tracks.pop(req, None)
        if t is not None and t.anchor is not None:
            self.cache.unpin(t.anchor)

    # -- reporting and invariants ----------------------------------------------

    def cached_pages(self) -> set[PageId]:
        return self.cache.cached_pages() if self.cache else set()

    def shared_pages(self, req: Request) -> int:
        """How many of the request's first pages are its anchor's chain (shared with the cache)."""
        t = self._tracks.get(req)
        return t.anchor.complete_pages if t is not None and t.anchor is not None else 0

    def check_integrity(self, holders: list[Request], waiting=()) -> None:
        """Cache invariants, plus: every request's pages extend its anchor's chain and
        are private beyond it; pins are exactly the anchors; owned snapshot rows are
        exactly the published ones plus the queued snapshots'."""
        if self.cache is None:
            if self._tracks:
                raise AssertionError("requests tracked without a prefix cache")
            return
        self.cache.check_integrity()
        if set(self._tracks) - set(holders):
            raise AssertionError("a tracked request holds no resources")
        if set(self._digests) - set(holders) - set(waiting):
            raise AssertionError("digests kept for a request that is gone")
        pins: dict[int, int] = {}
        rows = {c.row for c in self.cache.checkpoints()}
        cached = self.cache.cached_pages()
        for req, t in self._tracks.items():
            shared = self.cache.chain(t.anchor) if t.anchor else []
            if req.pages[: len(shared)] != shared:
                raise AssertionError(f"{req}: pages do not extend its anchor {t.anchor}")
            for p in req.pages[len(shared):]:
                if p == self.cache.pool.null_page:  # released: outside every layer's window
                    continue
                if p in cached or self.cache.pool.refcount(p) != 1:
                    raise AssertionError(f"{req}: private page {p} is shared "
                                         f"({self.cache.pool.refcount(p)} references)")
            if t.anchor is not None:
                pins[t.anchor.id] = pins.get(t.anchor.id, 0) + 1
        for c in self.cache.checkpoints():
            if c.pins != pins.get(c.id, 0):
                raise AssertionError(f"{c}: {c.pins} pins, {pins.get(c.id, 0)} anchoring requests")
        queued = sum(len(t.queued) for t in self._tracks.values())
        if sum(self._snapshotting.values()) != queued:
            raise AssertionError(f"{sum(self._snapshotting.values())} snapshot keys for {queued} queued snapshots")
        owned = sum(1 for r in range(1, self.cache.rows.total + 1) if self.cache.rows.is_owned(r))
        if owned != len(rows) + queued:
            raise AssertionError(f"{owned} snapshot rows owned: {len(rows)} checkpoints + {queued} queued snapshots")

    # -- internals -------------------------------------------------------------

    def _snapshot(self, req: Request, t: _Track) -> Step | None:
        key = self._key(req, t, req.consumed)
        if key in self.cache or key in self._snapshotting:
            self.duplicates_avoided_total += 1
            return None
        row = self.cache.acquire_row()
        if row is None:
            self.skipped_total += 1
            return None
        self.cache.rows.begin_use(row)
        t.queued.append(req.consumed)
        self._snapshotting[key] = self._snapshotting.get(key, 0) + 1
        return self.encode.state_step(ProgramKind.snapshot, req, row, req.consumed)

    @staticmethod
    def _key(req: Request, t: _Track, endpoint: int) -> Key:
        return t.digests.key(req.prompt + req.output, endpoint)  # consumed tokens prefix the history

    def _snapshotted(self, req: Request, t: _Track, endpoint: int) -> None:
        """A queued snapshot completed or was dropped."""
        t.queued.remove(endpoint)
        key = self._key(req, t, endpoint)
        self._snapshotting[key] -= 1
        if not self._snapshotting[key]:
            del self._snapshotting[key]
