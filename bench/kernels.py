"""Operator classes of the kernels in an exported graph, by kernel name.

Inductor names its Triton kernels after the fused ATen ops (``triton_red_fused_
..._mean_mul_pow_rsqrt_0``); cuBLAS / CUTLASS GEMMs carry their family names
(``nvjet_sm90_...``, ``cutlass_80_simt_sgemm...``); Flare's own Triton kernels
are ``_attend_kernel``, ``_combine_kernel`` (split-K attention's merge) and
``_write_kv_kernel``; everything left in ATen's namespace (``_ZN2at6native...``)
ran eagerly, outside any compiled region.
"""

from __future__ import annotations

_OPS = (
    ("splitk_reduce", ("splitkreduce",)),
    ("attention", ("attention", "_attend_kernel", "_combine_kernel")),
    ("kv_write", ("kv_write", "write_kv")),
    ("matmul", ("gemm", "gemv", "xmma", "cutlass", "nvjet")),
    ("norm", ("rsqrt",)),
    ("mlp_act", ("silu",)),
    ("sort", ("radix_sort", "radixsort", "sortstable")),
    ("rotary", ("cos_kernel", "sin_kernel")),
    ("compiled_other", ("triton_",)),
    ("eager_other", ("_zn2at6native", "at_cuda_detail", "_zn50_global")),
)


def op_of(name: str) -> str:
    low = name.lower()
    return next((op for op, keys in _OPS if any(k in low for k in keys)), "other")
