"""Device-function calls under Triton's interpreter without re-patching ``triton.language``.

With ``TRITON_INTERPRET=1`` (the CPU tests, and preparations of CPU cores that run the CUDA
path's kernels) a kernel launch patches ``triton.language`` for the interpreter for its
duration, and every call of a ``@triton.jit`` helper from inside it patches it again: five
``inspect.getmembers`` scans of the language's modules, about 0.4 ms a call, never undone. The
kernels here call helpers in their loops (``_key_block``, ``_fold``, ``_rows_product``, ...), so
that re-patching was about a quarter of the interpreter's time (cProfile of
``test_sliding_windows_match_the_masked_reference``: 148k calls, 63 of 263 s). Inside a launch
whose patch already covers the helper's language modules it changes nothing (the same attributes
set to the same wrappers), so :func:`quicker_device_calls` skips it there. A helper called
outside a launch is patched as before, and so is the first in a launch whose module sees a language
module the launch's did not (``triton.language``'s own helpers, ``tl.zeros``, ``tl.sum``, see
``triton.language.core``): that patch is never undone, so it holds for the launch's later calls.

:func:`exact_dots` makes the interpreter's ``tl.dot`` a function of its operands' values alone.
The interpreter multiplies each block with ``np.matmul`` in float32, whose summation order is
the BLAS kernel's: OpenBLAS picks it by the CPU and the shapes, so on some CPUs (an AMD EPYC
with AVX2) a row's products summed in a 16-column block are other bits than the same row in a
32-column block. Tests that compare tilings bit for bit, as the GPU's fixed reduction order
allows, then failed on those machines only. Here each output is the float32 rounding of the
float64 rounding of its exact sum (float32 and half-precision products are exact in float64;
bfloat16 operands, which the interpreter stores as raw 16-bit integers and multiplied as
such, are widened first). A float64 ``np.matmul`` gives that value wherever its error bound
leaves one float32 in reach; the rare others are summed exactly (``math.fsum``).

:func:`cheaper_ops` drops work whose result the interpreter throws away. Its builder's options
ask for integer-overflow checks (``sanitize_overflow``) but not ``debug``, and its
``device_assert`` does nothing without ``debug``: every 32-bit integer add, sub and mul (index
arithmetic, most of a kernel's operations) was computed a second time in 64 bits and compared
with both bounds for an assertion that was never made, about four times the operation's own
cost. The compiled kernels check no overflow either without ``debug``. It also caches
``_get_np_dtype`` by element type: it built a dict of 19 Triton dtypes on each of its calls.
"""

from __future__ import annotations

import math
import threading


