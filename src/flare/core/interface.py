"""The program interface: the layout of every row the runtime writes before a
program and of every record a program writes back, and the status codes.

One typed owner for both sides of the boundary. The runtime packs inputs with
``pack`` and unpacks records with ``unpack``; preparation reads the same rows
on the device with ``columns`` (one-element slices, so indices stay device
tensors) and builds records in the same field order. Field order is the row
layout: a reordering here changes both sides together (and is an ABI change).

Rows by program::

    admit              in.admit   AdmitInput     (+ in.tokens)
    prefill[C]         in.prefill PrefillInput   (+ in.tokens)   -> out.prefill_completion  Completion
    resume             in.prefill PrefillInput   (count unused)  -> out.prefill_completion  Completion
    decode[B]          in.decode_slots (B slot ids, 0 = padding) -> out.decode_completion   Completion x B
    snapshot, restore  in.state   StateInput                     -> out.state_completion    StateCompletion
    score[S]           in.prefill PrefillInput   (+ in.tokens)   -> out.prefill_completion  Completion
                                                                    and out.scores (one row per token)
    pack[C]            in.pack    PackSegment x B (+ in.tokens)  -> out.pack_completion     Completion x min(B, C)
    verify[B]          in.verify  VerifyInput x B (+ in.drafts)  -> out.verify_completion   VerifyCompletion x B
                       (B: the decode capacities up to manifest.MAX_VERIFY_BATCH)

``pack`` runs up to min(B, C) segments of different slots (B: the largest decode
capacity) in one program of C rows: segment i is ``count`` tokens of ``in.tokens`` from
row ``row``, continuing its slot's history (a one-token segment of the slot's pending
token is a decode row). Used segments come first, in ascending rows that do not
overlap; unused ones have count 0. Its records are in segment order.

``verify`` is a speculative decode step (cores prepared with ``draft_tokens`` D > 0): row b
runs its slot's pending token and its first ``count`` drafts (row b of ``in.drafts``, D
columns) as W = D + 1 positions, verifies the drafts in order with the exact acceptance rule
and emits the accepted ones plus one more token (``prepare/sampling.verify_chain``). Its
record is the ``VerifyCompletion`` fields, then W token columns (-1 past the emitted ones);
it carries no log-probabilities (requests that ask for them decode without drafts), and a
slot with a grammar mask verifies no drafts (the mask is known for the first position only).
A core with an MTP head (``capacities.mtp_drafts`` M > 0) appends M more columns: the head's
greedy drafts for the row's next step, continuing after its last emitted token (-1 from the
first one whose position the slot's pages, ``room``, do not hold).

The per-slot request state written at admission (``slot_state``) and the
sampling columns (``flare.core.sampling_params``) complete the interface.

Log-probabilities: a core prepared with ``max_logprobs`` N > 0 widens every sampling
record (prefill, resume, decode, pack) by ``logprob_columns(N)`` int32 columns after the
``Completion`` fields: the sampled token's log-probability, the N largest
log-probabilities (descending) as float32 bit patterns, then their N token ids. The
values are ``log_softmax`` of the model's raw logits over the sampling vocabulary
(before grammar masks, penalties, temperature and filters). A row whose slot's
``LOGPROBS_ON`` flag is 0 (its request asks for none) carries zeros there instead.
"""

from __future__ import annotations

import enum
import itertools
from typing import NamedTuple, Sequence, TypeVar

import numpy as np

from flare.core.errors import ExecutionError
from flare.core.sampling_params import INTEGER_STATE, float_row, getter


class Status(enum.IntEnum):
    """A completion record's status column."""

    inactive = -1  # the row was padding or its request had already finished
    running = 0
    stop = 1  # a stop id was sampled (EOS or a request stop token id)
    length = 2  # the request reached its max_new tokens


class AdmitMode(enum.IntEnum):
    prompt = 0  # set the prompt bit of each token once
    output = 1  # add one count per occurrence (output tokens restored at readmission)


class AdmitInput(NamedTuple):
    """``in.admit``: build a slot's penalty histogram from ``count`` tokens of ``in.tokens``."""

    slot: int
    count: int
    clear: int  # 1 on an admission's first chunk: also resets the slot's continuation state
    mode: int  # AdmitMode
    buffer = "in.admit"


