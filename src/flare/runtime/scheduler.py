"""The scheduler: admission, page growth, preemption, and step selection.

Synchronous and executor-free so that tests can drive it with tiny pools; the
engine turns its ``Step``s into executor writes and launches. Policy (docs/architecture.md,
"use a small scheduler"):

* FIFO admission subject to a slot and a page reservation (the history to
  prefill plus one page of output). A request that does not fit yet waits; a
  smaller one behind it may go first.
* Pages grow one page ahead of decode. When a running request cannot grow,
  the newest decoder is preempted and readmitted later with its history,
  output, penalty counts and a reseeded random stream.
* One decode batch of every decoding request. Between two decode batches, prefill
  chunks run back to back while their programs' rows (capacities, padding included)
  fit one turn's budget: the prefill chunk, or ``prefill_while_decoding`` when set.
  The first chunk of a turn always runs. A long prompt's chunk fills the turn alone;
  short prompts that arrive together are all prefilled before the decoders' next step
  (their first tokens do not wait a decode step each). The budget counts rows, not time:
  sixteen ``prefill.128`` programs take longer than one 2,048-token chunk.
* Pack programs (``runtime/packing.py``): several prompts' chunks in one program; with
  ``decode_with_prefill``, decode steps that carry a prefilling prompt's chunk.
* Cancellation and completion take effect at submission boundaries: the
  engine calls ``schedule`` only when nothing it submitted is in flight.
* Two decode steps in flight (``schedule_ahead``): while decode step N runs, the
  engine may already submit N+1 for the same batch, because each decode reads its
  input token from the slot's device state, where N leaves it. The step ahead is
  only built when nothing else could be scheduled in between (no admission
  possible, no prefill, maintenance or cancellation pending, no request at its
  token limit, its pages available without preemption). A request that N finishes on the
  device (stop id, length) is a dead row in N+1: the device sees its done flag
  and changes nothing. A request the host finishes after N (a stop string) runs
  one more live row in N+1, which only writes its own slot and private tail
  page; its terminal snapshot is skipped, since the slot no longer holds the
  endpoint.
* Grammar-constrained requests: the step that samples for such a request carries
  its next-token mask row, computed here from the request's grammar. That mask
  depends on the token the previous step sampled, which ``complete`` fed to the
  grammar, so a batch with a constrained request is never scheduled ahead: such a
  request always has exactly one step in flight.
* Prefix cache (``flare.runtime.checkpoints``): admission restores the deepest
  checkpoint that prefixes the history and shares its pages; unused
  checkpoints are evicted before admission waits or a decoder is preempted;
  maintenance steps (admit, restore, resume, snapshot) run before any other.
  A finished request keeps its slot and pages ("retiring") until its terminal
  snapshot has completed.
"""

from __future__ import annotations

import itertools
import time
from collections import deque

import numpy as np

from flare.core import interface as io
from flare.core.errors import AdmissionError, CapacityError, ExecutionError, FrontendError, ModelOutputError
from flare.core.interface import Status as DeviceStatus
from flare.core.manifest import Manifest, ProgramKind
from flare.runtime import packing
from flare.runtime.checkpoints import Checkpoints
from flare.runtime.encoder import StepEncoder, derive_seed
from flare.runtime.metrics import ServingMetrics
from flare.runtime.pages import PagePool, SlotPool, window_released
from flare.runtime.request import FinishReason, Request, Status
from flare.runtime.speculation import Speculation
from flare.runtime.steps import Step, Write

__all__ = ["Scheduler", "Step", "Write", "derive_seed"]

