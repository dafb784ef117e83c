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

The per-slot request state written at admission (``slot_state``) and the
sampling columns (``flare.core.sampling_params``) complete the interface.
"""

from __future__ import annotations

import enum
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


class StateCompletion(NamedTuple):
    """A snapshot / restore record: the slot and row copied between and the consumed count
    the copied state describes (snapshot: the live row's own; restore: the count set)."""

    slot: int
    row: int
    consumed: int
    reserved: int = 0


DECODE_SLOTS = "in.decode_slots"
TOKENS = "in.tokens"
PREFILL_COMPLETION = "out.prefill_completion"
DECODE_COMPLETION = "out.decode_completion"
STATE_COMPLETION = "out.state_completion"

Row = TypeVar("Row", AdmitInput, PrefillInput, StateInput, Completion, StateCompletion)


def pack(row: NamedTuple) -> np.ndarray:
    """A row as the int32 vector the device reads."""
    return np.array(row, np.int32)


def unpack(cls: type[Row], values) -> Row:
    """A record (or input row) read back from the device, as Python ints."""
    values = list(values)
    if len(values) != len(cls._fields):
        raise ExecutionError(f"{cls.__name__} has {len(cls._fields)} fields, got {len(values)} values",
                             code="bad_completion")
    return cls(*(int(v) for v in values))


def columns(cls: type[Row], row):
    """The row's fields as one-element slices of ``row`` (a device tensor or an array):
    preparation reads program inputs with this, so indices never leave the device."""
    return cls(*(row[i : i + 1] for i in range(len(cls._fields))))


# ---------------------------------------------------------------------------
# Per-slot request state written at admission: one row of each buffer.


def slot_state(*, pending: int, generated: int, max_new: int, seed: int, sampling, stop_ids: Sequence[int],
               stop_capacity: int, pages: Sequence[int], max_pages: int, mask_on: bool) -> dict[str, np.ndarray]:
    """The state rows that start (or restart) a request in a slot: buffer name -> row value.
    ``sampling`` holds one resolved value per sampling parameter (mapping or attributes);
    stop ids beyond the given ones are -1, page table entries beyond ``pages`` the null page 0.
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
    }
    for name, buffer in INTEGER_STATE.items():
        rows[buffer] = np.int32(get(name))
    return rows
