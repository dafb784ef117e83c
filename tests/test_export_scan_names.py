"""Which kernels' stale parameter words the export zeroes (``flare.prepare.cuda.export``):
ATen's TensorIterator elementwise, reduction and indexing kernels and its index_select kernels
only, by their mangled names; the scan itself runs on the GPU (tests/gpu/test_export_scan.py)."""

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
    # index_select (a stale word in the padding after a TensorInfo's dims: a Qwen3-30B-A3B-shape
    # decode step on the H200, 2026-12-06)
    "_ZN2at6native44_GLOBAL__N__50c743a2_11_Indexing_cu_89862edb21indexSelectSmallIndexIfljLi2E": True,
    "_ZN2at6native44_GLOBAL__N__50c743a2_11_Indexing_cu_89862edb21indexSelectLargeIndexIN3c108B": True,
    "_ZN2at6native44_GLOBAL__N__50c743a2_11_Indexing_cu_89862edb16indexFuncSmallIndexIiljLi1ELi1": False,
    "_ZN2at6native40_GLOBAL__N__0f1a8107_8_Shape_cu_49f7391c35CatArrayBatchedCopy_alignedK_cont": False,
    "_ZN2at6native34_scatter_gather_elementwise_kernelILi128ELi8EZNS0_36_cuda_scatter_gather_in": False,
    "_ZN14at_cuda_detail3cub6detail10radix_sort29DeviceRadixSortOnesweepKernelINS1_5radix10poli": False,
    "triton_poi_fused_add_0": False,
    "nvjet_sm90_tst_64x8_64x16_4x1_v_bz_TNT": False,
}


def test_only_tensor_iterator_and_index_select_kernels_may_carry_stale_words():
    assert {name: E.tensor_iterator_stale_ok(name) for name in NAMES} == NAMES
