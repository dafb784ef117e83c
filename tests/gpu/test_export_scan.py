"""The export's pointer scan on the GPU (``flare.prepare.cuda.export``): a kernel parameter
word that points at live device memory outside the arena fails the export, except in ATen's
TensorIterator elementwise and reduction kernels, where it is a stale host-stack word of
their ``OffsetCalculator`` and is zeroed instead."""

from __future__ import annotations

import struct

import pytest

pytest.importorskip("cuda.bindings")

from flare.prepare.cuda import export as E  # noqa: E402


def test_a_word_pointing_outside_the_arena_fails_unless_it_is_a_tensor_iterator_stale_word():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    arena = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    outside = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    span = (arena.data_ptr(), arena.numel())
    # An arena pointer, a small integer, a pointer into the other allocation, two uint32 strides.
    buf = struct.pack("<QQQII", arena.data_ptr() + 64, 7, outside.data_ptr() + 128, 4, 4096)
    with pytest.raises(E.ExportError, match=r"offset 16 of 32 .* outside the arena"):
        E._scan_pointers(buf, span, "p node 0")
    assert E._scan_pointers(buf, span, "p node 0", stale_ok=True) == [16]
    assert E._scan_pointers(buf[:16] + bytes(8) + buf[24:], span, "p node 0") == []
