"""Time the Triton paged-attention kernel on CUDA (graph replay, bf16).

    PYTHONPATH=src python tools/bench_paged_attention.py

Decode reports the KV bytes read per call over the time (the kernel is
memory-bound); prefill reports causal attention TFLOP/s, with torch's SDPA
(flash, contiguous K/V, no paging) on the same problem for scale.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton.testing

from flare.prepare.attention import PagedBatch
from flare.prepare.kernels.paged_attention import attend_triton

DEV, DT = "cuda", torch.bfloat16


def setup(H, KVH, D, ps, slots, ctx, T, single_slot, positions, token_slot):
    max_pages = -(-ctx // ps)
    P = 1 + slots * max_pages
    kv = torch.randn(1, 2, P, ps, KVH, D, dtype=DT, device=DEV)
    pt = (torch.randperm(P - 1, device=DEV)[: slots * max_pages] + 1).view(slots, max_pages).int()
    valid = torch.ones(T, dtype=torch.bool, device=DEV)
    batch = PagedBatch(kv, pt, token_slot, positions, torch.full((T,), -1, device=DEV), valid,
                       impl="triton", single_slot=single_slot)
    q = torch.randn(T, H, D, dtype=DT, device=DEV)
    return batch, q


def bench(fn):
    return triton.testing.do_bench_cudagraph(fn, rep=200)  # ms


def decode(H, KVH, D, ps, B, ctx):
    batch, q = setup(H, KVH, D, ps, B, ctx, B, False,
                     torch.full((B,), ctx - 1, device=DEV), torch.arange(B, device=DEV))
    ms = bench(lambda: attend_triton(batch, 0, q, D**-0.5))
    gb = 2 * B * ctx * KVH * D * 2 / 1e9
    print(f"decode H{H}/KVH{KVH}/D{D} ps{ps} B={B:3d} ctx={ctx:5d}: {ms * 1e3:8.1f} us  {gb / ms * 1e3:7.0f} GB/s")


def prefill(H, KVH, D, ps, T, history):
    ctx = history + T
    batch, q = setup(H, KVH, D, ps, 1, ctx, T, True,
                     history + torch.arange(T, device=DEV), torch.zeros(T, dtype=torch.long, device=DEV))
    ms = bench(lambda: attend_triton(batch, 0, q, D**-0.5))
    flops = 4 * H * D * (T * history + T * (T + 1) / 2)
    qs = q.transpose(0, 1)[None]
    ks = torch.randn(1, H, ctx, D, dtype=DT, device=DEV)
    mask = None if history == 0 else (torch.arange(ctx, device=DEV)[None] <= (history + torch.arange(T, device=DEV))[:, None])
    sdpa = bench(lambda: F.scaled_dot_product_attention(qs, ks, ks, attn_mask=mask, is_causal=history == 0))
    print(f"prefill H{H}/KVH{KVH}/D{D} ps{ps} T={T:4d} hist={history:5d}: {ms * 1e3:8.1f} us "
          f"{flops / ms / 1e9:6.0f} TFLOP/s   (sdpa contiguous, MHA: {sdpa * 1e3:8.1f} us)")


def main():
    for H, KVH, D in ((9, 3, 64), (32, 8, 128)):
        for B, ctx in ((1, 1024), (8, 4096), (64, 2048), (256, 1024)):
            decode(H, KVH, D, 16, B, ctx)
        for T, hist in ((4096, 0), (512, 0), (512, 4096), (128, 8192)):
            prefill(H, KVH, D, 16, T, hist)


if __name__ == "__main__":
    main()
