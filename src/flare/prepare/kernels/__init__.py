"""Capture-safe Triton kernels for the prepared programs.

Every kernel here reads lengths, positions, slots and page ids from device
tensors; its launch grid depends only on static shapes, so one CUDA-graph
capture serves every later step. Importing a submodule imports Triton, so the
reference path (CPU, no Triton) never imports this package's submodules.
"""

import os as _os

if _os.environ.get("TRITON_INTERPRET") == "1":  # (CPU: helper calls without re-patching, exact dots,
    # no discarded overflow checks: _interpreter.py)
    from flare.prepare.kernels._interpreter import cheaper_ops, exact_dots, quicker_device_calls

    quicker_device_calls()
    exact_dots()
    cheaper_ops()