class PrefillInput(NamedTuple):
    """``in.prefill``: a prefill chunk of ``count`` tokens of ``in.tokens`` for ``slot``, or
    a resume of ``slot`` (``count`` unused); ``sample`` 1 samples the next token."""

    slot: int
    count: int
    sample: int
    reserved: int = 0
    buffer = "in.prefill"


class PackSegment(NamedTuple):
    """``in.pack`` row: ``count`` tokens of ``in.tokens`` from row ``row`` continue ``slot``'s
    history; ``sample`` 1 samples the next token after the last of them."""

    slot: int
    count: int
    sample: int
    row: int
    buffer = "in.pack"


class VerifyInput(NamedTuple):
    """``in.verify`` row: verify the first ``count`` drafts of ``slot`` (its row of
    ``in.drafts``); slot 0 is padding. ``room``: the positions the slot's pages hold (a core
    with an MTP head writes its draft chain's rows only below it)."""

    slot: int
    count: int
    room: int
    buffer = "in.verify"


class StateInput(NamedTuple):
    """``in.state``: snapshot / restore between live ``slot`` and checkpoint ``row``; ``page``
    is the KV tail page (the null page when the endpoint is page-aligned), ``count`` the
    endpoint's consumed count (restore sets it)."""

    slot: int
    row: int
    page: int
    count: int
    buffer = "in.state"


class Completion(NamedTuple):
    """A sampling program's record for one row (prefill, resume: one; decode: B)."""

    slot: int
    token: int  # -1 when the row was not live
    generated: int
    status: int  # Status


class VerifyCompletion(NamedTuple):
    """A verify program's record for one row, before its W token columns: ``emitted`` tokens
    (the accepted drafts and one more; 0 when the row was not live), the request's generated
    count after them and the status after the last."""

    slot: int
    emitted: int
    generated: int
    status: int  # Status


class StateCompletion(NamedTuple):
    """A snapshot / restore record: the slot and row copied between and the consumed count
    the copied state describes (snapshot: the live row's own; restore: the count set)."""

    slot: int
    row: int
    consumed: int
    reserved: int = 0


MAX_LOGPROBS = 20  # OpenAI's ceiling for top_logprobs and for the legacy completions' logprobs


def logprob_columns(max_logprobs: int) -> int:
    """int32 columns a sampling record carries after its ``Completion`` fields."""
    return 1 + 2 * max_logprobs if max_logprobs > 0 else 0


class TokenLogprobs(NamedTuple):
    """The log-probability block of a sampling record, as Python values."""

    logprob: float  # the sampled token's
    top_ids: tuple[int, ...]  # the N most likely tokens, most likely first
    top_logprobs: tuple[float, ...]


def unpack_logprobs(record, max_logprobs: int, *, start: int = len(Completion._fields)) -> TokenLogprobs:
    """The block after the ``Completion`` fields of one record row (``logprob_columns``), or
    from ``start`` (0: a row of ``SCORES``)."""
    n = max_logprobs
    block = np.ascontiguousarray(np.asarray(record)[start : start + logprob_columns(n)], np.int32)
    if n <= 0 or block.size != 1 + 2 * n:
        raise ExecutionError(f"a record of {len(record)} columns has no block of {n} log-probabilities",
                             code="bad_completion")
    values = block[: 1 + n].view(np.float32)
    return TokenLogprobs(float(values[0]), tuple(int(i) for i in block[1 + n :]),
                         tuple(float(v) for v in values[1:]))


DECODE_SLOTS = "in.decode_slots"
PACK_INPUT = PackSegment.buffer
PACK_COMPLETION = "out.pack_completion"
VERIFY_INPUT = VerifyInput.buffer
DRAFTS = "in.drafts"  # [B, D] int32: each verify row's draft tokens
VERIFY_COMPLETION = "out.verify_completion"
MAX_DRAFT_TOKENS = 16
SCORES = "out.scores"  # score programs: row j is token j's log-probability block (logprob_columns)
TOKENS = "in.tokens"
PREFILL_COMPLETION = "out.prefill_completion"
DECODE_COMPLETION = "out.decode_completion"
STATE_COMPLETION = "out.state_completion"
# Whether a slot's request asks for log-probabilities (int32 per slot, written at admission): the
# sampling programs compute a row's log-probability block only then (zeros otherwise).
LOGPROBS_ON = "state.logprobs_on"

Row = TypeVar("Row", AdmitInput, PrefillInput, PackSegment, VerifyInput, StateInput, Completion, VerifyCompletion,
              StateCompletion)