class Scheduler:
    def __init__(self, manifest: Manifest, *, max_waiting: int = 256, metrics: ServingMetrics | None = None,
                 prefix_cache: bool = True, prefill_while_decoding: int = 0, decode_with_prefill: bool = False,
                 draft_tokens: int = 0, speculate_always: bool = False, learned_drafts: bool = False):
        self.m = manifest
        self.metrics = metrics or ServingMetrics()
        self.caps = manifest.capacities
        self.page_size = manifest.pages.page_size
        self.pages = PagePool(manifest.pages.num_pages, manifest.pages.null_page)
        self.slots = SlotPool(self.caps.slots)
        self.encode = StepEncoder(manifest)
        self.checkpoints = Checkpoints(manifest, self.pages, self.encode, enabled=prefix_cache)
        self.max_waiting = max_waiting
        # A prefill chunk's tokens while other requests decode (0: the whole prefill chunk):
        # decoders wait at most one such chunk between their steps.
        if prefill_while_decoding < 0:
            raise ValueError(f"prefill_while_decoding must not be negative, got {prefill_while_decoding}")
        self.prefill_while_decoding = prefill_while_decoding
        # Decode steps that carry a prefill chunk (a pack program of the decoders' tokens and
        # the chunk): decoders then get a token every step while a prompt prefills.
        if decode_with_prefill and not self.caps.pack_capacities:
            raise ValueError("decode_with_prefill needs a core prepared with pack programs (--pack-capacities)")
        self.decode_with_prefill = decode_with_prefill
        # Speculative decoding with copy drafts (runtime/speculation.py): up to draft_tokens per
        # request and step, checked by the core's verify programs.
        if not 0 <= draft_tokens <= self.caps.draft_tokens:
            raise ValueError(f"draft_tokens {draft_tokens} must lie in [0, {self.caps.draft_tokens}] (the core's "
                             f"--draft-tokens)")
        # Learned drafts (the core's MTP head, --speculative mtp) instead: every verify record
        # carries the next step's.
        if learned_drafts and not self.caps.mtp_drafts:
            raise ValueError("learned drafts need a core prepared with an MTP head (flare-prepare --mtp)")
        self.spec = Speculation(draft_tokens, always=speculate_always, learned=learned_drafts) if draft_tokens else None
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.retiring: list[Request] = []  # finished, holding resources until their snapshots complete
        self._maintenance: deque[Step] = deque()
        self._admissions = 0
        self._last_kind: ProgramKind | None = None
        self._turn_rows = 0  # prefill program rows run since the last decode step
        self._ahead: Step | None = None  # a decode step submitted before its predecessor completed
        self._completed_at = 0.0  # when the last step completed (monotonic)
        self._idle_at = 0.0  # when schedule() last found nothing to run
        self._device_past: Request | None = None  # a verify row's request whose slot is past its current token
        self.steps_ahead_total = 0
        self.prefill_tokens_total = 0
        self.window_pages_released_total = 0  # pages given back when they left every layer's window
        self.preemptions_total = 0

    # -- intake ------------------------------------------------------------

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def validate(self, req: Request) -> None:
        """Reject what can never run, before anything is queued (HTTP 400). Errors name the
        runtime's fields (``prompt``, ``max_tokens``, ``stop_token_ids``, ``endpoints``);
        the server maps them to its protocol's request fields."""
        n = len(req.prompt)
        if n == 0:
            raise FrontendError("the prompt is empty", param="prompt", code="empty_prompt")
        limit = self.caps.context_limit
        if n + req.params.max_tokens > limit:
            if n >= limit:
                raise AdmissionError(
                    f"this model's context limit is {limit} tokens; the prompt has {n}", param="prompt")
            raise AdmissionError(
                f"this model's context limit is {limit} tokens; the prompt has {n} and max_tokens asks for "
                f"{req.params.max_tokens} more", param="max_tokens")
        if self.pages_for(n) + 1 > self.pages.total:
            raise AdmissionError(
                f"the prompt needs {self.pages_for(n) + 1} KV pages; the pool holds {self.pages.total}",
                param="prompt", code="kv_capacity_exceeded")
        stops = len(req.params.stop_token_ids) + (0 if req.params.ignore_eos else len(self.m.frontend.eos_ids))
        if stops > self.caps.stop_ids:
            raise FrontendError(f"at most {self.caps.stop_ids} stop token ids (EOS included) are supported",
                                param="stop_token_ids")
        if min(req.prompt) < 0 or max(req.prompt) >= self.caps.vocab_size:
            raise FrontendError("prompt token id outside the vocabulary", param="prompt")
        if req.params.logprobs > self.caps.max_logprobs:
            raise FrontendError(f"at most {self.caps.max_logprobs} log-probabilities per token (the core's "
                                f"--max-logprobs)", param="logprobs",
                                code="logprobs_unavailable" if not self.caps.max_logprobs else "invalid_request")
        if req.score_prompt and not self.caps.score_chunk:
            raise FrontendError("this core has no score programs to score a prompt with", param="prompt",
                                code="logprobs_unavailable")
        if req.score_prompt and max(req.prompt) >= self.caps.sampling_vocab:
            raise FrontendError(f"a scored prompt's token ids must lie below {self.caps.sampling_vocab} (the ids "
                                f"the model scores)", param="prompt")
        e = req.endpoints
        if list(e) != sorted(set(e)) or (e and not 0 < e[0] <= e[-1] < n):
            raise FrontendError("message endpoints must be ascending and inside the prompt", param="endpoints")

    def add(self, req: Request) -> None:
        self.validate(req)
        if len(self.waiting) >= self.max_waiting:
            raise CapacityError("the admission queue is full; retry later", code="queue_full")
        self.waiting.append(req)

    def cancel(self, req: Request) -> None:
        req.cancel_requested = True

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._maintenance)

    @property
    def maintenance_queued(self) -> bool:
        """State copies (snapshots of finished requests, restores) wait to run before admission."""
        return bool(self._maintenance)

    # -- scheduling --------------------------------------------------------

    def schedule(self) -> Step | None:
        """The next step to run. Call only when no submitted work is in flight."""
        self._retire_cancelled()
        if not self._maintenance:
            self._admit()
        if self._maintenance:
            step = self._maintenance.popleft()
            if step.kind == ProgramKind.resume and step.requests[0].grammar is not None:
                # resume samples the first output token: it carries the mask like prefill.
                self._mask_write(step.requests[0], step.writes)
                if step.requests[0].finished:
                    return self.schedule()
            return step
        prefilling = [r for r in self.running if r.status == Status.PREFILLING and r.consumed < len(r.target)]
        decoding = [r for r in self.running if r.status == Status.DECODING]
        if prefilling and decoding and self.decode_with_prefill:
            plan = self._pack_plan(prefilling, len(decoding))
            if plan is not None:
                step = self._pack_step(*plan, decoders=True)
                self._last_kind, self._turn_rows = ProgramKind.decode, 0  # the decoders had their step
                return step if step is not None else self.schedule()
        # A pack beside decoders keeps to the turn's rows (and --prefill-while-decoding).
        plan = self._pack_plan(prefilling, 0, self._turn_budget() - self._turn_rows if decoding else None)
        rows = plan[0] if plan else self._chunk_rows(prefilling[0]) if prefilling else 0
        if prefilling and (not decoding or self._last_kind == ProgramKind.decode
                           or self._turn_rows + rows <= self._turn_budget()):
            self._turn_rows += rows
            step = self._pack_step(*plan) if plan else self._prefill_step(prefilling[0])
            if step is None:  # its grammar failed: the request ended
                return self.schedule()
        elif decoding:
            step = self._decode_step()
            if step is None:  # every decoder was preempted or ended
                return self.schedule()
            self._turn_rows = 0
        else:
            self._idle_at = time.monotonic()  # nothing to run: the next step starts a new chain
            return None
        self._last_kind = step.kind
        return step

    def _retire_cancelled(self) -> None:
        for req in [r for r in self.waiting if r.cancel_requested]:
            self.waiting.remove(req)
            self._finish(req, FinishReason.cancelled)
        for req in [r for r in self.running if r.cancel_requested]:
            self._finish(req, FinishReason.cancelled)

    def _admit(self) -> None:
        ck = self.checkpoints
        for req in list(self.waiting):
            if not self.slots.free:
                return
            # pinned: eviction below cannot take it. A prompt to score is computed whole.
            reuse = ck.no_hit(req) if req.scoring else ck.lookup(req)
            need = self._reservation(req) - len(reuse.pages)
            if not self.pages.can_allocate(need):
                ck.evict_pages(need)
            if not self.pages.can_allocate(need):
                ck.abandon(reuse)
                continue  # a blocked request does not stop smaller ones behind it
            self.waiting.remove(req)
            req.slot = self.slots.allocate()
            self.pages.retain_held(reuse.pages)
            req.pages = reuse.pages + self.pages.allocate(need)
            req.status = Status.PREFILLING
            req.consumed = reuse.length
            if req.scoring:
                # Defensive: only decoding requests are preempted today, after scoring ended.
                req.prompt_logprobs = []
            if req.preemptions == 0:
                req.cached_tokens = reuse.length
            req.admission_seq = self._admissions
            self._admissions += 1
            self.running.append(req)
            if not req.output:  # readmissions were counted when first admitted
                self.metrics.on_admitted(len(req.prompt))
            self._maintenance.extend(self.encode.admission(req))
            self._maintenance.extend(ck.start(req, reuse))

    def _reservation(self, req: Request) -> int:
        tokens = min(len(req.target) + self.page_size, req.max_len)
        return min(self.pages_for(tokens), self.caps.max_pages_per_slot)

    def _turn_budget(self) -> int:
        return self.prefill_while_decoding or self.caps.prefill_chunk

    def _chunk_end(self, req: Request) -> int:
        """Where the request's next prefill chunk ends."""
        start = req.consumed
        end = min(start + self.caps.prefill_chunk, len(req.target))
        stop = self.checkpoints.next_stop(req)
        if stop is not None:
            end = min(end, stop)  # a selected endpoint interrupts prefill for its snapshot
        if self.prefill_while_decoding and any(r.status == Status.DECODING for r in self.running):
            end = min(end, start + self.prefill_while_decoding)
        if req.scoring:
            end = min(end, start + self.caps.score_chunk)
        return end

    def _chunk_rows(self, req: Request) -> int:
        """The rows of the program the request's next chunk runs on."""
        if req.scoring:
            return self.caps.score_chunk
        return self.encode.prefill_capacity(self._chunk_end(req) - req.consumed)

    def _samples(self, req: Request, end: int) -> bool:
        """Whether the chunk ending at ``end`` samples: the history's last chunk, unless the
        request already holds its pending token (a readmission) or only scores (max_tokens 0)."""
        return end == len(req.target) and not req.output and req.params.max_tokens > 0

    def _pack_plan(self, prefilling: list[Request], decoders: int,
                   limit: int | None = None) -> tuple[int, list[tuple[Request, int]]] | None:
        """A pack program's capacity (at most ``limit`` rows) and the prefilling requests, in
        order, with the tokens of their chunks in it beside ``decoders`` one-token rows, or
        None (``flare.runtime.packing.plan``). Beside decoders the chunks' tokens together
        keep to ``--prefill-while-decoding`` when set. Scoring and grammar-constrained
        requests take their own programs: the first of them ends the candidates."""
        caps = [c for c in self.caps.pack_capacities if limit is None or c <= limit]
        if not caps:  # no pack programs (or none within the turn): nothing to plan, every step
            return None
        candidates = []
        for req in prefilling:
            if req.scoring or req.grammar is not None:
                break
            candidates.append(req)
        chunks = [packing.Chunk(self._chunk_end(r) - r.consumed, r.consumed > 0) for r in candidates]
        planned = packing.plan(chunks, decoders, caps, self.caps.pack_align, self.caps.decode_capacities[-1],
                               (self.prefill_while_decoding or None) if decoders else None)
        if planned is None:
            return None
        capacity, tokens = planned
        return capacity, list(zip(candidates, tokens))

    def _pack_step(self, capacity: int, chunks: list[tuple[Request, int]], *, decoders: bool = False) -> Step | None:
        """The chunks' segments first, then, for a decode step that carries them, every
        decoder's pending token. None when every decoder was preempted or ended."""
        segments = []
        writes: list[Write] = []
        batch = self._decoders(writes) if decoders else []
        if decoders and not batch:
            return None  # (before any release below: its table writes would go with the dropped step)
        for req, n in chunks:
            end = req.consumed + n
            segments.append((req, req.target[req.consumed : end], self._samples(req, end), req.consumed > 0))
            self._release_window(req, writes)
        segments += [(req, [req.output[-1]], True, False) for req in batch]
        return self.encode.pack(capacity, segments, writes)

    def _prefill_step(self, req: Request) -> Step | None:
        start = req.consumed
        end = self._chunk_end(req)
        sample = self._samples(req, end)
        if req.scoring:
            step = self.encode.score(req, req.target[start:end], sample=sample)
        else:
            step = self.encode.prefill(req, req.target[start:end], sample=sample)
        self._release_window(req, step.writes)
        if sample and req.grammar is not None:
            self._mask_write(req, step.writes)
            if req.finished:
                return None
        return step

    def _decode_step(self) -> Step | None:
        writes: list[Write] = []
        batch = self._decoders(writes)
        if not batch:
            return None
        if self._verify_program(batch) is not None:
            drafts = [self._drafts(r, writes) for r in batch]
            if self.spec.verifies(batch, drafts):
                step = self.encode.verify(batch, drafts, writes)
                plain = self.encode.decode(batch, writes)
                if self.spec.pays(plain.program, step.program, batch, drafts):
                    return step
                if not self.spec.refused_for_share:  # the drafts were fine, the bystanders' budget not
                    for req, d in zip(batch, drafts):
                        if d:
                            self.spec.miss(req)  # not worth a verify step
                return plain
        return self.encode.decode(batch, writes)

    def _verify_program(self, batch: list[Request]) -> str | None:
        """The verify program a decode batch could run instead; None without speculation, for
        a batch larger than the verify programs, or with a request that asks for
        log-probabilities (a verify record has no log-probability block)."""
        if self.spec is None or len(batch) > self.encode.verify_caps[-1] or any(r.params.logprobs >= 0
                                                                                for r in batch):
            return None
        return f"verify.{next(c for c in self.encode.verify_caps if c >= len(batch))}"

    def _may_verify(self, batch: list[Request], decode: str) -> bool:
        """Whether the step after a decode step of ``batch`` may verify drafts (then it is
        decided once that step completes, not submitted ahead)."""
        verify = self._verify_program(batch)
        return verify is not None and self.spec.may_verify(batch, decode, verify)

    def _drafts(self, req: Request, writes: list[Write]) -> list[int]:
        """The request's drafts for a verify step, within its token limit and within pages
        that are free now (drafts never evict or preempt: they are cut to fit instead)."""
        drafts = self.spec.propose(req, req.params.max_tokens - len(req.output) - 1)
        # Ids the model never samples (a padded vocabulary's, from the prompt) cannot be accepted.
        drafts = list(itertools.takewhile(lambda t: t < self.caps.sampling_vocab, drafts))
        # Positions consumed .. consumed + len(drafts) are written; with learned drafts the MTP
        # head's chain writes mtp_drafts more from the next pending token's position (pages for
        # them when free, within the request's limit: the chain stops short where they end).
        need = self.pages_for(req.consumed + 1 + len(drafts)) - len(req.pages)
        if self.spec.learned:
            chain = min(self.pages_for(req.consumed + 1 + len(drafts) + self.caps.mtp_drafts),
                        self.pages_for(req.max_len), self.caps.max_pages_per_slot) - len(req.pages)
            if chain > need and self.pages.can_allocate(chain):
                need = chain
        if need > 0 and self.pages.can_allocate(need):
            self._add_pages(req, need, writes)
        fit = drafts[: max(0, len(req.pages) * self.page_size - req.consumed - 1)]
        if drafts and not fit:
            self.spec.miss(req)  # no room: back off rather than hold the batch back each step
        return fit

    def _decoders(self, writes: list[Write]) -> list[Request]:
        """The decoding requests of the next step, after page growth (which may preempt)
        and grammar masks, whose writes go to ``writes``."""
        for req in sorted((r for r in self.running if r.status == Status.DECODING), key=lambda r: r.admission_seq):
            if req.status != Status.DECODING:  # preempted while growing an earlier request
                continue
            self._release_window(req, writes)
            if not self._grow(req, writes):
                continue
        for req in [r for r in self.running if r.status == Status.DECODING and r.grammar is not None]:
            self._mask_write(req, writes)
        return [r for r in self.running if r.status == Status.DECODING]

    def schedule_ahead(self, step: Step) -> Step | None:
        """The decode step to submit right after ``step`` while ``step`` is still in
        flight, or None when the step after it must be chosen by ``schedule`` once it
        has completed. See the module docstring for the conditions. ``step`` may itself
        be the previous step ahead: a steady decode batch always has two in flight, and
        ``_ahead`` is the later of them until it completes."""
        # A waiting request matters only if a slot is free: otherwise schedule() could not
        # admit it either, and a saturated server keeps its two steps in flight.
        if (step.kind != ProgramKind.decode or self._ahead not in (None, step) or self._maintenance
                or (self.waiting and self.slots.free)
                or any(r.status != Status.DECODING for r in self.running)
                or len(step.requests) != len(self.running)
                or self._may_verify(step.requests, step.program)):
            return None
        batch = step.requests
        for r in batch:
            if (r.finished or r.cancel_requested or r.grammar is not None
                    or len(r.output) + 1 >= r.params.max_tokens or r.consumed + 2 > r.max_len):
                return None
        # Step N writes position consumed, the step ahead consumed + 1.
        short = [r for r in batch if len(r.pages) < self.pages_for(r.consumed + 2)]
        if any(self.pages_for(r.consumed + 2) > self.caps.max_pages_per_slot for r in short):
            return None
        if short and not self.pages.can_allocate(len(short)):
            # evict_pages(n): evict until n pages are free.
            if not self.checkpoints.evict_pages(len(short)) or not self.pages.can_allocate(len(short)):
                return None
        writes: list[Write] = []
        for r in batch:  # (a steady batch's steps are all ahead: schedule() would rarely see them)
            self._release_window(r, writes)
        for r in short:
            self._add_pages(r, 1, writes)
        self._ahead = self.encode.decode_again(step, writes)
        self.steps_ahead_total += 1
        return self._ahead

    def _mask_write(self, req: Request, writes: list[Write]) -> None:
        """Stage the request's next-token mask; a grammar that cannot give one ends the
        request with its error instead (the request then leaves the batch)."""
        write = self.encode.mask(req)
        if write is None:
            self._finish(req, FinishReason.error, ModelOutputError(
                f"the output grammar failed: {req.grammar.error()}", code="grammar_failed"))
            return
        writes.append(write)

    def _release_window(self, req: Request, writes: list[Write]) -> None:
        """Give back the request's pages that lie wholly before every attention layer's sliding
        window for its next position (``pages.kv_window``: a core whose every KV layer is windowed),
        where no checkpoint holds them: its anchor's chain and the pages a published checkpoint took
        stay (the cache keeps them for other requests either way). Their page-table entries then
        point at the null page, which no query reads for a key it sees: the attention kernels skip
        the key blocks before a query's window, and a block they read across its start masks those
        keys (the null page's rows are finite: zeroed, then only padded rows' keys and values). No
        query of a step in flight or ahead lies before ``consumed`` (a step ahead is scheduled with the
        position of the step in flight); one page more than the window needs is kept anyway, as
        insurance at the cost of a page a request. A checkpoint published later at this request's
        endpoint takes the null entries into its segment: what continues from it reads only its window.
        The table writes go with the step being built: a caller that drops its step must not release."""
        window = self.m.pages.kv_window
        if window is None or req.slot is None:
            return
        before = min(window_released(req.consumed, window, self.page_size), len(req.pages))
        null = self.pages.null_page
        drop = [i for i in range(self.checkpoints.shared_pages(req), before)
                if req.pages[i] != null and self.pages.refcount(req.pages[i]) == 1]
        if not drop:
            return
        self.pages.release([req.pages[i] for i in drop])
        for i in drop:
            req.pages[i] = null
        self.window_pages_released_total += len(drop)
        writes.append(self.encode.page_table(req, drop[0]))

    def _grow(self, req: Request, writes: list[Write]) -> bool:
        """Make sure the page for the next position exists (and one more, when free).
        Returns False when the request was preempted or ended instead."""
        must = self.pages_for(req.consumed + 1)
        want = min(must + 1, self.pages_for(req.max_len), self.caps.max_pages_per_slot)
        while len(req.pages) < must:
            if self.pages.can_allocate(1) or self.checkpoints.evict_pages(1):
                self._add_pages(req, 1, writes)
                continue
            victim = self._preemption_victim()
            if victim is None or (victim is req and len(self.running) == 1):
                # Nothing else holds pages: this history fills the whole pool.
                self._finish(req, FinishReason.length)
                return False
            self._preempt(victim)
            if victim is req:
                return False
        if len(req.pages) < want and self.pages.can_allocate(want - len(req.pages)):
            self._add_pages(req, want - len(req.pages), writes)
        return True

    def _add_pages(self, req: Request, n: int, writes: list[Write]) -> None:
        first = len(req.pages)
        req.pages.extend(self.pages.allocate(n))
        writes.append(self.encode.page_table(req, first))

    def _preemption_victim(self) -> Request | None:
        decoders = [r for r in self.running if r.status == Status.DECODING]
        return max(decoders, key=lambda r: r.admission_seq) if decoders else None

    def _preempt(self, req: Request) -> None:
        """Release the request's resources and queue it first for readmission with its
        history (prompt + output, the last output token still pending)."""
        self._release(req)
        req.status = Status.WAITING
        req.target = req.prompt + req.output[:-1]
        req.consumed = 0
        req.preemptions += 1
        self.preemptions_total += 1
        self.waiting.appendleft(req)

    # -- completion --------------------------------------------------------

    def complete(self, step: Step, records: np.ndarray | None) -> None:
        """Apply a finished step. Records are validated before any state changes."""
        now = time.monotonic()
        if self.spec is not None:
            if step.kind in (ProgramKind.decode, ProgramKind.verify):
                # From its predecessor's completion while steps followed one another (a step
                # decided after it pays the host's turn-around in between; one submitted ahead
                # does not), from its decision when the engine was idle before it.
                chained = self._idle_at < self._completed_at
                start = self._completed_at if chained else max(step.scheduled_at, self._completed_at)
                self.spec.timed(step.program, (now - start) * 1e3)
            else:
                self.spec.other_step()
        self._completed_at = now
        if step.kind == ProgramKind.admit:
            return
        if records is None:
            raise ExecutionError(f"{step.program} returned no completion records")
        if step.kind in (ProgramKind.snapshot, ProgramKind.restore):
            req = step.requests[0]
            self.checkpoints.complete(step, records)
            if req.finished and not self.checkpoints.busy(req):
                self._release(req)  # its terminal snapshot is published
            elif step.kind == ProgramKind.restore and req.consumed == len(req.target) and req.output:
                req.status = Status.DECODING  # a readmission whose whole history was cached
            return
        if step.kind == ProgramKind.verify:
            D, M = self.caps.draft_tokens, self.caps.mtp_drafts
            verified = [io.verify_record(row, D, M) for row in records[: len(step.requests)]]
            self._check_slots(step, [head.slot for head, _ in verified])
            for req, drafts, (head, tokens), row in zip(step.requests, step.drafts, verified, records):
                self._verified(req, drafts, head, tokens)
                if M and self.spec.learned and not req.finished:  # (copy drafts leave them unread)
                    self.spec.learned_drafts(req, io.mtp_drafts(row, D, M))
            return
        rows = [io.completion(row) for row in records[: len(step.requests)]]
        if step is self._ahead:
            self._ahead = None
        self._check_slots(step, [row.slot for row in rows])
        if step.kind in (ProgramKind.prefill, ProgramKind.resume, ProgramKind.score):
            req = step.requests[0]
            if step.kind == ProgramKind.score and not req.finished:
                self._scored(req, step)
            self._prefilled(req, step.count, step.sample, rows[0], records[0])
            return
        if step.kind == ProgramKind.pack:
            for req, (count, sample, decoding), row, record in zip(step.requests, step.segments, rows, records):
                if decoding:
                    self._decoded(req, row, record)
                else:
                    self._prefilled(req, count, sample, row, record)
            return
        for req, row, record in zip(step.requests, rows, records):
            self._decoded(req, row, record)

    def _check_slots(self, step: Step, slots: list[int]) -> None:
        for req, slot in zip(step.requests, slots):
            if req.finished and req.slot is None:
                continue  # finished and released while this step was in flight
            if slot != req.slot:
                raise ExecutionError(f"{step.program}: completion for slot {slot}, expected {req.slot}",
                                     code="bad_completion")

    def _verified(self, req: Request, drafts: list[int], head: io.VerifyCompletion, tokens: list[int]) -> None:
        """A verify row of the request completed: its emitted tokens, each as a decode row's."""
        if req.finished:
            return
        # A rejected draft is never emitted at its position: equal tokens are the accepted drafts.
        accepted = next((i for i, (d, t) in enumerate(zip(drafts, tokens)) if d != t),
                        min(len(drafts), len(tokens)))
        if drafts:
            self.metrics.on_verified(len(drafts), accepted)
        for i, token in enumerate(tokens):
            if req.finished:  # a stop sequence matched before the last emitted token
                break
            req.consumed += 1
            last = i == len(tokens) - 1
            # Before the last token the device has consumed more than the host keeps if a stop
            # sequence ends the request here: its slot is past the endpoint (no terminal snapshot).
            self._device_past = None if last else req
            self._accept(req, io.Completion(head.slot, token, head.generated - len(tokens) + i + 1,
                                            head.status if last else int(DeviceStatus.running)), None)
        self._device_past = None
        if not req.finished:  # after its tokens: a backoff counts from here
            self.spec.observe(req, len(drafts), accepted)

    def _decoded(self, req: Request, row: io.Completion, record) -> None:
        """A decode row of the request completed."""
        if req.finished:
            return  # finished after the step ahead was submitted: nothing of its row is kept
        if row.token >= 0:
            req.consumed += 1  # the pending token was consumed by this decode
            if self.spec is not None:
                self.spec.shadow(req, row.token)
        self._accept(req, row, record)

    def _prefilled(self, req: Request, count: int, sample: bool, row: io.Completion, record) -> None:
        """A prefill chunk of ``count`` tokens of the request completed (and sampled)."""
        req.consumed += count
        self.prefill_tokens_total += count
        if req.consumed == len(req.target) and not req.finished:
            if req.params.max_tokens == 0:  # scored, nothing to generate
                self._finish(req, FinishReason.length)
                return
            req.status = Status.DECODING
        snap = self.checkpoints.after_prefill(req)
        if snap is not None:
            self._maintenance.append(snap)
        if sample:
            self._accept(req, row, record)

    def _scored(self, req: Request, step: Step) -> None:
        """Keep the chunk's prompt log-probabilities; hand them over once the prompt is done."""
        if step.scores is None:
            raise ExecutionError(f"{step.program}: no scores were read", code="bad_completion")
        n = self.caps.max_logprobs
        for j in range(step.count):
            first = req.consumed + j == 0
            req.prompt_logprobs.append((req.target[req.consumed + j],
                                        None if first else io.unpack_logprobs(step.scores[j], n, start=0)))
        if len(req.prompt_logprobs) == len(req.prompt):
            on_prompt = getattr(req.sink, "on_prompt_logprobs", None)
            if on_prompt is not None:
                on_prompt(req, list(req.prompt_logprobs))

    def _accept(self, req: Request, row: io.Completion, record) -> None:
        token, status = row.token, row.status
        if token < 0 or req.finished:
            return
        now = time.monotonic()
        self.metrics.on_token(req.arrival, req.first_token_at, req.last_token_at, now)
        if req.first_token_at is None:
            req.first_token_at = now
        req.last_token_at = now
        req.output.append(token)
        if req.grammar is not None and not req.grammar.accept(token):
            # The mask allowed only what the grammar accepts, so this is a mask/grammar bug.
            self._finish(req, FinishReason.error, ModelOutputError(
                f"the output grammar rejected sampled token {token}: {req.grammar.error()}",
                code="grammar_failed"))
            return
        visible = [token] if status != DeviceStatus.stop else []
        if not visible:
            stop_matched = False
        elif req.params.logprobs >= 0:  # the record's block (validate checked the core has one)
            block = io.unpack_logprobs(record, self.caps.max_logprobs)
            stop_matched = req.sink.on_tokens(req, visible, logprobs=[block])
        else:
            stop_matched = req.sink.on_tokens(req, visible)
        if status == DeviceStatus.stop or stop_matched:
            self._finish(req, FinishReason.stop, device_done=status == DeviceStatus.stop)
        elif status == DeviceStatus.length:
            self._finish(req, FinishReason.length, device_done=True)

    def _release(self, req: Request) -> None:
        # Queued steps of this request will never run (cancelled right after admission,
        # preempted); their snapshot rows are given back.
        dropped = [s for s in self._maintenance if req in s.requests]
        if dropped:
            self._maintenance = deque(s for s in self._maintenance if req not in s.requests)
            for s in dropped:
                self.checkpoints.drop(s)
        self.checkpoints.release(req, finished=req.finished)
        if req.slot is not None:
            self.pages.release_held(req.pages)
            self.slots.release(req.slot)
            req.pages = []
            req.slot = None
        if req in self.running:
            self.running.remove(req)
        if req in self.retiring:
            self.retiring.remove(req)

    def _finish(self, req: Request, reason: FinishReason, error: Exception | None = None, *,
                device_done: bool = False) -> None:
        if self.spec is not None:
            self.spec.forget(req)
        if req.finished:
            return
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.error = error
        self.metrics.on_finished(reason.value)
        # A step ahead that still runs this request's row live (the host, not the device,
        # decided the finish) moves its slot past the endpoint: no terminal snapshot.
        live_ahead = (self._ahead is not None and req in self._ahead.requests and not device_done
                      or self._device_past is req)
        if reason in (FinishReason.stop, FinishReason.length) and req.slot is not None and not live_ahead:
            terminal = self.checkpoints.on_finish(req)
            if terminal is not None:
                self._maintenance.append(terminal)
        if self.checkpoints.busy(req):
            # Keep the slot and pages until the queued snapshots have copied them.
            self.running.remove(req)
            self.retiring.append(req)
        else:
            self._release(req)
        req.sink.on_finish(req)

    def fail_all(self, error: Exception) -> None:
        for req in list(self.running) + list(self.waiting):
            self._finish(req, FinishReason.error, error)
        for req in list(self.retiring):
            self._release(req)
        self.waiting.clear()

    # -- reporting -----------------------------------------------------------

    def page_usage(self) -> tuple[int, int, int]:
        """(free, used by requests, held only by the prefix cache): they sum to the total."""
        held = {p for r in self.running + self.retiring for p in r.pages} - {self.pages.null_page}
        cached = self.checkpoints.cached_pages() - held
        return self.pages.free, len(held), len(cached)

    # -- invariants --------------------------------------------------------

    def check_integrity(self) -> None:
        self.pages.check_integrity()
        self.slots.check_integrity()
        holders = self.running + self.retiring
        cached = self.checkpoints.cached_pages()
        refs: dict[int, int] = {}
        null = self.pages.null_page
        for r in holders:
            held = [p for p in r.pages if p != null]  # (null: released out of every layer's window)
            if len(set(held)) != len(held):
                raise AssertionError(f"{r} holds a page twice")
            if null in r.pages and self.m.pages.kv_window is None:
                raise AssertionError(f"{r} holds the null page without a sliding window")
            for p in held:
                refs[p] = refs.get(p, 0) + 1
        for p in set(refs) | cached:
            expected = refs.get(p, 0) + (p in cached)
            if self.pages.refcount(p) != expected:
                raise AssertionError(f"page {p}: refcount {self.pages.refcount(p)}, "
                                     f"{refs.get(p, 0)} requests + {int(p in cached)} checkpoint")
        free, used, only_cached = self.page_usage()
        if free + used + only_cached != self.pages.total or used + only_cached != self.pages.used:
            raise AssertionError(f"pages: free {free} + used {used} + cached {only_cached} != {self.pages.total}")
        self.checkpoints.check_integrity(holders, self.waiting)
        slots = [r.slot for r in holders]
        if None in slots or len(set(slots)) != len(slots) or len(slots) != self.slots.total - self.slots.free:
            raise AssertionError("slot ownership is inconsistent")
        for r in self.retiring:
            if r.status != Status.FINISHED or not self.checkpoints.busy(r):
                raise AssertionError(f"{r} is retiring without a pending snapshot")
        for r in self.running:
            if r.status not in (Status.PREFILLING, Status.DECODING):
                raise AssertionError(f"{r} is running with status {r.status}")
            if len(r.pages) * self.page_size < r.consumed:
                raise AssertionError(f"{r} consumed more tokens than its pages hold")
        for r in self.waiting:
            if r.slot is not None or r.pages:
                raise AssertionError(f"waiting {r} holds resources")
