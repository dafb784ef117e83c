"""The decode step's mixture-of-experts launches with and without programmatic dependent launch,
inside CUDA graphs (CUDA, compute capability 9.0 or later).

A decode layer of a MoE model ends in three launches of this project's Triton (``recipes/moe.py``):
the router GEMV, which takes the layer's add and post-attention norm in its loads and routes each
token in its last program; the experts' gate/up GEMVs; the down GEMVs, which sum a token's pairs
and add the residual. Each pays its launch and the ramp of its first loads after the one before
has drained. With ``pdl`` (``kernels/moe.py``) each is launched dependent: its programs may be
resident while the launch before runs, wait for it in the kernel (``griddepcontrol.wait``), and
the down launch loads its first weight tiles before that wait.

This chains LAYERS layers of distinct weights (past the L2 cache), each as a decode step runs it:
a cuBLAS GEMM standing for the attention's o_proj (a launch that is not dependent, as the
compiled attention's last GEMV is not), then the router and the two expert launches; the
output of each layer is the next one's residual. Per geometry and token count: µs a layer
with ``pdl`` off and on (median of graph replays), and whether the two give the same bits.

    python -m bench.moe_pdl OUT.json [--tokens 1,4] [--layers 8] [--geometries qwen3-30b-a3b,qwen3_5-35b-a3b]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import torch
import triton
from torch.nn import functional as F

from bench import graphs
from flare.prepare.kernels import moe as K
from flare.prepare.kernels.gemv import Norm

# name: (experts E, top k, hidden H, expert intermediate I, shared expert's intermediate or 0, attention width)
GEOMETRIES = {
    "qwen3-30b-a3b": (128, 8, 2048, 768, 0, 4096),
    "qwen3_5-35b-a3b": (256, 8, 2048, 512, 512, 4096),
    "qwen3-next-80b-a3b": (512, 10, 2048, 512, 512, 4096),
}


def layer_weights(geo, layers: int, dev, g) -> list[dict]:
    E, k, H, I, I_s, A = geo
    bf = torch.bfloat16
    out = []
    for _ in range(layers):
        w = {"o": torch.randn(H, A, generator=g, device=dev, dtype=bf) * A ** -0.5,
             "router": torch.randn(E, H, generator=g, device=dev, dtype=bf) * H ** -0.5,
             "gate_up": torch.randn(E, 2 * I, H, generator=g, device=dev, dtype=bf) * H ** -0.5,
             "down": torch.randn(E, H, I, generator=g, device=dev, dtype=bf) * I ** -0.5,
             "norm": 1 + 0.1 * torch.randn(H, generator=g, device=dev, dtype=bf)}
        if I_s:
            w["s_gate"] = torch.randn(1, H, generator=g, device=dev, dtype=bf) * H ** -0.5
            w["s_gate_up"] = torch.randn(2 * I_s, H, generator=g, device=dev, dtype=bf) * H ** -0.5
            w["s_down"] = torch.randn(H, I_s, generator=g, device=dev, dtype=bf) * I_s ** -0.5
        out.append(w)
    return out


def chain(geo, weights, attn, h0, tickets, pdl: bool):
    """The layers' o_proj stand-in, router and experts, as ``recipes/moe._routed`` runs a decode step."""
    E, k, H, I, I_s, A = geo
    h = h0
    for w in weights:
        o = F.linear(attn, w["o"])
        norm = Norm(w["norm"], 1e-6, False, residual=h)
        shared = w.get("s_gate")
        _, gate_logits, rw, ids, total = K.router_gemv(o, w["router"], shared, route=(k, True, None, tickets),
                                                       norm=norm, pdl=pdl)
        folded = (w["s_gate_up"], w["s_down"], gate_logits) if shared is not None else None
        h = K.experts_decode(total, rw, ids, w["gate_up"], w["down"], shared=folded, residual=total, norm=norm,
                             pdl=pdl)
    return h


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--tokens", default="1,4")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--geometries", default="qwen3-30b-a3b,qwen3_5-35b-a3b")
    p.add_argument("--replays", type=int, default=20)
    a = p.parse_args(argv)
    dev = torch.device("cuda")
    if not K.dependent_launch(dev):
        print("needs compiled Triton on a GPU of compute capability 9.0 or later", file=sys.stderr)
        return 2
    meta = {"machine": platform.node(), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "python": sys.version.split()[0], "dtype": "bfloat16",
            "layers": a.layers, "geometries": {n: GEOMETRIES[n] for n in a.geometries.split(",")},
            "geometry_fields": "(E, top k, H, I, shared I or 0, attention width)",
            "timing": f"one CUDA graph of LAYERS layers (o_proj GEMM on cuBLAS, router, gate/up, down), median of "
                      f"{a.replays} replays, per layer",
            "command": "python -m bench.moe_pdl " + " ".join(sys.argv[1:] if argv is None else argv)}
    results: dict = {}
    t0 = time.monotonic()
    for name in a.geometries.split(","):
        geo = GEOMETRIES[name]
        E, k, H, I, I_s, A = geo
        g = torch.Generator(device=dev).manual_seed(0)
        weights = layer_weights(geo, a.layers, dev, g)
        for T in [int(t) for t in a.tokens.split(",")]:
            attn = torch.randn(T, A, generator=g, device=dev, dtype=torch.bfloat16)
            h0 = torch.randn(T, H, generator=g, device=dev, dtype=torch.bfloat16)
            tickets = torch.zeros(T, dtype=torch.int32, device=dev)
            entry: dict = {"ms_per_layer": {}}
            finals = {}
            for pdl in (False, True, False, True):  # alternated: clocks and the L2 as alike as can be
                key = "pdl" if pdl else "plain"
                finals[key] = chain(geo, weights, attn, h0, tickets, pdl).clone()
                ms = graphs.graph_ms(lambda pdl=pdl: chain(geo, weights, attn, h0, tickets, pdl), a.layers,
                                     replays=a.replays)
                entry["ms_per_layer"].setdefault(key, []).append(ms)
            entry["bitwise"] = bool(torch.equal(finals["plain"], finals["pdl"]))
            best = {kk: min(v) for kk, v in entry["ms_per_layer"].items()}
            entry["best_us_per_layer"] = {kk: v * 1e3 for kk, v in best.items()}
            entry["saved_us_per_layer"] = (best["plain"] - best["pdl"]) * 1e3
            results[f"{name}[T{T}]"] = entry
            print(f"{name} T={T}: plain {best['plain'] * 1e3:.2f} us, pdl {best['pdl'] * 1e3:.2f} us a layer; "
                  f"bitwise {entry['bitwise']} ({time.monotonic() - t0:.0f} s)", flush=True)
            json.dump({"meta": meta, "results": results}, open(a.out, "w"), indent=1)
        weights = None  # (freed before the next geometry)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
