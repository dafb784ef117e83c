"""Timing work as a program pays it: inside a CUDA graph (CUDA only). The one definition lives
in ``flare.prepare.timing`` (prepare's own measurements use it too)."""

from __future__ import annotations

from flare.prepare.timing import graph_ms

__all__ = ["graph_ms"]
