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


@triton.jit
def _dot_kernel(a_ptr, b_ptr, out_ptr, N, K: tl.constexpr, BN: tl.constexpr):
    """Rows 0..15 of a @ b, the columns in blocks of BN (the program's), K in blocks of 32."""
    m = tl.arange(0, 16)
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    acc = tl.zeros([16, BN], tl.float32)
    for k0 in range(0, K, 32):
        k = k0 + tl.arange(0, 32)
        a = tl.load(a_ptr + m[:, None] * K + k[None, :])
        b = tl.load(b_ptr + k[:, None] * N + n[None, :])
        acc = tl.dot(a, b, acc)
    tl.store(out_ptr + m[:, None] * N + n[None, :], acc)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_dot_is_the_rounding_of_its_exact_sum_whatever_the_block(dtype):
    """``tl.dot`` under the interpreter (``_interpreter.exact_dots``): each block's product is the
    float32 rounding of its exact sum, so 16- and 32-column blocks give the same bits (OpenBLAS's
    float32 products did not on an AVX2 EPYC), and bfloat16 operands are their values (the
    interpreter multiplied their raw 16-bit patterns)."""
    import math

    import flare.prepare.kernels  # noqa: F401  (installs the exact dot under the interpreter)

    g = torch.Generator().manual_seed(5)
    K, N = 96, 64
    a = torch.randn(16, K, generator=g).to(dtype)
    b = torch.randn(K, N, generator=g).to(dtype)
    outs = {}
    for bn in (16, 32):
        outs[bn] = torch.empty(16, N)
        _dot_kernel[(N // bn,)](a, b, outs[bn], N, K=K, BN=bn)
    assert torch.equal(outs[16], outs[32])
    a64, b64 = a.double().numpy(), b.double().numpy()
    want = np.zeros((16, N), dtype=np.float32)
    for i in range(16):
        for j in range(N):
            for k0 in range(0, K, 32):  # the kernel's blocks, each rounded, then added in float32
                part = np.float32(math.fsum((a64[i, k0:k0 + 32] * b64[k0:k0 + 32, j]).tolist()))
                want[i, j] = np.float32(want[i, j] + part)
    assert torch.equal(outs[16], torch.from_numpy(want))


@triton.jit
def _index_kernel(x_ptr, out_ptr, n, stride, BLOCK: tl.constexpr):
    """int32 index arithmetic (mul, add, sub) and a load through it, wrapping past 2^31."""
    i = tl.arange(0, BLOCK)
    big = (i + n) * stride - 1  # int32: n * stride overflows for the last rows
    tl.store(out_ptr + i, big)
    tl.store(out_ptr + BLOCK + i, tl.load(x_ptr + (i * 3) % BLOCK).to(tl.int32))


def test_integer_operations_are_not_checked_twice_and_dtypes_are_the_interpreters(monkeypatch):
    """``_interpreter.cheaper_ops``: the interpreter's builder asks no overflow checks (their
    64-bit recomputation fed an assertion it never makes without ``debug``), so an int32 add, sub
    or mul is one operation, its result still wrapping as the GPU's; ``_get_np_dtype`` cached by
    element gives the interpreter's own answer for every scalar, pointer and block type."""
    import flare.prepare.kernels  # noqa: F401  (installs it under the interpreter)
    from flare.prepare.kernels import _interpreter as fi
    from triton.runtime import interpreter as ti

    assert not ti.interpreter_builder.options.sanitize_overflow and not ti.interpreter_builder.options.debug
    assert fi.cheaper_ops()  # (installed once: again is a no-op)
    ops = []
    real = ti.InterpreterBuilder.binary_op

    def counted(self, lhs, rhs, op):
        ops.append(op.__name__)
        return real(self, lhs, rhs, op)

    monkeypatch.setattr(ti.InterpreterBuilder, "binary_op", counted)
    x = torch.arange(8, dtype=torch.int32) * 10
    out = torch.empty(16, dtype=torch.int32)
    n, stride = 2**20, 2**11
    _index_kernel[(1,)](x, out, n, stride, BLOCK=8)
    want = [((i + n) * stride - 1 + 2**31) % 2**32 - 2**31 for i in range(8)]
    assert out[:8].tolist() == want and out[8:].tolist() == [(i * 3) % 8 * 10 for i in range(8)]
    # The kernel's integer adds, subs and muls, each once (checked, every one would come again in int64).
    assert len(ops) <= 8, ops
    np_dtype = ti._get_np_dtype.__wrapped__  # (the interpreter's own function)
    assert np_dtype.__module__ == ti.__name__ and np_dtype.__name__ == "_get_np_dtype"
    for el in (tl.int1, tl.int8, tl.uint8, tl.int16, tl.int32, tl.uint32, tl.int64, tl.float16, tl.bfloat16,
               tl.float32, tl.float64, tl.float8e4nv, tl.pointer_type(tl.float32), tl.pointer_type(tl.bfloat16)):
        for tt in (el, tl.block_type(el, [4, 8]), tl.block_type(el, [2])):
            assert ti._get_np_dtype(tt) == np_dtype(tt), tt
