"""Does prefetching the next GEMM's weight into L2 during a decode layer's small kernels
shorten the layer? (CUDA only.)

A decode layer at batch 1 is a chain of weight-streaming GEMMs with small kernels between
them, during which the memory system idles. Here one CUDA graph holds LAYERS layers of the 8B dense or
9B Gated DeltaNet layer's GEMMs (cuBLAS, distinct weights per layer: several hundred MB
in all, past the L2), each GEMM followed by as many small elementwise kernels as the real
step has before the next GEMM, and, in the prefetching variants, right after each GEMM a
prefetch of the next GEMM's weight (its first ``limit`` bytes). The graph's replay time
over LAYERS is the time of a layer; also timed: the GEMMs alone and the small kernels
alone. Every variant's outputs are compared with the plain chain's (the same bits).

    python -m bench.l2_prefetch OUT.json [--rows 1,4] [--layers 8]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import torch
import triton
import triton.language as tl

from bench.graphs import graph_ms

CHUNK = 64 << 10
LANES = 32


@triton.jit
def _l2_prefetch_kernel(w_ptr, nbytes, CHUNK: tl.constexpr, LANES: tl.constexpr):
    """``w_ptr``: the weight's bytes (uint8); lane j of program i asks for bytes
    [(i * LANES + j) * CHUNK, +CHUNK) clipped to ``nbytes`` (a multiple of 16)."""
    lane = tl.program_id(0).to(tl.int64) * LANES + tl.arange(0, LANES)
    start = lane * CHUNK
    size = tl.minimum(nbytes - start, CHUNK).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [w_ptr + start, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _l2_prefetch_lines_kernel(w_ptr, nbytes, LINES: tl.constexpr):
    """The same with one ``prefetch.global.L2`` a 128-byte line (for comparison)."""
    line = tl.program_id(0).to(tl.int64) * LINES + tl.arange(0, LINES)
    start = line * 128
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.lt.s64 p, $2, $3; @p prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0; }",
        "=r,l,l,l", [w_ptr + start, start, nbytes + tl.zeros_like(start)], dtype=tl.int32, is_pure=False, pack=1)


def prefetch_bytes(weight: torch.Tensor, limit: int) -> int:
    """How many of ``weight``'s bytes a prefetch asks for: at most ``limit``, whole 16-byte units."""
    return min(weight.numel() * weight.element_size(), limit) // 16 * 16


def launch(weight: torch.Tensor, limit: int, lines: bool = False) -> None:
    """Ask for the first ``prefetch_bytes(weight, limit)`` bytes of ``weight`` (contiguous)."""
    n = prefetch_bytes(weight, limit)
    if n <= 0:
        return
    if not weight.is_contiguous():
        raise ValueError("l2_prefetch needs a contiguous weight")
    flat = weight.view(-1).view(torch.uint8)
    if lines:
        _l2_prefetch_lines_kernel[(triton.cdiv(n, 128 * 1024),)](flat, n, LINES=1024, num_warps=8)
    else:
        _l2_prefetch_kernel[(triton.cdiv(n, CHUNK * LANES),)](flat, n, CHUNK=CHUNK, LANES=LANES, num_warps=1)