def quicker_device_calls() -> bool:
    """Install the shortcut on the interpreter (once); False where its layout is not the one this
    was written against (then nothing changes)."""
    try:
        from triton.runtime import interpreter as ti
    except ImportError:
        return False
    fn_cls, grid_cls = getattr(ti, "InterpretedFunction", None), getattr(ti, "GridExecutor", None)
    lang = getattr(ti, "tl", None)
    if fn_cls is None or grid_cls is None or lang is None or not hasattr(ti, "_patch_lang"):
        return False
    if getattr(fn_cls, "_flare_quick_calls", False):
        return True
    launch_call, device_call = grid_cls.__call__, fn_cls.__call__
    state = threading.local()
    seen: dict = {}

    def langs(fn) -> frozenset:
        """The language modules ``_patch_lang`` patches for ``fn``: those its globals hold."""
        key = id(fn.__globals__)
        if key not in seen:
            seen[key] = frozenset(id(v) for v in fn.__globals__.values() if v is lang or v is lang.core)
        return seen[key]

    def launch(self, *args, **kwargs):
        outer = getattr(state, "langs", None)
        state.langs = langs(self.fn)
        try:
            return launch_call(self, *args, **kwargs)
        finally:
            state.langs = outer

    def call(self, *args, **kwargs):
        active, mine = getattr(state, "langs", None), langs(self.fn)
        if active is None:
            return device_call(self, *args, **kwargs)
        if not mine <= active:  # (the interpreter never undoes a helper's patch: it holds to the launch's end)
            state.langs = active | mine
            return device_call(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise ti.InterpreterError(repr(e)) from e

    grid_cls.__call__, fn_cls.__call__ = launch, call
    fn_cls._flare_quick_calls = True
    return True


def exact_dots() -> bool:
    """Install the exact ``tl.dot`` on the interpreter (once); False where its builder is not the
    one this was written against (then nothing changes). Accumulators other than float32 and
    8-bit or integer operands keep the interpreter's own product."""
    try:
        import numpy as np
        from triton.runtime import interpreter as ti
    except ImportError:
        return False
    builder, handle = getattr(ti, "InterpreterBuilder", None), getattr(ti, "TensorHandle", None)
    real = getattr(builder, "create_dot", None)
    if real is None or handle is None:
        return False
    if getattr(real, "_flare_exact", False):
        return True

    def widened(x):
        """The operand's values as float64 (exact), or None for a type left to the interpreter."""
        if x.data.dtype == np.uint16 and getattr(x.dtype, "is_bf16", lambda: False)():
            return (x.data.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        if x.data.dtype in (np.float16, np.float32):
            return x.data.astype(np.float64)
        return None

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        a64, b64 = widened(a), widened(b)
        if a64 is None or b64 is None or d.data.dtype != np.float32:
            return real(self, a, b, d, input_precision, max_num_imprecise_acc)
        return handle(rounded_products(a64, b64) + d.data, d.dtype.scalar)

    create_dot._flare_exact = True
    builder.create_dot = create_dot
    return True


def cheaper_ops() -> bool:
    """Install both on the interpreter (once); False where its module is not the one this was
    written against, or its builder asserts (``debug``: then its overflow checks count)."""
    try:
        import dataclasses

        from triton.runtime import interpreter as ti
    except ImportError:
        return False
    builder, np_dtype = getattr(ti, "interpreter_builder", None), getattr(ti, "_get_np_dtype", None)
    options = getattr(builder, "options", None)
    if options is None or np_dtype is None or not dataclasses.is_dataclass(options) or options.debug:
        return False
    if getattr(np_dtype, "_flare_cached", False):
        return True
    builder.options = dataclasses.replace(options, sanitize_overflow=False)
    block, cache = ti.tl.block_type, {}

    def cached(tt_dtype):
        """A block's NumPy dtype is its element's (block types do not hash: they key by element)."""
        el = tt_dtype.element_ty if isinstance(tt_dtype, block) else tt_dtype
        try:
            return cache[el]
        except KeyError:
            cache[el] = out = np_dtype(el)
            return out
        except TypeError:  # (an unhashable type)
            return np_dtype(tt_dtype)

    cached._flare_cached, cached.__wrapped__ = True, np_dtype
    ti._get_np_dtype = cached
    return True


def rounded_products(a, b):
    """``a @ b`` (float64 arrays ``[..., M, K]`` and ``[..., K, N]`` of float32-exact values) as
    float32: each element the float32 rounding of the float64 rounding of the exact sum."""
    import numpy as np

    k = a.shape[-1]
    r = np.matmul(a, b)
    # |BLAS - exact| <= K u sum |a b| (u = 2^-53, with or without FMA); doubled for the bound's
    # own rounding. Where both ends of r +- bound round to one float32, so does the exact sum.
    bound = np.matmul(np.abs(a), np.abs(b)) * (2.0 * (k + 2) * 2.0 ** -53)
    with np.errstate(over="ignore", invalid="ignore"):  # (beyond float32: inf, as float32 sums give)
        out = r.astype(np.float32)
        unsure = (r - bound).astype(np.float32) != (r + bound).astype(np.float32)
    if not unsure.any():
        return out
    for at in zip(*np.nonzero(unsure & np.isfinite(out))):
        *batch, i, j = at
        out[at] = np.float32(math.fsum((a[(*batch, i)] * b[(*batch, slice(None), j)]).tolist()))
    return out
