"""Under Triton's interpreter (the CPU tests), helper calls inside a launch skip re-patching
``triton.language`` (``flare.prepare.kernels._interpreter``): the launch patches it once, the
helpers compute what they computed."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed")
import triton.language as tl  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter's calls")


@triton.jit
def _twice(x):
    return x * 2


@triton.jit
def _plus(x, y):
    return _twice(x) + y  # a helper calling a helper


@triton.jit
def _helpers_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i)
    acc = tl.zeros([BLOCK], tl.float32)
    for _ in range(3):
        acc = _plus(x, acc)
    tl.store(out_ptr + i, acc)


def test_helpers_in_a_launch_are_not_patched_again(monkeypatch):
    import flare.prepare.kernels  # noqa: F401  (installs the shortcut under the interpreter)
    from triton.runtime import interpreter as ti

    assert getattr(ti.InterpretedFunction, "_flare_quick_calls", False)
    patches = []
    real = ti._patch_lang
    monkeypatch.setattr(ti, "_patch_lang", lambda fn: patches.append(fn.__name__) or real(fn))
    x = torch.arange(16, dtype=torch.float32)
    out = torch.empty_like(x)
    _helpers_kernel[(4,)](x, out, BLOCK=4)
    assert torch.equal(out, 6 * x)  # 3 x (2 x)
    # The launch's, and tl.zeros' once (its module sees triton.language.core, the kernel's does not):
    # 4 more calls of it and 24 of the two helpers took none.
    assert patches == ["_helpers_kernel", "zeros"], patches
    # Outside a launch a helper is patched as before (and computes the same).
    del patches[:]
    scope = real(_helpers_kernel.fn)
    try:
        three = tl.tensor(ti.TensorHandle(np.array([3.0], dtype=np.float32), tl.float32), tl.float32)
        assert float(_twice(three).handle.data[0]) == 6.0
    finally:
        scope.restore()
    assert patches == ["_twice"], patches