# (name, (N, K), small kernels after it before the next GEMM)
LAYERS = {
    "8b": [("qkv", (6144, 4096), 5), ("o", (4096, 4096), 1), ("gate_up", (28672, 4096), 1), ("down", (4096, 14336), 2)],
    "9b-gdn": [("in", (12352, 4096), 6), ("out", (4096, 4096), 1), ("gate_up", (24576, 4096), 1),
               ("down", (4096, 12288), 2)],
}
MB = 1 << 20
VARIANTS = {"off": None, "bulk-8": (8 * MB, False), "bulk-16": (16 * MB, False), "bulk-24": (24 * MB, False),
            "bulk-40": (40 * MB, False), "lines-16": (16 * MB, True)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--rows", default="1,4")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--shapes", default=",".join(LAYERS))
    a = p.parse_args(argv)
    dev = torch.device("cuda")
    meta = {"machine": platform.node(), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "python": sys.version.split()[0], "dtype": "bfloat16",
            "layers_per_graph": a.layers, "variants": {k: v and {"limit_bytes": v[0], "lines": v[1]}
                                                        for k, v in VARIANTS.items()},
            "timing": "CUDA graph of LAYERS layers, median of 10 replays, per layer",
            "command": "python -m bench.l2_prefetch " + " ".join(sys.argv[1:] if argv is None else argv)}
    results: dict = {}
    t0 = time.monotonic()
    for shape in a.shapes.split(","):
        spec = LAYERS[shape]
        g = torch.Generator(device=dev).manual_seed(0)
        ws = [[torch.randn(nk, generator=g, device=dev, dtype=torch.bfloat16) * nk[1] ** -0.5 for _, nk, _ in spec]
              for _ in range(a.layers)]
        flat = [w for layer in ws for w in layer]
        gaps = [n for _, _, n in spec] * a.layers
        small = torch.zeros(4096, device=dev, dtype=torch.bfloat16)
        for rows in [int(r) for r in a.rows.split(",")]:
            xs = {k: torch.randn((rows, k), generator=g, device=dev, dtype=torch.bfloat16) * 0.1
                  for k in {nk[1] for _, nk, _ in spec}}
            outs = [torch.empty((rows, w.shape[0]), device=dev, dtype=torch.bfloat16) for w in flat]

            def chain(variant, gemms=True, kernels=True):
                for i, w in enumerate(flat):
                    if gemms:
                        torch.mm(xs[w.shape[1]], w.t(), out=outs[i])
                    if variant is not None and i + 1 < len(flat):
                        launch(flat[i + 1], variant[0], lines=variant[1])
                    if kernels:
                        for _ in range(gaps[i]):
                            small.add_(1)

            entry = {"weight_mb_per_layer": sum(w.numel() * 2 for w in ws[0]) / 1e6, "ms_per_layer": {}}
            chain(None)
            ref = [o.clone() for o in outs]
            for name, variant in VARIANTS.items():
                entry["ms_per_layer"][name] = graph_ms(lambda v=variant: chain(v), a.layers)
                if not all(torch.equal(o, r) for o, r in zip(outs, ref)):
                    entry.setdefault("mismatch", []).append(name)
            entry["ms_per_layer"]["gemms_only"] = graph_ms(lambda: chain(None, kernels=False), a.layers)
            entry["ms_per_layer"]["kernels_only"] = graph_ms(lambda: chain(None, gemms=False), a.layers)
            entry["ms_per_layer"]["prefetch_only_bulk-16"] = graph_ms(
                lambda: chain(VARIANTS["bulk-16"], gemms=False, kernels=False), a.layers)
            # the layer's bytes at the copy bandwidth of this device (measured here)
            big = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
            big2 = torch.empty_like(big)
            copy_ms = graph_ms(lambda: big2.copy_(big), 1)
            entry["copy_TBps"] = 2 * big.numel() / (copy_ms / 1e3) / 1e12
            entry["roofline_ms_per_layer"] = entry["weight_mb_per_layer"] * 1e6 / (entry["copy_TBps"] * 1e12) * 1e3
            big = big2 = None
            results[f"{shape}@{rows}"] = entry
            print(f"{shape}@{rows}: " + ", ".join(f"{k} {v * 1e3:.1f} us" for k, v in entry["ms_per_layer"].items())
                  + f"; roofline {entry['roofline_ms_per_layer'] * 1e3:.1f} us ({time.monotonic() - t0:.0f} s)",
                  flush=True)
            json.dump({"meta": meta, "results": results}, open(a.out, "w"), indent=1)
        ws = flat = None  # free the weights before the next shape
    return 0


if __name__ == "__main__":
    sys.exit(main())
