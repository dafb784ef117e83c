"""Programmatic dependent launch (PDL) for decode-step GEMVs, measured inside CUDA graphs (CUDA only).

A decode step at one row is a chain of weight-streaming GEMMs with small kernels between them
(norms, activations, the recurrence): every boundary costs a drain of the previous kernel and a
ramp of the next while the memory system idles. With PDL (SM90) a kernel launched with the
programmatic-serialization attribute may start while its predecessor still runs: its programs
issue their weight loads (which depend on nothing earlier) and only then wait
(``griddepcontrol.wait``) for the predecessor's output. Graph capture keeps the relation as a
programmatic edge, which the export records with the edge's type.

This measures the 9B hybrid shape's GDN layer (in_proj 12,352 x 4,096, out_proj 4,096 x 4,096,
gate_up 24,576 x 4,096, down 4,096 x 12,288) with a small elementwise kernel after every GEMM,
the activation flowing from each kernel into the next, over rotating layers' weights (past the
L2 cache), per layer:

* ``cublas``: ``F.linear`` and the elementwise kernel;
* ``gemv``: the GEMV below without PDL;
* ``gemv_pdl``: the GEMV launched with PDL (weights loaded before the wait), the elementwise
  kernels without;
* ``all_pdl``: the elementwise kernels too (they wait first, then let their dependents launch).

    python -m bench.pdl OUT.json [--rows 1,4] [--layers 8]
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
from torch.nn import functional as F

from bench import graphs

from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

LAYER = {"in_proj": (12352, 4096), "out_proj": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
# (BN, BK, warps) swept per weight
TILINGS = [(4, 2048, 4), (2, 4096, 8), (8, 2048, 8), (4, 4096, 8), (8, 1024, 4)]


@triton.jit
def gemv_pdl_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr):
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    m = tl.arange(0, BM)
    n_in, m_in = n < N, m < M
    if PDL:
        gdc_launch_dependents()
    kk = tl.arange(0, BK)
    w_rows = w_ptr + n[:, None].to(tl.int64) * stride_wn
    w = tl.load(w_rows + kk[None, :], mask=n_in[:, None] & (kk < K)[None, :], other=0.0)
    if PDL:
        gdc_wait()
    x = tl.load(x_ptr + m[:, None] * stride_xm + kk[None, :], mask=m_in[:, None] & (kk < K)[None, :], other=0.0)
    lanes = x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    for k0 in range(BK, K, BK):
        k = k0 + kk
        w = tl.load(w_rows + k[None, :], mask=n_in[:, None] & (k < K)[None, :], other=0.0)
        x = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :], mask=m_in[:, None] & (k < K)[None, :], other=0.0)
        lanes += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    acc = tl.sum(lanes, axis=2)
    tl.store(out_ptr + m[:, None] * stride_om + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_in[:, None] & n_in[None, :])


@triton.jit
def ew_kernel(in_ptr, out_ptr, n, stride_in, stride_out, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """out[m, :n] = in[m, :n] * 0.5 + 0.25 (a stand-in for a norm or an activation)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    m = tl.program_id(1)
    j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(in_ptr + m * stride_in + j, mask=j < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_out + j, (v * 0.5 + 0.25).to(out_ptr.dtype.element_ty), mask=j < n)


def gemv(x, w, out, tiling, pdl):
    bn, bk, warps = tiling
    M, K = x.shape
    N = w.shape[0]
    gemv_pdl_kernel[(triton.cdiv(N, bn),)](x, w, out, M, N, K, x.stride(0), w.stride(0), out.stride(0),
                                           BM=triton.next_power_of_2(M), BN=bn, BK=min(bk, triton.next_power_of_2(K)),
                                           PDL=pdl, num_warps=warps, num_stages=1, launch_pdl=pdl)


