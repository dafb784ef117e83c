"""Decode-step GEMMs: cuBLAS against the unsplit Triton GEMM at step row counts (CUDA only).

A decode step's linear layers see 1-4 rows (a verify step B x (D + 1)). The H200 timeline
of the 8B and 9B-hybrid shapes shows cuBLAS streaming their weights at 2.4-3.8 TB/s and
adding 64 split-K reduce kernels a step. ``flare-prepare --step-gemms measure`` times, per
layer shape and row count, cuBLAS (``F.linear``) against ``kernels/gemm.py``'s unsplit
GEMM at each of ``STEP_TILINGS`` (and, for the rows each takes, ``kernels/gemv.py``'s GEMV at
each of ``STEP_GEMV_TILINGS``, named ``gemv-...`` here) and takes the fastest where it is at least
3 % faster.
This script records the same measurement for the per-layer shapes of Llama-3.1-8B and
Qwen3.5-9B (bfloat16, random data; GPU time by CUDA events, median of 20, launch
included; each call reads the next of several weight copies, past the L2 cache, as a decode
step streams its weights), with the bandwidth each reaches streaming the weight.

    python -m bench.step_gemms OUT.json
"""

from __future__ import annotations

import json
import platform
import sys

import torch
import triton

from flare.prepare.kernels import gemm
from flare.prepare.kernels.gemv import GemvTiling

# (N, K) of each weight: 8B dense (Llama-3.1-8B) and the 9B hybrid (Qwen3.5-9B).
SHAPES = {"8b-qkv": (6144, 4096), "8b-o": (4096, 4096), "8b-gate_up": (28672, 4096), "8b-down": (4096, 14336),
          "9b-gdn-in": (12352, 4096), "9b-gdn-out": (4096, 4096), "9b-attn-qkv": (10240, 4096),
          "9b-gate_up": (24576, 4096), "9b-down": (4096, 12288)}
ROWS = (1, 2, 4, 8, 24)


def _label(t) -> str:
    if t == "cublas":
        return t
    return ("gemv-" if isinstance(t, GemvTiling) else "") + "x".join(map(str, t))


def main(out: str) -> None:
    dev = torch.device("cuda")
    results = {}
    for name, (n, k) in SHAPES.items():
        w = torch.empty((n, k), device=dev, dtype=torch.bfloat16)
        mb = w.numel() * w.element_size() / 1e6
        for rows in ROWS:
            chosen, times = gemm.step_tiling(w, None, rows)
            entry = {"weight_mb": mb, "chosen": list(chosen) if chosen else None,
                     "ms": {_label(t): v for t, v in times.items()}}
            entry["gb_per_s"] = {t: mb / 1e3 / v for t, v in entry["ms"].items()}
            best = min((v for t, v in entry["ms"].items() if t != "cublas"))
            entry["triton_over_cublas"] = best / entry["ms"]["cublas"]
            results[f"{name}@{rows}"] = entry
            print(name, rows, {t: round(v, 1) for t, v in entry["gb_per_s"].items()}, "chosen", chosen, flush=True)
        del w
    meta = {"machine": platform.node(), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "python": sys.version.split()[0], "tilings": [list(t) for t in
                                                                                      gemm.STEP_TILINGS],
            "gemv_tilings": [list(t) for t in gemm.STEP_GEMV_TILINGS],
            "rows": list(ROWS), "dtype": "bfloat16", "timing": "CUDA events, median of 20 after 2 warm-ups",
            "rotation": f"weight copies of at least {gemm.ROTATE_BYTES >> 20} MiB together, one per call (past L2)"}
    json.dump({"meta": meta, "results": results}, open(out, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