def pack(row: NamedTuple) -> np.ndarray:
    """A row as the int32 vector the device reads."""
    return np.array(row, np.int32)


def unpack(cls: type[Row], values, *, extra: int = 0) -> Row:
    """A record (or input row) read back from the device, as Python ints; ``extra``
    columns after the fields (a sampling record's log-probabilities) are left out."""
    values = list(values)
    if len(values) != len(cls._fields) + extra:
        raise ExecutionError(f"{cls.__name__} has {len(cls._fields)} fields, got {len(values)} values",
                             code="bad_completion")
    return cls(*(int(v) for v in values[: len(cls._fields)]))


def completion(record) -> Completion:
    """A sampling record's ``Completion`` fields, with or without its log-probability block."""
    extra = len(record) - len(Completion._fields)
    if extra and (extra < 3 or extra % 2 == 0):
        raise ExecutionError(f"a sampling record has {len(Completion._fields)} fields and optionally 1 + 2N "
                             f"log-probability columns, got {len(record)} values", code="bad_completion")
    return unpack(Completion, record, extra=extra)


def verify_record(record, draft_tokens: int, mtp_drafts: int = 0) -> tuple[VerifyCompletion, list[int]]:
    """A verify record row: its fields and its emitted tokens."""
    head = unpack(VerifyCompletion, record, extra=draft_tokens + 1 + mtp_drafts)
    if not 0 <= head.emitted <= draft_tokens + 1:
        raise ExecutionError(f"a verify record emitted {head.emitted} of at most {draft_tokens + 1} tokens",
                             code="bad_completion")
    start = len(VerifyCompletion._fields)
    return head, [int(t) for t in list(record)[start : start + head.emitted]]


def mtp_drafts(record, draft_tokens: int, mtp_drafts: int) -> list[int]:
    """A verify record row's learned drafts for the row's next step (its last ``mtp_drafts``
    columns: the MTP head's greedy chain after the last emitted token; -1 where the chain
    had no room)."""
    tail = [int(t) for t in list(record)[len(VerifyCompletion._fields) + draft_tokens + 1:]]
    if len(tail) != mtp_drafts:
        raise ExecutionError(f"a verify record carries {len(tail)} learned drafts, expected {mtp_drafts}",
                             code="bad_completion")
    return list(itertools.takewhile(lambda t: t >= 0, tail))


def columns(cls: type[Row], row):
    """The row's fields as one-element slices of ``row`` (a device tensor or an array):
    preparation reads program inputs with this, so indices never leave the device."""
    return cls(*(row[i : i + 1] for i in range(len(cls._fields))))


# ---------------------------------------------------------------------------
# Per-slot request state written at admission: one row of each buffer.


def slot_state(*, pending: int, generated: int, max_new: int, seed: int, sampling, stop_ids: Sequence[int],
               stop_capacity: int, pages: Sequence[int], max_pages: int, mask_on: bool,
               logprobs: bool) -> dict[str, np.ndarray]:
    """The state rows that start (or restart) a request in a slot: buffer name -> row value.
    ``sampling`` holds one resolved value per sampling parameter (mapping or attributes);
    stop ids beyond the given ones are -1, page table entries beyond ``pages`` the null page 0;
    ``logprobs``: whether the request reads its tokens' log-probability blocks.
    ``state.len`` starts at 0: prefill (or a restore) sets the history."""
    if len(stop_ids) > stop_capacity:
        raise ValueError(f"{len(stop_ids)} stop ids exceed the capacity {stop_capacity}")
    stops = np.full(stop_capacity, -1, np.int32)
    stops[: len(stop_ids)] = stop_ids
    table = np.zeros(max_pages, np.int32)
    table[: len(pages)] = pages
    get = getter(sampling)
    rows = {
        "state.len": np.int32(0),
        "state.pending": np.int32(pending),
        "state.generated": np.int32(generated),
        "state.max_new": np.int32(max_new),
        "state.done": np.int32(0),
        "state.seed": np.int64(seed),
        "state.counter": np.int64(0),
        "state.sampling": float_row(sampling),
        "state.stop_ids": stops,
        "state.page_table": table,
        "state.mask_on": np.int32(bool(mask_on)),
        LOGPROBS_ON: np.int32(bool(logprobs)),
    }
    for name, buffer in INTEGER_STATE.items():
        rows[buffer] = np.int32(get(name))
    return rows
