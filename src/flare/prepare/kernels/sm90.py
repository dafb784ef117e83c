"""A Triton kernel compiled for sm_90 without a GPU (Triton's compiler and its ptxas), with the
argument types its launches pass: the sm_90 compile test (tests/test_kernels_sm90.py) and
tools/same_ptx.py."""

from __future__ import annotations

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

# paged_attention._attend_kernel's arguments other than int32, as cores launch it (bfloat16 KV)
ATTEND_TYPES = {**{n: "*bf16" for n in ("q_ptr", "out_ptr", "k_cache", "v_cache")},
                **{n: "*fp32" for n in ("part_acc", "part_m", "part_l")}, "page_table": "*i32",
                "token_slot": "*i64", "positions": "*i64", "valid": "*u8", "part_eff": "*i32", "scale_log2": "fp32",
                "tickets": "*i32"}


def compile_for_sm90(fn, types: dict, constexprs: dict, num_warps: int = 4, num_stages: int = 3,
                     aligned: tuple[str, ...] = ()):
    """``fn`` compiled for sm_90: ``types`` names the arguments' types (int32 where it does not),
    ``constexprs`` their values; a constexpr left out takes its default, as at a launch.
    ``aligned``: arguments a launch finds multiples of 16 (pointers 16-byte aligned, sizes and
    strides), which it specializes on as Triton's launcher does (vector loads, pipelining)."""
    constexprs = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}, **constexprs}
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in fn.arg_names}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": num_stages})
