"""Capture-safe scatter of a chunk's keys/values into the page pool.

Unlike :func:`flare.prepare.attention.write_kv`, which redirects padded rows
into the null page, this kernel writes nothing at all for a row whose
``slot_mapping`` is negative (or past the pool): the decision is a store mask
read on the device, so the launch stays capture-safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flare.prepare.attention import PagedBatch


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache, v_cache, slot_mapping, pool_rows,
    stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
    stride_cp, stride_co, stride_ch, stride_cd, stride_sm,
    KVH: tl.constexpr, KVH_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, PAGE: tl.constexpr,
):
    t = tl.program_id(0)
    dst = tl.load(slot_mapping + t * stride_sm).to(tl.int64)
    ok = (dst >= 0) & (dst < pool_rows)
    if ok:  # a padded row (most rows of a short prompt chunk) writes nothing
        base = (dst // PAGE) * stride_cp + (dst % PAGE) * stride_co
        hh = tl.arange(0, KVH_PAD)[:, None]
        dd = tl.arange(0, D_PAD)[None, :]
        mask = (hh < KVH) & (dd < D)
        dst_off = base + hh * stride_ch + dd * stride_cd
        k = tl.load(k_ptr + t * stride_kt + hh * stride_kh + dd * stride_kd, mask=mask)
        tl.store(k_cache + dst_off, k.to(k_cache.dtype.element_ty), mask=mask)
        v = tl.load(v_ptr + t * stride_vt + hh * stride_vh + dd * stride_vd, mask=mask)
        tl.store(v_cache + dst_off, v.to(v_cache.dtype.element_ty), mask=mask)


def write_kv_triton(batch: PagedBatch, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """Write ``k``/``v`` (``[T, KVH, D]``, any strides) at ``batch.slot_mapping``; rows < 0 write nothing."""
    kv = batch.kv
    T, KVH, D = k.shape
    if v.shape != k.shape or kv.shape[-2:] != (KVH, D):
        raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} do not match kv heads x dim {tuple(kv.shape[-2:])}")
    if batch.slot_mapping.shape != (T,):
        raise ValueError(f"batch.slot_mapping has shape {tuple(batch.slot_mapping.shape)}, expected ({T},)")
    if not 0 <= layer < kv.shape[0]:
        raise ValueError(f"layer {layer} outside kv's {kv.shape[0]} layers")
    if T == 0:
        return
    k_cache, v_cache = kv[layer, 0], kv[layer, 1]  # [P, page_size, KVH, D] views
    ps = kv.shape[3]
    _write_kv_kernel[(T,)](
        k, v, k_cache, v_cache, batch.slot_mapping, kv.shape[2] * ps,
        *k.stride(), *v.stride(), *k_cache.stride(), batch.slot_mapping.stride(0),
        KVH=KVH, KVH_PAD=triton.next_power_of_2(KVH), D=D, D_PAD=triton.next_power_of_2(D), PAGE=ps,
        num_warps=4,
    )
