"""The prepared programs, composed from a recipe over arena views.

Every program is a no-argument callable that reads its inputs from and writes
its results to named arena buffers; nothing is passed on the host. Each index
is a device tensor (one-element index tensors, never Python ints read from the
device), so the same callables are captured into CUDA graphs on the GPU and
run eagerly by the reference worker on the CPU.

Request slot 0 is the null slot and page 0 the null page: padded rows read and
write only there, so they never touch another request's state. Snapshot row 0
is the null row: the maintenance programs never target it.

Continuation state (``manifest.continuation``): the rows that, with the
complete KV pages and one partial tail page, define a resumable endpoint.
``admit`` resets them (first chunk), ``snapshot`` / ``restore`` copy them
row-exactly, ``resume`` samples from the saved hidden vector.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

from flare.core import interface as io
from flare.core.interface import (LOGPROBS_ON, AdmitInput, AdmitMode, Completion, PackSegment, PrefillInput,
                                  StateCompletion, StateInput, Status, VerifyCompletion)
from flare.core.manifest import (HIST_PROMPT_BIT, Capacities, Continuation, ProgramKind, snapshot_buffer,
                                 stepped_state, verify_buffer)
from flare.core.sampling_params import INTEGER_STATE, column
from flare.prepare import prompt_rows
from flare.prepare.attention import TICKETS_BUFFER, PagedBatch
from flare.prepare.parallel import SINGLE, TensorParallel
from flare.prepare.recipes.base import PreparedModel, Recipe
from flare.prepare.sampling import apply_token_mask, choose, logprob_block, scores, uniform, verify_chain

TORCH_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint8": torch.uint8,
}


def _status(stop_ids: torch.Tensor, tok: torch.Tensor, generated: torch.Tensor, max_new: torch.Tensor) -> torch.Tensor:
    """A row's status after emitting ``tok`` as its ``generated``-th token: a stop id wins
    over the length limit."""
    stop_hit = (stop_ids.long() == tok[:, None]).any(dim=-1)
    return torch.where(stop_hit, int(Status.stop),
                       torch.where(generated >= max_new.long(), int(Status.length), int(Status.running)))


def arena_views(arena: torch.Tensor, buffers) -> dict[str, torch.Tensor]:
    """Typed, shaped views of every buffer over a flat uint8 arena tensor."""
    views = {}
    for b in buffers:
        raw = arena[b.offset : b.offset + b.nbytes]
        views[b.name] = raw.view(TORCH_DTYPES[b.dtype.value]).view(b.shape)
    return views


# Programs whose rows are prompt tokens: their linear layers compute a row the same whatever the
# capacity (kernels/gemm.py), so a prompt prefilled in pieces equals the prompt prefilled whole.
PROMPT_PROGRAMS = frozenset({ProgramKind.prefill, ProgramKind.pack, ProgramKind.score})


class ProgramSet:
    def __init__(
        self,
        recipe: Recipe,
        model: PreparedModel,
        views: dict[str, torch.Tensor],
        caps: Capacities,
        page_size: int,
        attention: str,
        continuation: Continuation,
        sampler_kernel: bool = False,
    ):
        self.recipe = recipe
        self.model = model
        self.v = views
        self.caps = caps
        self.page_size = page_size
        self.attention = attention
        self.continuation = continuation
        # The sampler's filters and draw, and the log-probability block, in Triton kernels
        # (kernels/sampler.py), as prepared (flare-prepare --sampler kernel, the CUDA
        # default); the tensor operations otherwise (--sampler ops, and the CPU backend).
        self.sampler_kernel = sampler_kernel
        # Tensor parallelism: rank zero's sample decides every rank's state update.
        self.tp = model.tp
        # Recipe state other than the hidden vector, handed to the model through the batch.
        self.model_state = {n: views[n] for n in continuation.state if n != "state.hidden"}
        # The pure computations around the model (no buffer is written in them); torch.compile
        # replaces them on CUDA (compile_glue), eager they run as they are.
        self._decode_inputs = self._decode_inputs_eager
        self._select = self._select_eager
        self._commit_rows = self._commit_rows_eager

    @classmethod
    def for_core(cls, m, views: dict[str, torch.Tensor], attention: str = "reference",
                 tp: TensorParallel = SINGLE) -> "ProgramSet":
        """A loaded core's programs over ``views`` of its arena: the recipe named by the
        manifest builds its model for this rank, checks the core has every weight buffer
        it needs and binds them (the reference worker and the tests' rig)."""
        from flare.prepare.recipes import by_name

        recipe = by_name(m.reference.recipe)
        model = recipe.build(recipe.config_from_json(m.reference.config), TORCH_DTYPES[m.reference.dtype], tp=tp)
        specs = recipe.weights(model)
        missing = [s.buffer for s in specs if s.buffer not in views]
        if missing:
            raise RuntimeError(f"core lacks weight buffers the recipe needs: {missing[:5]}")
        recipe.bind(model, specs, views)
        return cls(recipe, model, views, m.capacities, m.pages.page_size, attention, m.continuation)

    def compile_glue(self) -> None:
        """torch.compile (Inductor) the pure elementwise and integer pieces of the sampling
        programs: the decode step's inputs, mask + penalties + temperature + the uniform
        draw, and the committed rows. Eager they are some 200 kernels of a few
        microseconds each per step (bench/timeline.py: the integer hash alone is ~100);
        compiled, a handful. Reductions (softmax, sort, scans: ``choose``; with the sampler
        kernel, the CUDA default, the scans and the draw in one Triton program a row,
        ``kernels/sampler.py``) stay eager,
        whose per-row results do not depend on the batch size, so batch composition still
        never changes a request's tokens. Only pure functions are compiled, so no buffer
        mutation goes through functionalization (which could copy a whole state buffer);
        the writes stay eager index_copy_ / index_add_."""
        self._decode_inputs = torch.compile(self._decode_inputs_eager, dynamic=False)
        self._select = torch.compile(self._select_eager, dynamic=False)
        self._commit_rows = torch.compile(self._commit_rows_eager, dynamic=False)

    def callable(self, kind: ProgramKind, capacity: int, *, eager: bool = False) -> Callable[[], None]:
        fn = {
            ProgramKind.admit: self.admit,
            ProgramKind.prefill: self.prefill,
            ProgramKind.decode: self.decode,
            ProgramKind.resume: self.resume,
            ProgramKind.snapshot: self.snapshot,
            ProgramKind.restore: self.restore,
            ProgramKind.score: self.score,
            ProgramKind.pack: self.pack,
            ProgramKind.verify: self.verify,
        }[kind]

        def run() -> None:
            # eager=True runs compiled modules' original code (a program whose compiled
            # build failed is captured eagerly instead).
            stance = torch.compiler.set_stance("force_eager") if eager else contextlib.nullcontext()
            with stance, torch.inference_mode(), prompt_rows.marked(kind in PROMPT_PROGRAMS):
                fn(capacity)

        return run

    def _forward(self, tokens, pos, batch):
        return self.recipe.forward_tokens(self.model, tokens, pos, batch)

    # -- programs ----------------------------------------------------------

    def admit(self, C: int) -> None:
        """Initialise or extend a slot's penalty histogram from up to C tokens.

        mode 0 sets the prompt bit of each token once; mode 1 adds one count per
        occurrence (output tokens restored at readmission). ``clear`` (the first
        chunk of an admission) also resets the slot's continuation state to the
        initial state of an empty history (zeros: no recurrence, no convolution
        history), so a recurrent model never continues another request's state."""
        v = self.v
        meta = io.columns(AdmitInput, v[AdmitInput.buffer])
        slot = meta.slot.long()
        count, clear, mode = meta.count[0], meta.clear[0] != 0, meta.mode[0]
        V = self.caps.vocab_size
        dev = slot.device
        idx = torch.arange(C, device=dev)
        tokens = torch.where(idx < count, v[io.TOKENS][:C].long(), V)
        marks = torch.zeros(V + 1, dtype=torch.int32, device=dev).index_fill_(0, tokens, 1)[:V]
        counts = torch.zeros(V + 1, dtype=torch.int32, device=dev).index_add_(
            0, tokens, torch.ones(C, dtype=torch.int32, device=dev)
        )[:V]
        row = v["state.hist"].index_select(0, slot)[0]
        row = torch.where(clear, torch.zeros_like(row), row)
        row = torch.where(mode == int(AdmitMode.prompt), row | (marks * HIST_PROMPT_BIT), row + counts)
        v["state.hist"].index_copy_(0, slot, row[None])
        for name in self.continuation.state:
            buf = v[name]
            old = buf.index_select(0, slot)
            buf.index_copy_(0, slot, torch.where(clear, torch.zeros_like(old), old))

    def resume(self, B: int) -> None:
        """Sample the first output token of a full-prompt cache hit from the restored
        hidden vector: the same head and sampler as the last prefill chunk, no token
        recomputed. Reads ``in.prefill`` (slot, -, sample)."""
        v = self.v
        meta = io.columns(PrefillInput, v[PrefillInput.buffer])
        slot = meta.slot.long()
        logits = self._logits(v["state.hidden"].index_select(0, slot))
        live = (meta.sample != 0) & (v["state.done"].index_select(0, slot) == 0)
        self._sample_and_commit(slot, logits, live, v[io.PREFILL_COMPLETION])

    def _state_meta(self):
        meta = io.columns(StateInput, self.v[StateInput.buffer])
        return meta.slot.long(), meta.row.long(), meta.page.long(), meta.count

    def _state_record(self, slot, row, consumed) -> None:
        zero = torch.zeros_like(consumed)
        self.v[io.STATE_COMPLETION].copy_(torch.stack(StateCompletion(slot.int(), row.int(), consumed, zero), -1))

    def snapshot(self, B: int) -> None:
        """Freeze a live slot's continuation rows and its KV tail page (``page``: the
        null page at a page-aligned endpoint) into snapshot row ``row``. Exact copies.
        The completion record carries the consumed count the copied state describes,
        so the host publishes only the endpoint it asked for."""
        v = self.v
        slot, row, page, _ = self._state_meta()
        for name in self.continuation.state:
            v[snapshot_buffer(name)].index_copy_(0, row, v[name].index_select(0, slot))
        tail = v[self.continuation.tail]
        tail.index_copy_(0, row, v["kv"].index_select(2, page).movedim(2, 0))
        self._state_record(slot, row, v["state.len"].index_select(0, slot))

    def restore(self, B: int) -> None:
        """Install snapshot row ``row`` into a live slot: continuation rows, the tail
        page into the slot's private page ``page`` (never a shared one: the host
        passes the null page at a page-aligned endpoint), and the consumed count."""
        v = self.v
        slot, row, page, count = self._state_meta()
        for name in self.continuation.state:
            v[name].index_copy_(0, slot, v[snapshot_buffer(name)].index_select(0, row))
        v["kv"].index_copy_(2, page, v[self.continuation.tail].index_select(0, row).movedim(0, 2))
        v["state.len"].index_copy_(0, slot, count)
        self._state_record(slot, row, count)

    def prefill(self, C: int) -> None:
        self._prefill(C)

    def score(self, C: int) -> None:
        """A prefill chunk that also scores its tokens: row j of ``out.scores`` is the
        log-probability block (``sampling.logprob_block``) of token j given everything before it:
        the slot's saved final hidden vector predicts the chunk's first token, the chunk's
        own rows the rest (the host ignores the first row of a prompt's first chunk, which
        has no prefix, and rows past the count)."""
        v = self.v
        slot = io.columns(PrefillInput, v[PrefillInput.buffer]).slot.long()
        before = v["state.hidden"].index_select(0, slot)  # read before the chunk replaces it
        hidden = self._prefill(C)
        logits = self.recipe.lm_head(self.model, torch.cat([before, hidden[: C - 1]])).float()
        tokens = v[io.TOKENS][:C].long().clamp(0, self.caps.sampling_vocab - 1)
        v[io.SCORES].copy_(self._logprob_block(logits, tokens))

    def _prefill(self, C: int) -> torch.Tensor:
        """A prefill chunk (and its sample when asked); returns the chunk's hidden rows."""
        v = self.v
        meta = io.columns(PrefillInput, v[PrefillInput.buffer])
        slot = meta.slot.long()
        n = meta.count.long()
        dev = slot.device
        idx = torch.arange(C, device=dev)
        valid = idx < n
        tokens = torch.where(valid, v[io.TOKENS][:C].long(), 0)
        start = v["state.len"].index_select(0, slot).long()
        pos = torch.where(valid, start + idx, 0)
        pt = v["state.page_table"].index_select(0, slot)[0].long()
        slot_mapping = self._slot_mapping(pt.expand(C, -1), pos, valid)
        batch = self._batch(slot.expand(C), pos, slot_mapping, valid, single_slot=True)
        hidden = self._forward(tokens, pos, batch)
        v["out.prefill_hidden"][:C].copy_(hidden)
        if self.caps.mtp_drafts:  # token r's hidden predecessor: the slot's saved vector, then the chunk's
            before = torch.cat([v["state.hidden"].index_select(0, slot), hidden[: C - 1]])
            self._mtp_rows(tokens, before, batch)
        last = hidden.index_select(0, (n - 1).clamp(min=0))
        v["state.hidden"].index_copy_(0, slot, last)
        v["state.len"].index_copy_(0, slot, (start + n).int())
        logits = self._logits(last)
        live = (meta.sample != 0) & (v["state.done"].index_select(0, slot) == 0)
        self._sample_and_commit(slot, logits, live, v[io.PREFILL_COMPLETION])
        return hidden

    def pack(self, C: int) -> None:
        """Segments of several slots in one program of C rows (``in.pack``: a PackSegment
        row each, up to min(B, C) of them). Row r belongs to the segment whose rows hold it
        and continues that slot's history: its position is the slot's length plus its offset
        in the segment, and it attends to its own slot's pages only (the batch is not
        single-slot; tiles of one slot's rows share their key reads). Each used segment of a
        slot not done then does what a prefill chunk does for its slot (a one-token segment
        of the pending token: what a decode row does): length, final hidden vector, and a
        sample when asked, its record in segment order."""
        v = self.v
        S = min(v[io.PACK_INPUT].shape[0], C)
        meta = io.columns(PackSegment, v[io.PACK_INPUT][:S].t())  # each field: [1, S]
        slots, counts, sample = meta.slot[0].long(), meta.count[0].long(), meta.sample[0]
        dev = slots.device
        used = counts > 0
        live_seg = used & (v["state.done"].index_select(0, slots) == 0)
        starts = torch.where(used, meta.row[0].long(), C)  # ascending: used segments come first
        idx = torch.arange(C, device=dev)
        seg = (torch.searchsorted(starts, idx, right=True) - 1).clamp(min=0)
        off = idx - starts.index_select(0, seg)
        valid = (off >= 0) & (off < counts.index_select(0, seg)) & live_seg.index_select(0, seg)
        row_slot = torch.where(valid, slots.index_select(0, seg), 0)
        start = v["state.len"].index_select(0, slots).long()  # [S]
        pos = torch.where(valid, start.index_select(0, seg) + off, 0)
        tokens = torch.where(valid, v[io.TOKENS][:C].long(), 0)
        pt = v["state.page_table"].index_select(0, row_slot).long()
        batch = self._batch(row_slot, pos, self._slot_mapping(pt, pos, valid), valid, tiles=True)
        hidden = self._forward(tokens, pos, batch)
        v["out.prefill_hidden"][:C].copy_(hidden)
        last = hidden.index_select(0, (starts + counts - 1).clamp(0, C - 1))
        # Unused segments name the null slot (garbage by contract); they, and the segments of
        # finished slots, write their old rows back.
        old_hidden = v["state.hidden"].index_select(0, slots)
        v["state.hidden"].index_copy_(0, slots, torch.where(live_seg[:, None], last, old_hidden))
        v["state.len"].index_copy_(0, slots, (start + counts * live_seg).int())
        logits = self._logits(last)
        live = live_seg & (sample != 0)
        self._sample_and_commit(slots, logits, live, v[io.PACK_COMPLETION][:S])

    def _decode_inputs_eager(self, B: int):
        v = self.v
        slots = v[io.DECODE_SLOTS][:B].long()
        live = (slots > 0) & (v["state.done"].index_select(0, slots) == 0)
        tokens = torch.where(live, v["state.pending"].index_select(0, slots).long(), 0)
        length = v["state.len"].index_select(0, slots).long()
        pos = torch.where(live, length, 0)
        pt = v["state.page_table"].index_select(0, slots).long()
        return slots, live, tokens, length, pos, self._slot_mapping(pt, pos, live)

    def decode(self, B: int) -> None:
        v = self.v
        slots, live, tokens, length, pos, slot_mapping = self._decode_inputs(B)
        batch = self._batch(slots, pos, slot_mapping, live)
        hidden = self._forward(tokens, pos, batch)
        if self.caps.mtp_drafts:
            self._mtp_rows(tokens, v["state.hidden"].index_select(0, slots), batch)
        if self.sampler_kernel:  # (one launch: kernels/sampler.commit_hidden)
            from flare.prepare.kernels.sampler import commit_hidden

            commit_hidden(v, slots, live, hidden)
        else:
            old_hidden = v["state.hidden"].index_select(0, slots)
            v["state.hidden"].index_copy_(0, slots, torch.where(live[:, None], hidden, old_hidden))
            v["state.len"].index_copy_(0, slots, (length + live.long()).int())
        logits = self._logits(hidden)
        self._sample_and_commit(slots, logits, live, v[io.DECODE_COMPLETION][:B])

    def verify(self, B: int) -> None:
        """A speculative decode step (``interface`` module docstring): row b's pending token and
        first ``count`` drafts run as W = D + 1 positions of its slot (the drafts' KV is written
        past the slot's length; whatever is rejected stays past the new length, unread, and is
        overwritten later), then ``verify_chain`` decides what is emitted. The commit is a
        decode step's for each emitted token: length and generated count grow by the emitted
        count, the pending token becomes the last emitted one, the hidden vector the last
        consumed position's, the counter advances by one per emitted token (the draws used),
        the histogram counts every emitted token."""
        v, caps = self.v, self.caps
        D = caps.draft_tokens
        W = D + 1
        meta = v[io.VERIFY_INPUT][:B].long()
        slots = meta[:, 0]
        dev = slots.device
        live = (slots > 0) & (v["state.done"].index_select(0, slots) == 0)
        mask_on = v["state.mask_on"].index_select(0, slots)
        # A grammar mask is known for the first position only: a constrained row verifies no drafts.
        count = torch.where(live & (mask_on == 0), meta[:, 1].clamp(0, D), 0)
        drafts = v[io.DRAFTS][:B].long().clamp(0, caps.sampling_vocab - 1)
        length = v["state.len"].index_select(0, slots).long()
        j = torch.arange(W, device=dev)
        valid = live[:, None] & (j[None, :] <= count[:, None])  # [B, W]
        tokens = torch.cat([v["state.pending"].index_select(0, slots).long()[:, None], drafts], dim=1)
        pos = torch.where(valid, length[:, None] + j[None, :], 0).reshape(-1)
        valid = valid.reshape(-1)
        row_slot = slots.repeat_interleave(W)
        pt = v["state.page_table"].index_select(0, row_slot).long()
        batch = self._batch(row_slot, pos, self._slot_mapping(pt, pos, valid), valid, verify_width=W,
                            verify_state={n: v[verify_buffer(n)][:B] for n in stepped_state(self.continuation)})
        flat = torch.where(valid, tokens.reshape(-1), 0)
        hidden = self._forward(flat, pos, batch)  # [B * W, H]
        if self.caps.mtp_drafts:  # position j's hidden predecessor: the slot's saved vector, then position j - 1's
            hw = hidden.reshape(B, W, -1)
            before = torch.cat([v["state.hidden"].index_select(0, slots)[:, None], hw[:, :-1]], 1)
            self._mtp_rows(flat, before.reshape(B * W, -1), batch)
        logits = self.recipe.lm_head(self.model, hidden).float().reshape(B, W, -1)
        v["out.logits"][:B].copy_(logits[:, 0])  # the first position's, raw (as a decode step's)
        first = apply_token_mask(logits[:, 0], v["in.token_mask"].index_select(0, slots), mask_on)
        logits = torch.cat([first[:, None], logits[:, 1:]], dim=1)
        samp = v["state.sampling"].index_select(0, slots)
        params = {name: samp[:, column(name)] for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                                                            "presence_penalty", "frequency_penalty")}
        generated = v["state.generated"].index_select(0, slots).long()
        max_new = v["state.max_new"].index_select(0, slots).long()
        stop_ids = v["state.stop_ids"].index_select(0, slots)
        counter = v["state.counter"].index_select(0, slots)
        out, emitted, _ = verify_chain(
            logits, drafts, count, live, v["state.hist"].index_select(0, slots),
            {"temperature": params["temperature"], "top_k": v[INTEGER_STATE["top_k"]].index_select(0, slots),
             "top_p": params["top_p"], "min_p": params["min_p"], "repetition": params["repetition_penalty"],
             "presence": params["presence_penalty"], "frequency": params["frequency_penalty"]},
            v["state.seed"].index_select(0, slots), counter, stop_ids, generated, max_new, caps.sampling_vocab,
            kernel=self.sampler_kernel)
        # Every rank verified the same gathered logits from replicated state; rank 0's verdict
        # decides everywhere (no-op at TP=1).
        out = self.tp.from_rank_zero(out.contiguous())
        emitted = self.tp.from_rank_zero(emitted.contiguous())
        last_at = (emitted - 1).clamp(min=0)
        last = out.gather(1, last_at[:, None])[:, 0]
        total = generated + emitted
        status = _status(stop_ids, last, total, max_new)
        old_hidden = v["state.hidden"].index_select(0, slots)
        new_hidden = hidden.reshape(B, W, -1).gather(1, last_at[:, None, None].expand(-1, 1, hidden.shape[-1]))[:, 0]
        v["state.hidden"].index_copy_(0, slots, torch.where(live[:, None], new_hidden, old_hidden))
        # Recurrent state: the state after the last consumed position (the pending token and
        # the accepted drafts); the rejected positions' states are never read.
        rows = torch.arange(B, device=dev)
        for name, per_position in batch.verify_state.items():
            kept = per_position[rows, last_at]
            keep = live.reshape(-1, *([1] * (kept.dim() - 1)))
            v[name].index_copy_(0, slots, torch.where(keep, kept, v[name].index_select(0, slots)))
        v["state.len"].index_copy_(0, slots, (length + emitted).int())
        v["state.pending"].index_copy_(0, slots, torch.where(live, last, v["state.pending"].index_select(0, slots)
                                                              .long()).int())
        v["state.generated"].index_copy_(0, slots, total.int())
        v["state.counter"].index_copy_(0, slots, counter + emitted)
        v["state.done"].index_copy_(0, slots, torch.where(live, status, v["state.done"].index_select(0, slots)
                                                           .long()).int())
        # The histograms count rank 0's emitted tokens (rows that are not live emitted none and
        # come back unchanged), as verify_chain's own did on every rank that agrees with it.
        hist = v["state.hist"].index_select(0, slots)
        hist.scatter_add_(1, out.clamp(min=0), (out >= 0).to(hist.dtype))
        v["state.hist"].index_copy_(0, slots, hist)
        parts = [torch.stack(VerifyCompletion(slots, emitted, total, torch.where(live, status, int(Status.inactive))),
                             dim=-1), out]
        if self.caps.mtp_drafts:
            parts.append(self._mtp_chain(slots, live & (status == int(Status.running)), last,
                                         torch.where(live[:, None], new_hidden, old_hidden), length + emitted,
                                         meta[:, 2]))
        v[io.VERIFY_COMPLETION][:B].copy_(torch.cat(parts, dim=-1).int())

    # -- the MTP head (recipes/mtp.py) ----------------------------------------

    def _mtp_rows(self, tokens, before, batch: PagedBatch) -> None:
        """The MTP head's KV rows for a program's tokens (``recipes/mtp.py``): the row of token
        ``tokens[r]`` is the head's input (that token, ``before[r]``: the target's hidden vector
        at the position before it), at the token's own position and KV row, so the program's
        batch (its positions, slot mapping and valid rows) writes them where it writes the
        model's. The rows a verify program writes for drafts it rejects lie past the slot's new
        length, rewritten before anything reads them, as the model's are."""
        self.recipe.mtp_forward(self.model, tokens, before, batch.positions, batch)

    def _mtp_chain(self, slots, live, token, hidden, length, room) -> torch.Tensor:
        """Greedy learned drafts ``[B, D]`` for each row's next step: the head from (the pending
        token, the hidden vector before it) at the pending token's position ``length``, then from
        each draft and the head's own output one position on. A row stops (-1 from there) at the
        first position its pages do not hold (``room``): the chain writes the head's KV there."""
        v = self.v
        pt = v["state.page_table"].index_select(0, slots).long()
        room = room.clamp(max=pt.shape[1] * self.page_size)
        p, drafts = length, []
        for _ in range(self.caps.mtp_drafts):
            ok = live & (p < room)
            p = torch.where(ok, p, 0)
            batch = self._batch(slots, p, self._slot_mapping(pt, p, ok), ok)
            hidden = self.recipe.mtp_forward(self.model, torch.where(ok, token, 0), hidden, p, batch)
            logits = self.recipe.lm_head(self.model, hidden)[:, : self.caps.sampling_vocab]
            token = logits.float().argmax(dim=-1)
            drafts.append(torch.where(ok, token, -1))
            live, p = ok, p + 1
        return torch.stack(drafts, dim=-1)

    # -- shared pieces -----------------------------------------------------

    def _slot_mapping(self, page_rows: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        ps = self.page_size
        page_idx = (pos // ps).clamp(max=page_rows.shape[1] - 1)
        page = page_rows.gather(1, page_idx[:, None])[:, 0]
        return torch.where(valid, page * ps + pos % ps, -1)

    def _batch(self, token_slot, pos, slot_mapping, valid, single_slot: bool = False,
               tiles: bool = False, verify_width: int = 0, verify_state: dict | None = None) -> PagedBatch:
        return PagedBatch(
            kv=self.v["kv"],
            page_table=self.v["state.page_table"],
            token_slot=token_slot,
            positions=pos,
            slot_mapping=slot_mapping,
            valid=valid,
            impl=self.attention,
            single_slot=single_slot,
            tiles=tiles,
            state=self.model_state,
            verify_width=verify_width,
            verify_state=verify_state,
            tickets=self.v.get(TICKETS_BUFFER),
        )

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The rows' logits in float32, converted straight into ``out.logits`` (the program's raw
        logits) and read from there by the sampler: one pass, no float32 copy beside it."""
        out = self.v["out.logits"][: hidden.shape[0]]
        out.copy_(self.recipe.lm_head(self.model, hidden))
        return out

    def _select_eager(self, slots: torch.Tensor, logits: torch.Tensor):
        """Mask, penalties and temperature for each row's slot, its uniform draw and its filters:
        elementwise and integer work only (compiled on CUDA). Returns (scores, draw, top_k, top_p,
        min_p), the filters contiguous (a strided column would be a copy kernel of its own)."""
        v = self.v
        # Grammar masks first, before penalties and filters: a masked token is never a
        # candidate, whatever its penalised probability. The host wrote the slot's row of
        # in.token_mask for this very step (one step in flight for constrained slots).
        logits = apply_token_mask(logits, v["in.token_mask"].index_select(0, slots),
                                  v["state.mask_on"].index_select(0, slots))
        samp = v["state.sampling"].index_select(0, slots)
        x = scores(logits, v["state.hist"].index_select(0, slots), temperature=samp[:, column("temperature")],
                   repetition=samp[:, column("repetition_penalty")], presence=samp[:, column("presence_penalty")],
                   frequency=samp[:, column("frequency_penalty")], sampling_vocab=self.caps.sampling_vocab)
        return (x, uniform(v["state.seed"].index_select(0, slots), v["state.counter"].index_select(0, slots)),
                v[INTEGER_STATE["top_k"]].index_select(0, slots), samp[:, column("top_p")].contiguous(),
                samp[:, column("min_p")].contiguous())

    def _commit_rows_eager(self, slots: torch.Tensor, live: torch.Tensor, tok: torch.Tensor):
        """The state rows a sampled token leaves behind (not written here) and the
        completion record."""
        v = self.v
        li = live.long()
        generated = v["state.generated"].index_select(0, slots).long() + li
        status = _status(v["state.stop_ids"].index_select(0, slots), tok, generated,
                         v["state.max_new"].index_select(0, slots))
        pending = torch.where(live, tok, v["state.pending"].index_select(0, slots).long())
        done = torch.where(live, status, v["state.done"].index_select(0, slots).long())
        counter = v["state.counter"].index_select(0, slots) + li
        record = torch.stack(Completion(slots, torch.where(live, tok, -1), generated,
                                        torch.where(live, status, int(Status.inactive))), dim=-1)
        return pending.int(), generated.int(), counter, done.int(), slots * self.caps.vocab_size + tok, \
            li.int(), record.int()

    def _sample_and_commit(
        self, slots: torch.Tensor, logits: torch.Tensor, live: torch.Tensor, completion: torch.Tensor
    ) -> None:
        """Sample one token per row and commit it to live rows' request state:
        pending token, generated count, RNG counter, penalty histogram, done flag.
        Rows that are not live keep their state; their completion says inactive."""
        v = self.v
        x, u, top_k, top_p, min_p = self._select(slots, logits)
        tok = choose(x, top_k, top_p, min_p, u, kernel=self.sampler_kernel)
        # Every rank sampled the same gathered logits from replicated state; committing
        # rank 0's tokens everywhere makes divergence impossible even so (no-op at TP=1).
        tok = self.tp.from_rank_zero(tok)
        if self.sampler_kernel:
            # (the commit and the completion record in one launch, the log-probability block
            # written into the record's columns by its own kernels: kernels/sampler.py)
            from flare.prepare.kernels.sampler import commit_rows, logprob_block as block

            commit_rows(v, slots, live, tok, completion)
            if self.caps.max_logprobs:
                block(logits.float(), tok, self.caps.max_logprobs, self.caps.sampling_vocab,
                      out=completion[:, len(Completion._fields):], wants=(slots, v[LOGPROBS_ON]))
            return
        pending, generated, counter, done, hist_at, count, record = self._commit_rows(slots, live, tok)
        v["state.pending"].index_copy_(0, slots, pending)
        v["state.generated"].index_copy_(0, slots, generated)
        v["state.counter"].index_copy_(0, slots, counter)
        v["state.done"].index_copy_(0, slots, done)
        v["state.hist"].view(-1).index_add_(0, hist_at, count)
        if self.caps.max_logprobs:
            record = torch.cat([record, self._logprob_block(logits, tok, wants=(slots, v[LOGPROBS_ON]))], dim=-1)
        completion.copy_(record)

    def _logprob_block(self, logits: torch.Tensor, tok: torch.Tensor, wants=None) -> torch.Tensor:
        """``sampling.logprob_block`` of the core's ``max_logprobs`` over its sampling vocabulary
        (``wants``: only for the rows whose slots ask, zeros elsewhere)."""
        return logprob_block(logits, tok, self.caps.max_logprobs, self.caps.sampling_vocab, kernel=self.sampler_kernel,
                             wants=wants)
