"""Encoding decided steps into device writes.

The scheduler and the checkpoint lifecycle decide *what* runs (which request,
which tokens, which pages, which snapshot row); this module turns each
decision into a ``Step``: the program to launch, the rows to write before it
(laid out by ``flare.core.interface``) and where its completion records land.
It holds no policy and no request state beyond the host copy of grammar mask
rows, so the scheduler reads as policy alone.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from flare.core import interface as io
from flare.core.manifest import Manifest, ProgramKind, mask_words
from flare.runtime import packing
from flare.runtime.request import Request, Status
from flare.runtime.steps import Step, Write

_U64 = (1 << 64) - 1


def derive_seed(seed: int, generated: int) -> int:
    """The readmission rule (docs/architecture.md): a new random stream from (request seed, tokens generated so
    far), so a preempted request does not replay draws it already used. splitmix64."""
    z = (seed + 0x9E3779B97F4A7C15 * (generated + 1)) & _U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _U64
    z ^= z >> 31
    return z - (1 << 64) if z >= 1 << 63 else z


class StepEncoder:
    def __init__(self, manifest: Manifest):
        self.m = manifest
        self.caps = manifest.capacities
        self.page_size = manifest.pages.page_size
        self.null_page = manifest.pages.null_page
        self.prefill_caps = tuple(p.capacity for p in manifest.programs_of(ProgramKind.prefill))
        self.score_program = next((p.name for p in manifest.programs_of(ProgramKind.score)), None)
        self.decode_caps = tuple(p.capacity for p in manifest.programs_of(ProgramKind.decode))
        self.verify_caps = tuple(p.capacity for p in manifest.programs_of(ProgramKind.verify))
        self.admit_program = manifest.programs_of(ProgramKind.admit)[0]
        self._programs = {k: manifest.programs_of(k)[0].name
                          for k in (ProgramKind.snapshot, ProgramKind.restore, ProgramKind.resume)}
        # Host rows for grammar masks, one per slot: writes are staged (copied) at write time.
        self._masks = np.zeros((self.caps.slots + 1, mask_words(self.caps.vocab_size)), np.int32)

    # -- admission -------------------------------------------------------------

    def admission(self, req: Request) -> list[Step]:
        """The slot's request-state rows and the admit programs that build its penalty
        histogram: prompt tokens, then (a readmission) its output tokens. A request
        without penalties runs only the first chunk, which also clears the slot's
        continuation state: the histogram is read only by penalties."""
        p = req.params
        resumed = bool(req.output)
        rows = io.slot_state(
            pending=req.output[-1] if resumed else 0,
            generated=len(req.output),
            max_new=p.max_tokens,
            # A readmitted request draws a new stream: it must not replay draws it used.
            seed=derive_seed(p.seed, len(req.output)) if resumed else p.seed,
            sampling=p,
            stop_ids=(*(() if p.ignore_eos else self.m.frontend.eos_ids), *p.stop_token_ids),
            stop_capacity=self.caps.stop_ids,
            pages=req.pages,
            max_pages=self.caps.max_pages_per_slot,
            mask_on=req.grammar is not None,
            logprobs=p.logprobs >= 0,
        )
        writes = [Write(name, value, req.slot) for name, value in rows.items()]
        cap = self.admit_program.capacity
        chunks = [(req.prompt[i : i + cap], io.AdmitMode.prompt) for i in range(0, len(req.prompt), cap)]
        chunks += [(req.output[i : i + cap], io.AdmitMode.output) for i in range(0, len(req.output), cap)]
        if not p.penalizes:
            chunks = chunks[:1]
        steps = []
        for i, (tokens, mode) in enumerate(chunks):
            step = Step(ProgramKind.admit, self.admit_program.name, writes if i == 0 else [], [req])
            step.writes = step.writes + [
                Write(io.TOKENS, np.asarray(tokens, np.int32)),
                Write(io.AdmitInput.buffer, io.pack(io.AdmitInput(req.slot, len(tokens), int(i == 0), mode))),
            ]
            steps.append(step)
        return steps

    # -- model steps -------------------------------------------------------------

    def prefill(self, req: Request, tokens: Sequence[int], *, sample: bool) -> Step:
        """One chunk of the request's history on the smallest prefill capacity that holds it."""
        n = len(tokens)
        cap = self.prefill_capacity(n)
        return Step(ProgramKind.prefill, f"prefill.{cap}", [
            Write(io.TOKENS, np.asarray(tokens, np.int32)),
            Write(io.PrefillInput.buffer, io.pack(io.PrefillInput(req.slot, n, int(sample)))),
        ], [req], io.PREFILL_COMPLETION, count=n, sample=sample)

    def prefill_capacity(self, tokens: int) -> int:
        """The rows of the program a chunk of ``tokens`` runs on (the smallest that holds it)."""
        return next(c for c in self.prefill_caps if c >= tokens)

    def score(self, req: Request, tokens: Sequence[int], *, sample: bool) -> Step:
        """A prefill chunk through the score program (at most ``score_chunk`` tokens)."""
        return Step(ProgramKind.score, self.score_program, [
            Write(io.TOKENS, np.asarray(tokens, np.int32)),
            Write(io.PrefillInput.buffer, io.pack(io.PrefillInput(req.slot, len(tokens), int(sample)))),
        ], [req], io.PREFILL_COMPLETION, count=len(tokens), sample=sample)

    def pack(self, capacity: int, segments: Sequence[tuple[Request, Sequence[int], bool, bool]],
             writes: list[Write] | None = None) -> Step:
        """Segments (request, tokens, sample, continues) in ``pack.{capacity}``, in this order,
        at the rows ``packing.layout`` gives them (a chunk that continues a history takes
        whole tiles); the segment rows after them are unused. A one-token segment of a
        decoding request is its pending token (a decode row); ``writes`` (page growth,
        masks) go first."""
        starts, end = packing.layout([(len(t), cont) for _, t, _, cont in segments], self.caps.pack_align)
        if end > capacity or len(segments) > min(max(self.decode_caps), capacity):
            raise ValueError(f"{len(segments)} segments over {end} rows do not fit pack.{capacity}")
        rows = np.zeros((max(self.decode_caps), len(io.PackSegment._fields)), np.int32)
        tokens = np.zeros(capacity, np.int32)
        for i, ((req, toks, sample, _), start) in enumerate(zip(segments, starts)):
            rows[i] = io.pack(io.PackSegment(req.slot, len(toks), int(sample), start))
            tokens[start : start + len(toks)] = toks
        decoding = [req.status == Status.DECODING for req, *_ in segments]
        return Step(ProgramKind.pack, f"pack.{capacity}",
                    [*(writes or []), Write(io.TOKENS, tokens), Write(io.PACK_INPUT, rows)],
                    [req for req, *_ in segments], io.PACK_COMPLETION, count=sum(len(t) for _, t, _, _ in segments),
                    segments=[(len(t), sample, dec) for (_, t, sample, _), dec in zip(segments, decoding)])

    def resume(self, req: Request) -> Step:
        """Sample the first output token of a full-prompt hit from the restored hidden row."""
        return Step(ProgramKind.resume, self._programs[ProgramKind.resume],
                    [Write(io.PrefillInput.buffer, io.pack(io.PrefillInput(req.slot, 0, 1)))], [req],
                    io.PREFILL_COMPLETION, sample=True)

    def decode(self, batch: list[Request], writes: list[Write]) -> Step:
        """One token for every request of the batch on the smallest decode capacity that
        holds it; padding rows name the null slot 0. ``writes`` (page growth, masks) go first."""
        cap = next(c for c in self.decode_caps if c >= len(batch))
        slots = np.zeros(max(self.decode_caps), np.int32)
        slots[: len(batch)] = [r.slot for r in batch]
        return Step(ProgramKind.decode, f"decode.{cap}", [*writes, Write(io.DECODE_SLOTS, slots)], batch,
                    io.DECODE_COMPLETION)

    def verify(self, batch: list[Request], drafts: list[list[int]], writes: list[Write]) -> Step:
        """A speculative step for the batch (``verify.{B}``): each request's pending token and its
        drafts (at most the core's ``draft_tokens``); ``writes`` (page growth) go first."""
        cap = next(c for c in self.verify_caps if c >= len(batch))
        rows = np.zeros((max(self.decode_caps), len(io.VerifyInput._fields)), np.int32)
        tokens = np.zeros((max(self.decode_caps), self.caps.draft_tokens), np.int32)
        for i, (req, d) in enumerate(zip(batch, drafts)):
            rows[i] = io.pack(io.VerifyInput(req.slot, len(d), len(req.pages) * self.page_size))
            tokens[i, : len(d)] = d
        return Step(ProgramKind.verify, f"verify.{cap}",
                    [*writes, Write(io.VERIFY_INPUT, rows), Write(io.DRAFTS, tokens)], batch,
                    io.VERIFY_COMPLETION, drafts=[list(d) for d in drafts])

    def decode_again(self, step: Step, writes: list[Write]) -> Step:
        """The same decode batch once more (a step ahead): its slots after ``writes``."""
        slots = [w for w in step.writes if w.buffer == io.DECODE_SLOTS]
        return Step(ProgramKind.decode, step.program, [*writes, *slots], list(step.requests), step.completion)

    def page_table(self, req: Request, first: int) -> Write:
        """The slot's page-table entries from index ``first`` to its last page."""
        return Write("state.page_table", np.asarray(req.pages[first:], np.int32),
                     (req.slot, slice(first, len(req.pages))))

    def mask(self, req: Request) -> Write | None:
        """The request's next-token mask row from its grammar; None when the grammar
        cannot give one (the caller ends the request)."""
        row = self._masks[req.slot]
        if not req.grammar.fill_mask(row):
            return None
        return Write("in.token_mask", row, req.slot)

    # -- checkpoints ---------------------------------------------------------------

    def state_step(self, kind: ProgramKind, req: Request, row: int, count: int) -> Step:
        """Snapshot into or restore from checkpoint ``row`` at the endpoint ``count``. The
        tail page: the request's own page holding position ``count`` (private: it lies past
        every shared complete page), or the null page at a page-aligned endpoint, so
        maintenance never writes a shared full page."""
        page = req.pages[count // self.page_size] if count % self.page_size else self.null_page
        return Step(kind, self._programs[kind],
                    [Write(io.StateInput.buffer, io.pack(io.StateInput(req.slot, row, page, count)))], [req],
                    io.STATE_COMPLETION, row=row, endpoint=count)
