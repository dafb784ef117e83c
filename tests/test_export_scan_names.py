"""Which kernels' stale parameter words the export zeroes (``flare.prepare.cuda.export``):
ATen's TensorIterator elementwise, reduction and indexing kernels only, by their mangled names;
and the index_select kernels' TensorInfo operands cleared past their dims. The scan itself runs
on the GPU (tests/gpu/test_export_scan.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("cuda.bindings")

from flare.prepare.cuda import export as E  # noqa: E402

NAMES = {  # mangled names of kernels seen in captured programs
    "_ZN2at6native18elementwise_kernelILi128ELi4EZNS0_22gpu_kernel_impl_nocastIZZZNS0_23direct_copy": True,
    "_ZN2at6native29vectorized_elementwise_kernelILi4ENS0_11FillFunctorIiEESt5arrayIPcLm1EEEEviT0_T1_": True,
    "_ZN2at6native27unrolled_elementwise_kernelIZZZNS0_23direct_copy_kernel_cudaERNS_18TensorIt": True,
    "_ZN2at6native13reduce_kernelILi512ELi1ENS0_8ReduceOpIfNS0_7MeanOpsIffffEEjfLi4ELi4EEEEEvT1_": True,
    # index_copy (seen with a stale word in the Mistral shape's admit program on the H200)
    "_ZN2at6native24index_elementwise_kernelILi128ELi4EZNS0_22index_copy_kernel_implINS0_10Opaq": True,
    "_ZN2at6native44_GLOBAL__N__50c743a2_11_Indexing_cu_89862edb21indexSelectSmallIndexIfljLi2E": False,
    "_ZN2at6native44_GLOBAL__N__50c743a2_11_Indexing_cu_89862edb16indexFuncSmallIndexIiljLi1ELi1": False,
    "_ZN2at6native40_GLOBAL__N__0f1a8107_8_Shape_cu_49f7391c35CatArrayBatchedCopy_alignedK_cont": False,
    "_ZN2at6native34_scatter_gather_elementwise_kernelILi128ELi8EZNS0_36_cuda_scatter_gather_in": False,
    "_ZN14at_cuda_detail3cub6detail10radix_sort29DeviceRadixSortOnesweepKernelINS1_5radix10poli": False,
    "triton_poi_fused_add_0": False,
    "nvjet_sm90_tst_64x8_64x16_4x1_v_bz_TNT": False,
}


def test_only_tensor_iterator_elementwise_reduction_and_indexing_kernels_may_carry_stale_words():
    assert {name: E.tensor_iterator_stale_ok(name) for name in NAMES} == NAMES


INDEX_SELECT = {
    "_ZN2at6native44_GLOBAL__N__50c743a2_11_Indexing_cu_89862edb21indexSelectSmallIndexIfljLi2E": True,
    "_ZN2at6native44_GLOBAL__N__50c743a2_11_Indexing_cu_89862edb21indexSelectLargeIndexIN3c108B": True,
    "_ZN2at6native44_GLOBAL__N__50c743a2_11_Indexing_cu_89862edb16indexFuncSmallIndexIiljLi1ELi1": False,
    "_ZN2at6native24index_elementwise_kernelILi128ELi4EZNS0_22index_copy_kernel_implINS0_10Opaq": False,
}


def test_index_select_tensor_infos_are_cleared_past_their_dims():
    """An index_select kernel's three TensorInfo operands (data, 25 sizes, 25 strides, dims: 216
    bytes with 32-bit indices) as a Qwen3-30B-A3B-shape decode step had them on the H200: the
    source's dims (2) below four bytes of stale padding (0x7f28), the entries past dims holding
    host-stack garbage. Cleared: every pointer, the used sizes and strides, dims and the
    parameters after the operands as they were; the rest zero. A dims outside 1..25 fails."""
    import struct

    assert {name: E.index_select_kernel(name) for name in INDEX_SELECT} == INDEX_SELECT

    def info(ptr, sizes, strides, junk):
        n = len(sizes)
        return struct.pack("<Q25I25Ii", ptr, *sizes, *[junk] * (25 - n), *strides, *[junk] * (25 - n), n) + \
            struct.pack("<I", junk)

    ops = [info(0x600000001000, [4, 2048], [2048, 1], 0x7f28), info(0x600000100000, [151936, 2048], [2048, 1], 0x7f28),
           info(0x600000200000, [4], [1], 0xdead)]
    tail = struct.pack("<iiIiq", 0, 0, 2048, 0, 151936)
    buf = bytearray(b"".join(ops) + tail)
    layout = [(0, 216), (216, 216), (432, 216), (648, 4), (652, 4), (656, 4), (664, 8)]
    assert struct.unpack_from("<Q", buf, 424)[0] == 0x7f2800000002  # the word of the failed export
    E._clear_tensor_info_tails(buf, layout, "decode.4 node 229")
    clean = [info(0x600000001000, [4, 2048], [2048, 1], 0), info(0x600000100000, [151936, 2048], [2048, 1], 0),
             info(0x600000200000, [4], [1], 0)]
    assert bytes(buf) == b"".join(clean) + tail
    bad = bytearray(buf)
    struct.pack_into("<i", bad, 216 + 208, 0)
    with pytest.raises(E.ExportError, match="dims 0"):
        E._clear_tensor_info_tails(bad, layout, "p")
    with pytest.raises(E.ExportError, match="216 or 416"):
        E._clear_tensor_info_tails(bytearray(buf), [(0, 200), (216, 216), (432, 216)], "p")