def ew(inp, out, n, pdl):
    ew_kernel[(triton.cdiv(n, 1024), inp.shape[0])](inp, out, n, inp.stride(0), out.stride(0), BLOCK=1024,
                                                     PDL=pdl, num_warps=4, launch_pdl=pdl)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--rows", default="1,4")
    p.add_argument("--layers", type=int, default=8)
    a = p.parse_args(argv)
    dev = torch.device("cuda")
    meta = {"machine": platform.node(), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "python": sys.version.split()[0], "dtype": "bfloat16",
            "layers": a.layers, "layer": LAYER, "tilings": "(BN, BK, warps)",
            "timing": "one CUDA graph of LAYERS layers (4 GEMMs, 4 elementwise kernels each), median of 10 replays, "
                      "per layer",
            "command": "python -m bench.pdl " + " ".join(sys.argv[1:] if argv is None else argv)}
    g = torch.Generator(device=dev).manual_seed(0)
    weights = [{k: torch.randn(s, generator=g, device=dev, dtype=torch.bfloat16) * s[1] ** -0.5
                for k, s in LAYER.items()} for _ in range(a.layers)]
    bytes_layer = sum(n * k * 2 for n, k in LAYER.values())
    results: dict = {"bytes_per_layer": bytes_layer}
    t0 = time.monotonic()
    for rows in [int(r) for r in a.rows.split(",")]:
        h = torch.randn((rows, 4096), generator=g, device=dev, dtype=torch.bfloat16)
        outs = {k: torch.empty((rows, n), device=dev, dtype=torch.bfloat16) for k, (n, _) in LAYER.items()}
        # the activation after each GEMM, as wide as the next GEMM's input
        acts = {k: torch.empty((rows, n), device=dev, dtype=torch.bfloat16)
                for k, n in (("in_proj", 4096), ("out_proj", 4096), ("gate_up", 12288), ("down", 4096))}
        # the activation each GEMM reads: h -> in_proj -> [4096] -> out_proj -> [4096] -> gate_up -> [12288] -> down
        chain = [("in_proj", h, acts["in_proj"], 4096), ("out_proj", acts["in_proj"], acts["out_proj"], 4096),
                 ("gate_up", acts["out_proj"], acts["gate_up"], 12288), ("down", acts["gate_up"], acts["down"], 4096)]
        entry: dict = {"best_tiling": {}, "ms_per_layer": {}, "errors": {}}
        # each weight's tiling: the fastest alone (a chain of that GEMM over the layers, no PDL)
        for name, (n, k) in LAYER.items():
            x = torch.randn((rows, k), generator=g, device=dev, dtype=torch.bfloat16)
            ref = F.linear(x, weights[0][name])
            best = None
            for t in TILINGS:
                try:
                    gemv(x, weights[0][name], outs[name], t, False)
                    if not torch.allclose(outs[name].float(), ref.float(), rtol=2e-2, atol=2e-2):
                        entry["errors"][f"{name}:{t}"] = "mismatch"
                        continue
                    ms = graphs.graph_ms(lambda t=t: [gemv(x, w[name], outs[name], t, False) for w in weights],
                                         a.layers)
                except Exception as e:  # a tiling that does not compile or launch here
                    entry["errors"][f"{name}:{t}"] = f"{type(e).__name__}: {str(e)[:160]}"
                    continue
                if best is None or ms < best[1]:
                    best = (t, ms)
            entry["best_tiling"][name] = {"tiling": best[0], "ms": best[1]}
        tiling = {k: v["tiling"] for k, v in entry["best_tiling"].items()}

        def layer_step(kind):
            def run():
                for w in weights:
                    for name, x, act, n in chain:
                        if kind == "cublas":
                            torch.mm(x, w[name].t(), out=outs[name])
                        else:
                            gemv(x, w[name], outs[name], tiling[name], kind != "gemv")
                        ew(outs[name], act, n, kind == "all_pdl")
            return run

        finals = {}
        for kind in ("cublas", "gemv", "gemv_pdl", "all_pdl"):
            step = layer_step(kind)
            step()
            finals[kind] = acts["down"].float().clone()
            entry["ms_per_layer"][kind] = graphs.graph_ms(step, a.layers)
        ref = finals["cublas"]
        entry["max_diff_vs_cublas"] = {k: float((v - ref).abs().max()) for k, v in finals.items()}
        entry["pdl_bitwise_vs_gemv"] = bool(torch.equal(finals["gemv"], finals["gemv_pdl"])
                                            and torch.equal(finals["gemv"], finals["all_pdl"]))
        entry["tb_per_s"] = {k: bytes_layer / 1e12 / (v / 1e3) for k, v in entry["ms_per_layer"].items()}
        results[f"rows{rows}"] = entry
        print(f"rows {rows}: " + ", ".join(f"{k} {v * 1e3:.1f} us ({entry['tb_per_s'][k]:.2f} TB/s)"
                                           for k, v in entry["ms_per_layer"].items())
              + f"; bitwise {entry['pdl_bitwise_vs_gemv']} ({time.monotonic() - t0:.0f} s)", flush=True)
        json.dump({"meta": meta, "results": results}, open(a.out, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
