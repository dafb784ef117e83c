"""Whether the program being run (and traced) computes prompt rows: prefill, pack and
score programs do; decode, verify and the state programs do not. Linear layers made row
invariant (``kernels/gemm.py``) read it; ``ProgramSet.callable`` sets it. Kept apart from
the kernels so the CPU reference path never imports Triton."""

from __future__ import annotations

import contextlib
from typing import Iterator

_ON = [False]


def active() -> bool:
    return _ON[0]


@contextlib.contextmanager
def marked(on: bool) -> Iterator[None]:
    before, _ON[0] = _ON[0], on
    try:
        yield
    finally:
        _ON[0] = before
