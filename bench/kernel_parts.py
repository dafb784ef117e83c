"""Operator classes of the kernels in an exported graph, by kernel name.

Inductor names its Triton kernels after the fused ATen ops (``triton_red_fused_
..._mean_mul_pow_rsqrt_0``); cuBLAS / CUTLASS GEMMs carry their family names
(``nvjet_sm90_...``, ``cutlass_80_simt_sgemm...``); Flare's own Triton kernels
are ``_attend_kernel``, ``_combine_kernel`` (split-K attention's merge) and
``_write_kv_kernel``; everything left in ATen's namespace (``_ZN2at6native...``)
ran eagerly, outside any compiled region.

Parts of a layer (``part_of``) come from the weights a kernel reads: the router, the
routed experts (with the shared expert where decode steps fold it in), the shared expert
run apart, attention, the Gated DeltaNet mixer, a dense MLP,
the norms, and the head; kernels that read no weight belong to the part before them
(``bench.timeline.fill_layers``): a mixture-of-experts layer's plan (softmax, sort,
scatter, search) follows its router GEMM, the expert-output sum its grouped GEMMs.
"""

from __future__ import annotations

_OPS = (
    ("splitk_reduce", ("splitkreduce",)),
    ("attention", ("attention", "_attend_kernel", "_combine_kernel")),
    ("kv_write", ("kv_write", "write_kv")),
    ("matmul", ("gemm", "gemv", "xmma", "cutlass", "nvjet", "nonsplit_kernel")),
    ("norm", ("rsqrt",)),
    ("mlp_act", ("silu",)),
    ("experts", ("_grouped_kernel",)),
    ("sort", ("radix_sort", "radixsort", "sortstable")),
    ("rotary", ("cos_kernel", "sin_kernel")),
    ("compiled_other", ("triton_",)),
    ("eager_other", ("_zn2at6native", "at_cuda_detail", "_zn50_global")),
)


# In order: a decode step's folded expert kernels read the routed and the shared experts'
# weights (experts), its router GEMV the router's and the shared expert's gate (router).
_PARTS = (
    ("experts", ("mlp.experts.",)),
    ("router", ("mlp.gate.",)),
    ("shared_expert", ("shared_expert",)),
    ("attention", ("self_attn.",)),
    ("gdn", ("linear_attn.",)),
    ("mlp", ("mlp.",)),
    ("norm", ("norm.",)),
    ("head", ("lm_head.", "embed_tokens.")),
)


def part_of(weights: list[str]) -> str | None:
    """The part of the model a kernel serves, from the weight buffers it reads (None: none)."""
    for part, keys in _PARTS:
        if any(k in w for w in weights for k in keys):
            return part
    return None


def op_of(name: str) -> str:
    low = name.lower()
    return next((op for op, keys in _OPS if any(k in low for k in keys)), "other")
