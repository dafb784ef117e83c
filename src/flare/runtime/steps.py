"""What the scheduler hands the engine: one program launch and the writes before it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from flare.core.manifest import ProgramKind
from flare.runtime.pages import RowId
from flare.runtime.request import Request


@dataclass
class Write:
    buffer: str
    value: np.ndarray
    row: int | slice | tuple | None = None


@dataclass
class Step:
    kind: ProgramKind
    program: str
    writes: list[Write] = field(default_factory=list)
    requests: list[Request] = field(default_factory=list)
    completion: str | None = None
    count: int = 0  # prefill: tokens in this chunk
    sample: bool = False  # prefill / resume: samples the first output token
    row: RowId | None = None  # snapshot / restore: the snapshot row it writes or reads
    endpoint: int = 0  # snapshot / restore: the consumed count of the endpoint
    scores: Any = None  # score: the rows of out.scores, read after the program
    # pack: (tokens, samples, decoding) of each request's segment, in the order of ``requests``
    # (decoding: a decode row of the pending token, not a prefill chunk)
    segments: list[tuple[int, bool, bool]] = field(default_factory=list)
    drafts: list[list[int]] = field(default_factory=list)  # verify: each request's draft tokens
    scheduled_at: float = field(default_factory=time.monotonic)  # when it was decided (step times)
