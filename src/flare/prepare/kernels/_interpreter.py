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
"""

from __future__ import annotations

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
