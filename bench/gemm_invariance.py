"""Is a GEMM row's result the same whatever the number of rows? (CUDA only)

Prefill programs of different capacities run the same linear layers at different row
counts M; a prompt's row must get the same bits in each for the prefix cache's cache-on
and cache-off runs to agree (tests/gpu/test_generation.py, ``NOT_YET_EXACT``). For each
(K, N) below: x [2048, K] and W [N, K] random in bfloat16; the reference is ``F.linear``
at M = 2048; each M compares the first M rows bit for bit, for cuBLAS (``F.linear``) and
for Triton GEMMs that sum the whole of K in order in one program
(``kernels/gemm.py``'s ``nonsplit_kernel``) at several tilings (BM, BN, BK, warps, stages),
whose rows are also compared with the unsplit reference's (``gemm.tiles``' tiling at M = 2048).
Times: microseconds a product as preparation times its choices (``gemm._rotation``: inside a CUDA
graph of 20 or more, each product on the next of several weight copies, more than the L2 together,
so a weight is streamed from memory as a program streams it).

    python -m bench.gemm_invariance OUT.json [--shapes 8b-down,8b-o] [--rows 16,64,256,2048]
"""

from __future__ import annotations

import argparse
import json
import platform

import torch
import triton
from torch.nn import functional as F
from triton.runtime.errors import OutOfResources

from flare.prepare.kernels import gemm

SHAPES = {"moe-qkv": (2048, 5120), "moe-o": (4096, 2048), "8b-qkv": (4096, 6144), "8b-o": (4096, 4096),
          "8b-gateup": (4096, 28672), "8b-down": (14336, 4096), "smol-qkv": (576, 960), "smol-gateup": (576, 3072),
          "smol-down": (1536, 576), "q35-qkv": (4096, 12288)}
ROWS = (16, 32, 64, 128, 256, 512, 1024, 2048)
# (BM, BN, BK, warps, stages): the tilings preparation times for prompt rows (--prompt-gemms measure),
# gemm.tiles' two first.
TILES = gemm.PROMPT_TILINGS


def nonsplit(x: torch.Tensor, w: torch.Tensor, tiling: tuple[int, ...]) -> torch.Tensor:
    out = torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype, device=x.device)
    gemm.launch(x, w, None, out, tiling)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--rows", default=",".join(map(str, ROWS)))
    a = ap.parse_args()
    rows = [int(r) for r in a.rows.split(",")]
    torch.manual_seed(0)
    results = {}
    for name in a.shapes.split(","):
        k, n = SHAPES[name]
        top = max(rows)
        x = torch.randn(top, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        rotating, timer = gemm._rotation(w)  # (preparation's timing: its graph, its weight copies)

        def micros(fn) -> float:
            return round(timer(rotating(fn)) * 1000, 1)

        ref_cublas = F.linear(x, w)
        ref = nonsplit(x, w, gemm.tiles(top, k))
        r = {"cublas": {m: [bool(torch.equal(F.linear(x[:m], w), ref_cublas[:m])),
                            micros(lambda w, m=m: F.linear(x[:m], w))] for m in rows}}
        for tile in TILES:
            try:
                r[str(tile)] = {m: [bool(torch.equal(nonsplit(x[:m], w, tile), ref[:m])),
                                    micros(lambda w, m=m, tile=tile: nonsplit(x[:m], w, tile))] for m in rows}
            except OutOfResources as e:
                print(name, tile, "does not run here:", e, flush=True)
        # (None where no tiling's rows equal the reference's: what this benchmark is there to catch)
        best = {m: min((t for t in r if t != "cublas" and r[t][m][0]), key=lambda t: r[t][m][1], default=None)
                for m in rows}
        results[name] = {"K_N": [k, n], "rows_equal_and_us": r,
                         "best_nonsplit": {m: best[m] and [best[m], r[best[m]][m][1]] for m in rows},
                         "default_nonsplit": {m: r.get(str((*gemm.tiles(m, k), 3)), {}).get(m, [None, None])[1]
                                              for m in rows}}
        print(name, "cublas", {m: r["cublas"][m] for m in rows}, "best", results[name]["best_nonsplit"],
              "default", results[name]["default_nonsplit"],
              "all equal", all(v[0] for t, rr in r.items() if t != "cublas" for v in rr.values()), flush=True)
    run = {"machine": f"{torch.cuda.get_device_name()} ({platform.node()})",
           "versions": {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version()},
           "columns": "[rows equal to the reference's (cuBLAS: F.linear at the largest M; Triton: gemm.tiles' "
                      "unsplit GEMM at the largest M), µs a product in a CUDA graph]"}
    with open(a.out, "w") as f:
        json.dump({"_run": run, "shapes": results}, f, indent=1)


if __name__ == "__main__":
    main()
