"""Is a GEMM row's result the same whatever the number of rows? (CUDA only)

Prefill programs of different capacities run the same linear layers at different row
counts M; a prompt's row must get the same bits in each for the prefix cache's cache-on
and cache-off runs to agree (tests/gpu/test_generation.py, ``NOT_YET_EXACT``). For each
(K, N) below: x [2048, K] and W [N, K] random in bfloat16; the reference is ``F.linear``
at M = 2048; each M compares the first M rows bit for bit, for cuBLAS (``F.linear``) and
for Triton GEMMs that sum the whole of K in order in one program
(``kernels/gemm.py``'s ``nonsplit_kernel``) at several tilings. Times are eager
(launch overhead included), microseconds, mean of 20.

    python -m bench.gemm_invariance OUT.json
"""

from __future__ import annotations

import json
import platform
import sys

import torch
import triton
from torch.nn import functional as F

from flare.prepare.kernels import gemm

SHAPES = {"moe-qkv": (2048, 5120), "moe-o": (4096, 2048), "8b-qkv": (4096, 6144), "8b-o": (4096, 4096),
          "8b-gateup": (4096, 28672), "8b-down": (14336, 4096), "smol-qkv": (576, 960), "smol-gateup": (576, 3072),
          "smol-down": (1536, 576), "q35-qkv": (4096, 12288)}
ROWS = (16, 32, 64, 128, 256, 512, 1024)
TILES = ((16, 32, 64, 4), (16, 64, 128, 4), (32, 64, 64, 4), (64, 64, 64, 4), (64, 128, 64, 4), (128, 128, 64, 8))


def nonsplit(x: torch.Tensor, w: torch.Tensor, bm: int, bn: int, bk: int, warps: int) -> torch.Tensor:
    out = torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype, device=x.device)
    gemm.launch(x, w, None, out, (bm, bn, bk, warps))
    return out


def micros(fn, n: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return round(start.elapsed_time(end) / n * 1000, 1)


def main(out: str) -> None:
    torch.manual_seed(0)
    results = {}
    for name, (k, n) in SHAPES.items():
        x = torch.randn(2048, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        ref = F.linear(x, w)
        r = {"cublas": {m: [bool(torch.equal(F.linear(x[:m], w), ref[:m])), micros(lambda: F.linear(x[:m], w))]
                        for m in (*ROWS, 2048)}}
        for tile in TILES:
            r[str(tile)] = {m: [bool(torch.equal(nonsplit(x[:m], w, *tile), ref[:m])),
                                micros(lambda: nonsplit(x[:m], w, *tile))] for m in (16, 256, 2048)}
        results[name] = {"K_N": [k, n], "rows_equal_and_us": r}
        print(name, json.dumps(r), flush=True)
    run = {"machine": f"{torch.cuda.get_device_name()} ({platform.node()})",
           "versions": {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version()},
           "columns": "[rows equal to M=2048's, microseconds]"}
    with open(out, "w") as f:
        json.dump({"_run": run, "shapes": results}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
