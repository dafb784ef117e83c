"""The sampling parameters, defined once.

Every place that names a sampling parameter derives it from ``SAMPLING_PARAMS``:
the request bodies' optional fields (``server.protocol``), their resolution
against a core's defaults and ranges (``server.params``), the manifest's
declared defaults (``SamplingDefaults``), the resolved per-request values
(``runtime.request.SamplingParams``), the columns of the device's sampling
state the runtime writes at admission and the sampler programs read
(``float_row`` / ``SAMPLING_COLUMNS``), and the neutral defaults and ranges a
model source starts from (``prepare.sources``). Adding a parameter is a row
here plus its arithmetic in the sampler (``prepare/sampling.py``).
"""

from __future__ import annotations

from typing import Mapping, NamedTuple

import numpy as np


class SamplingParam(NamedTuple):
    name: str
    type: type  # int or float: the request field's type and the resolved value's
    neutral: float  # leaves the model's distribution as it is (filters off, penalties neutral)
    range: tuple[float, float]  # declared by a source that declares no ranges of its own
    # Column of the float32 ``state.sampling`` row; None for an integer parameter, which
    # has its own int32 per-slot buffer ``state.<name>``.
    column: int | None
    # Values replay qualification (``runtime/qualify.py``) draws per slot: the neutral value
    # and active ones, so every path of the sampler is exercised; with ``probe_range`` set,
    # a uniform draw from it instead. Changing either changes every core's golden inputs.
    probes: tuple[float, ...]
    probe_range: tuple[float, float] | None = None


SAMPLING_PARAMS: tuple[SamplingParam, ...] = (
    SamplingParam("temperature", float, 1.0, (0.01, 2.0), 0, (), probe_range=(0.3, 1.5)),
    # 0 disables top-k (a negative request value too, as vLLM's -1).
    SamplingParam("top_k", int, 0, (0, 1 << 30), None, (0, 1, 20, 50)),
    SamplingParam("top_p", float, 1.0, (0.01, 1.0), 1, (1.0, 0.95, 0.8)),
    SamplingParam("min_p", float, 0.0, (0.0, 1.0), 2, (0.0, 0.05)),
    SamplingParam("repetition_penalty", float, 1.0, (1.0, 2.0), 3, (1.0, 1.1)),
    SamplingParam("presence_penalty", float, 0.0, (-2.0, 2.0), 4, (0.0, 0.5)),
    SamplingParam("frequency_penalty", float, 0.0, (-2.0, 2.0), 5, (0.0, 0.2)),
)

SAMPLING_NAMES: tuple[str, ...] = tuple(p.name for p in SAMPLING_PARAMS)
BY_NAME: Mapping[str, SamplingParam] = {p.name: p for p in SAMPLING_PARAMS}
NEUTRAL: Mapping[str, float] = {p.name: p.neutral for p in SAMPLING_PARAMS}
# The float parameters in ``state.sampling`` column order.
SAMPLING_COLUMNS: tuple[str, ...] = tuple(
    p.name for p in sorted((p for p in SAMPLING_PARAMS if p.column is not None), key=lambda p: p.column))
# Integer parameters, each with its own per-slot int32 state buffer.
INTEGER_STATE: Mapping[str, str] = {p.name: f"state.{p.name}" for p in SAMPLING_PARAMS if p.column is None}
# Penalties read the slot's token histogram; at their neutral values they change no logit.
PENALTIES: tuple[str, ...] = ("repetition_penalty", "presence_penalty", "frequency_penalty")

if tuple(BY_NAME[n].column for n in SAMPLING_COLUMNS) != tuple(range(len(SAMPLING_COLUMNS))):
    raise AssertionError("state.sampling columns must be 0..n-1 without gaps")


def column(name: str) -> int:
    """The ``state.sampling`` column of a float parameter."""
    c = BY_NAME[name].column
    if c is None:
        raise KeyError(f"{name} is an integer parameter with its own state buffer {INTEGER_STATE[name]}")
    return c


def getter(values):
    """Read parameter values by name from a mapping or from an object with one attribute
    per parameter (resolved SamplingParams)."""
    return values.get if isinstance(values, Mapping) else lambda n: getattr(values, n)


def float_row(values) -> np.ndarray:
    """The float32 ``state.sampling`` row of resolved values (see ``getter``)."""
    get = getter(values)
    return np.array([get(n) for n in SAMPLING_COLUMNS], np.float32)


def penalizes(values) -> bool:
    """Whether any penalty differs from its neutral value (it then reads the histogram)."""
    get = getter(values)
    return any(get(n) != BY_NAME[n].neutral for n in PENALTIES)
