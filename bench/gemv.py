"""Decode-step GEMMs inside CUDA graphs: cuBLAS (``F.linear``) against the few-row GEMM of
``kernels/gemv.py`` at a sweep of tilings (CUDA only).

For each weight shape of the 8B dense, 9B hybrid and A3B MoE layers and each row count, one CUDA
graph holds ``CALLS`` products over rotating weight copies (at least 256 MiB together, past
the L2 cache, as a decode step streams its weights); the graph's replay time over CALLS is
the time per product, launches included as a program's graph pays them. cuBLAS's split-K
reduce kernels are inside its time. Each tiling's output is checked against cuBLAS's
(bfloat16 rounding) before it is timed. The JSON is rewritten after every shape, so a run
cut short keeps what it measured.

    python -m bench.gemv OUT.json [--rows 1,4] [--shapes 8b-o,8b-down,...] [--only dot] [--folds] [--glu] [--conv] [--norm]

``--only dot`` (or ``rowloop``, ``defer``) times that variant's tilings alone; ``--folds`` also
times, for the down projections (``FOLD_SHAPES``), the product as a decoder layer needs it:
``residual + (silu(gate) * up) @ w.T`` from [gate | up] rows, by cuBLAS with the activation
and the add as two elementwise kernels (a multiply stands in for the compiled activation
kernel: the same bytes, one launch), by each tiling with both folded, and by each ``dot``
tiling with the residual folded and the activation apart (the recipe's choice for it).
``--glu`` also times, for the [gate; up] projections (``GLU_SHAPES``), the activation as the
down projection of a ``dot`` GEMV needs it: cuBLAS's product then the activation (a multiply of
the halves standing in for it, as above), against each ``dot`` tiling without a split with the
activation in its epilogue (``gemv(..., glu=True)``).
``--conv`` also times, for the Gated DeltaNet input projections (``CONV_SHAPES``: q|k|v, the
convolution's channels, first), what a decode step needs of it: the projection, then the
convolution step over its q|k|v (``gdn.conv1d_decode_step``, 4 taps, each row its own history
row), by cuBLAS and by each ``dot`` tiling without a split, against each such tiling with the
convolution in its epilogue (``gemv(..., conv=)``), after checking that the fold gives the outputs
and histories of the two launches bit for bit (``...-conv-same-bits``).
``--norm`` also times, for the [gate; up] projections, the decoder layer's add and norm before
them with the activation after: the add-and-norm kernel then each ``dot`` GLU tiling, against the
tiling with the add and the norm in its loads (``gemv(..., norm=)``); for the projections after a
decoder layer's input norm (``NORM_SHAPES``), the norm's kernel then each ``dot`` tiling without a
split against the tiling with the norm in its loads.
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
from flare.prepare.kernels import gemv as G

SHAPES = {"8b-qkv": (6144, 4096), "8b-o": (4096, 4096), "8b-gate_up": (28672, 4096), "8b-down": (4096, 14336),
          "9b-gdn-in": (12352, 4096), "9b-attn-qkv": (10240, 4096), "9b-gate_up": (24576, 4096),
          "9b-down": (4096, 12288),
          # the A3B MoE shapes' dense weights (hidden 2,048): Qwen3.5-35B-A3B's fused Gated
          # DeltaNet in_proj and gated attention q/k/v, Qwen3-30B-A3B's q/k/v, and the 4,096 -> 2,048
          # out_proj / o_proj both have
          "35b-gdn-in": (12352, 2048), "35b-attn-qkv": (9216, 2048), "30b-qkv": (5120, 2048),
          "a3b-o": (2048, 4096)}
FOLD_SHAPES = ("8b-down", "9b-down")
GLU_SHAPES = ("8b-gate_up", "9b-gate_up")
CONV_SHAPES = {"9b-gdn-in": 8192, "35b-gdn-in": 8192}  # (the convolution's channels: q|k|v)
# the projections after a decoder layer's input norm (``--norm``), with the norm's form (zero-centred:
# Qwen3.5's; Llama's and Qwen3's scale by the weight itself)
NORM_SHAPES = {"8b-qkv": False, "9b-gdn-in": True, "9b-attn-qkv": True, "35b-gdn-in": True, "35b-attn-qkv": True,
               "30b-qkv": False}
CONV_WIDTH = 4
VARIANTS = {"defer": 5, "rowloop": 6, "dot": 7}
# (BN, BK, SPLIT, warps, stages[, defer[, rowloop[, dot]]]): the first version's best (reduced at every step),
# then lanes kept through the loop (defer), narrow and long, then whole-K steps
TILINGS = [(8, 512, 1, 4, 3), (4, 1024, 1, 4, 3),
           (8, 512, 1, 4, 3, 1), (8, 512, 1, 8, 3, 1), (4, 1024, 1, 4, 3, 1), (4, 1024, 1, 8, 4, 1),
           (8, 1024, 1, 8, 3, 1), (2, 2048, 1, 4, 3, 1), (16, 256, 1, 8, 3, 1), (8, 256, 1, 4, 4, 1),
           (16, 512, 1, 8, 3, 1), (32, 256, 1, 8, 3, 1), (32, 512, 1, 8, 2, 1),
           (8, 512, 2, 4, 3, 1), (16, 512, 4, 8, 3, 1),
           # one or two steps over the whole of K: every load of a program in flight at once
           # (vectorised 16-byte loads when launched, 40-80 registers at
           # one row, 56-160 at four, no spills, by ptxas for sm_90a)
           (1, 4096, 1, 4, 1), (2, 4096, 1, 8, 1), (2, 2048, 1, 4, 1), (4, 2048, 1, 4, 1),
           (8, 2048, 1, 8, 1), (1, 8192, 1, 8, 1),
           # a row at a time against the weight tile (rowloop): [BN, BK] products at four rows too
           (8, 512, 1, 4, 1, 0, 1), (8, 1024, 1, 8, 1, 0, 1), (16, 512, 1, 8, 1, 0, 1), (4, 2048, 1, 8, 1, 0, 1),
           # one tensor-core tile of 16 rows whatever the rows (dot), the K loop pipelined (stages)
           (16, 128, 1, 4, 4, 0, 0, 1), (16, 256, 1, 4, 3, 0, 0, 1), (16, 256, 1, 4, 4, 0, 0, 1),
           (16, 512, 1, 4, 2, 0, 0, 1), (32, 128, 1, 4, 4, 0, 0, 1), (32, 256, 1, 4, 3, 0, 0, 1),
           (32, 256, 1, 8, 4, 0, 0, 1), (32, 512, 1, 8, 2, 0, 0, 1), (64, 128, 1, 4, 4, 0, 0, 1),
           (64, 256, 1, 8, 3, 0, 0, 1),
           # the same with K split, the slices added in order by a second launch (tickets=False,
           # as the programs run it: no counters)
           (16, 128, 4, 4, 4, 0, 0, 1), (32, 128, 2, 4, 4, 0, 0, 1), (32, 128, 4, 4, 4, 0, 0, 1),
           (32, 128, 8, 4, 4, 0, 0, 1), (32, 256, 4, 4, 3, 0, 0, 1), (64, 128, 4, 4, 4, 0, 0, 1)]
CALLS = 20
ROTATE_BYTES = 256 << 20


def graph_ms(calls) -> float:
    """Median over 10 replays of a CUDA graph of ``calls`` (after a warm-up outside it), per call."""
    return graphs.graph_ms(lambda: [c() for c in calls], len(calls))


def _folded(w, ws, rows: int, k: int, n: int, tilings, dev, g) -> dict:
    """ms of ``residual + (silu(gate) * up) @ w.T`` from [gate | up] rows (``--folds``)."""
    gu = torch.randn((rows, 2 * k), generator=g, device=dev, dtype=torch.bfloat16)
    r = torch.randn((rows, n), generator=g, device=dev, dtype=torch.bfloat16)
    out = torch.empty((rows, n), device=dev, dtype=torch.bfloat16)
    gate, up = gu[:, :k], gu[:, k:]
    act = torch.empty((rows, k), device=dev, dtype=torch.bfloat16)
    res = {"cublas+act+add": graph_ms([lambda i=i: torch.add(r, F.linear(torch.mul(gate, up, out=act), ws[i % len(ws)]))
                                       for i in range(CALLS)])}
    for t in tilings:
        dot = len(t) > 7 and bool(t[7])
        if (t[2] != 1 and not dot) or t[0] < 8:
            continue
        key = "x".join(map(str, t))
        space = G.workspace(rows, n, t[2], t[0], dev, dot=dot)
        try:
            if t[2] == 1:  # (the activation fold of a split tile: as costly as unsplit, not timed)
                res[key] = graph_ms([lambda i=i, t=t: G.gemv(gu, ws[i % len(ws)], out, t, space, swiglu=True,
                                                             residual=r, tickets=not dot) for i in range(CALLS)])
            if dot:
                res[key + "-act-apart"] = graph_ms([lambda i=i, t=t: G.gemv(torch.mul(gate, up, out=act), ws[i % len(ws)],
                                                                            out, t, space, residual=r, tickets=False)
                                                    for i in range(CALLS)])
        except Exception as e:  # noqa: BLE001 (a tiling that does not compile here)
            res[key] = f"{type(e).__name__}: {str(e)[:200]}"
    return res


def _glu(w, ws, x, n: int, tilings, dev) -> dict:
    """ms of ``silu(x @ gate.T) * (x @ up.T)`` over [gate; up] rows ``w`` (``--glu``)."""
    rows, half = x.shape[0], n // 2
    gu = torch.empty((rows, n), device=dev, dtype=torch.bfloat16)
    act = torch.empty((rows, half), device=dev, dtype=torch.bfloat16)
    out = torch.empty((rows, half), device=dev, dtype=torch.bfloat16)
    res = {"cublas+act": graph_ms([lambda i=i: torch.mul(F.linear(x, ws[i % len(ws)], out=gu)[:, :half], gu[:, half:],
                                                         out=act) for i in range(CALLS)])}
    for t in tilings:
        if not (len(t) > 7 and t[7]) or t[2] != 1:
            continue
        key = "x".join(map(str, t)) + "-glu"
        try:
            res[key] = graph_ms([lambda i=i, t=t: G.gemv(x, ws[i % len(ws)], out, t, glu=True) for i in range(CALLS)])
        except Exception as e:  # noqa: BLE001 (a tiling that does not compile here)
            res[key] = f"{type(e).__name__}: {str(e)[:200]}"
    return res


def _norm(ws, x, n: int, tilings, dev, g, glu: bool, zero_centred: bool = True) -> dict:
    """ms of the norm before a projection and the projection (``--norm``): with ``glu`` a decoder
    layer's add and post-attention norm and its MLP's [gate; up] GEMV with the activation in its
    epilogue, else a decoder layer's input norm and the q/k/v or input projection after it. The
    norm's kernel (``rownorm.rms_norm`` in ``zero_centred`` form or Llama's, with the add: one launch) then
    each ``dot`` tiling without a split, against each such tiling with the norm (and the add) in
    its loads (``gemv(..., norm=)``); the largest difference of the two orders' outputs, and
    whether the sums they write are the same bits, are recorded."""
    from flare.prepare.kernels.rownorm import rms_norm

    rows, k = x.shape
    nw = torch.randn(k, generator=g, device=dev, dtype=torch.bfloat16)
    r = torch.randn(x.shape, generator=g, device=dev, dtype=torch.bfloat16) if glu else None
    out = torch.empty((rows, n // 2 if glu else n), device=dev, dtype=torch.bfloat16)
    total = torch.empty_like(x) if glu else None
    res = {}
    for t in tilings:
        if not (len(t) > 7 and t[7]) or t[2] != 1:
            continue
        key = "x".join(map(str, t))
        try:
            normed, want_total = rms_norm(x, nw, 1e-6, zero_centred, residual=r)
            want = G.gemv(normed, ws[0], out, t, glu=glu).clone()
            got = G.gemv(x, ws[0], out, t, glu=glu, norm=G.Norm(nw, 1e-6, zero_centred, r, total)).clone()
            res[key + "-norm-max-diff"] = (got.float() - want.float()).abs().max().item()
            if glu:
                res[key + "-norm-same-total"] = bool(torch.equal(total, want_total))
            res[key + "+norm"] = graph_ms([lambda i=i, t=t: G.gemv(rms_norm(x, nw, 1e-6, zero_centred, residual=r)[0],
                                                                   ws[i % len(ws)], out, t, glu=glu)
                                          for i in range(CALLS)])
            res[key + "-norm"] = graph_ms([lambda i=i, t=t: G.gemv(x, ws[i % len(ws)], out, t, glu=glu,
                                                                   norm=G.Norm(nw, 1e-6, zero_centred, r, total))
                                          for i in range(CALLS)])
        except Exception as e:  # noqa: BLE001 (a tiling that does not compile here)
            res[key] = f"{type(e).__name__}: {str(e)[:200]}"
    return res


def _conv(ws, x, n: int, channels: int, tilings, dev, g) -> dict:
    """ms of a decode step's projection and convolution over its first ``channels`` outputs
    (``--conv``), apart and with the convolution in the GEMV's epilogue."""
    from flare.prepare.kernels.gdn import conv1d_decode_step

    rows = x.shape[0]
    state = torch.randn((rows, channels, CONV_WIDTH - 1), generator=g, device=dev, dtype=torch.bfloat16)
    weight = torch.randn((channels, CONV_WIDTH), generator=g, device=dev, dtype=torch.bfloat16)
    slots = torch.arange(rows, device=dev)
    live = torch.ones(rows, dtype=torch.bool, device=dev)
    proj = torch.empty((rows, n), device=dev, dtype=torch.bfloat16)
    conv_out = torch.empty((rows, channels), device=dev, dtype=torch.bfloat16)

    def conv():
        conv1d_decode_step(proj[:, :channels], state, weight, None, slots, live, out=conv_out)

    res = {"cublas+conv": graph_ms([lambda i=i: (F.linear(x, ws[i % len(ws)], out=proj), conv()) for i in range(CALLS)])}
    space = (proj, proj)  # (no split: no partial sums, no counters)
    fold = G.Conv(state, weight, None, slots, live)
    for t in tilings:
        if not (len(t) > 7 and t[7]) or t[2] != 1:
            continue
        key = "x".join(map(str, t))
        try:
            # The fold's bits first: its outputs and histories against the GEMV, then the kernel.
            before = state.clone()
            G.gemv(x, ws[0], proj, t, space)
            conv()
            want, want_state = torch.cat([conv_out, proj[:, channels:]], dim=1), state.clone()
            state.copy_(before)
            got = G.gemv(x, ws[0], proj, t, space, conv=fold).clone()
            res[key + "-conv-same-bits"] = bool(torch.equal(got, want) and torch.equal(state, want_state))
            res[key + "+conv"] = graph_ms([lambda i=i, t=t: (G.gemv(x, ws[i % len(ws)], proj, t, space), conv())
                                           for i in range(CALLS)])
            res[key + "-conv"] = graph_ms([lambda i=i, t=t: G.gemv(x, ws[i % len(ws)], proj, t, space, conv=fold)
                                           for i in range(CALLS)])
        except Exception as e:  # noqa: BLE001 (a tiling that does not compile here)
            res[key] = f"{type(e).__name__}: {str(e)[:200]}"
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--rows", default="1,4")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--only", choices=sorted(VARIANTS))
    p.add_argument("--folds", action="store_true")
    p.add_argument("--glu", action="store_true")
    p.add_argument("--conv", action="store_true")
    p.add_argument("--norm", action="store_true")
    a = p.parse_args(argv)
    tilings = [t for t in TILINGS if a.only is None or (len(t) > VARIANTS[a.only] and t[VARIANTS[a.only]])]
    dev = torch.device("cuda")
    rows_list = [int(r) for r in a.rows.split(",")]
    meta = {"machine": platform.node(), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "python": sys.version.split()[0], "dtype": "bfloat16",
            "calls_per_graph": CALLS, "rotation_bytes": ROTATE_BYTES,
            "tilings": "(BN, BK, SPLIT, warps, stages[, defer[, rowloop[, dot]]])",
            "timing": "CUDA graph of CALLS products over rotating weight copies, median of 10 replays, per product",
            "command": "python -m bench.gemv " + " ".join(sys.argv[1:] if argv is None else argv)}
    results: dict = {}
    t0 = time.monotonic()
    for name in a.shapes.split(","):
        n, k = SHAPES[name]
        g = torch.Generator(device=dev).manual_seed(0)
        w = torch.randn((n, k), generator=g, device=dev, dtype=torch.bfloat16) * k ** -0.5
        ws = [w] + [w.clone() for _ in range(-(-ROTATE_BYTES // (w.numel() * 2)) - 1)]
        mb = w.numel() * 2 / 1e6
        for rows in rows_list:
            x = torch.randn((rows, k), generator=g, device=dev, dtype=torch.bfloat16)
            out = torch.empty((rows, n), device=dev, dtype=torch.bfloat16)
            ref = F.linear(x, w)
            entry = {"weight_mb": mb, "ms": {}, "errors": {}}
            entry["ms"]["cublas"] = graph_ms([lambda i=i: F.linear(x, ws[i % len(ws)]) for i in range(CALLS)])
            for t in tilings:
                key = "x".join(map(str, t))
                bn, bk, split = t[:3]
                if not G.fills_slices(k, split, bk):
                    continue
                dot = len(t) > 7 and bool(t[7])
                try:
                    space = G.workspace(rows, n, split, bn, dev, dot=dot)
                    got = G.gemv(x, w, out, t, space, tickets=not dot).clone()
                    if not torch.allclose(got.float(), ref.float(), rtol=2e-2, atol=2e-2):
                        entry["errors"][key] = f"max diff {(got.float() - ref.float()).abs().max().item():.3g}"
                        continue
                    entry["ms"][key] = graph_ms([lambda i=i, t=t, space=space: G.gemv(x, ws[i % len(ws)], out, t, space,
                                                                                       tickets=not dot)
                                                 for i in range(CALLS)])
                except Exception as e:  # a tiling that does not compile or launch here
                    entry["errors"][key] = f"{type(e).__name__}: {str(e)[:200]}"
            if a.folds and name in FOLD_SHAPES:
                entry["folded_ms"] = _folded(w, ws, rows, k, n, tilings, dev, g)
            if a.glu and name in GLU_SHAPES:
                entry["glu_ms"] = _glu(w, ws, x, n, tilings, dev)
            if a.norm and name in GLU_SHAPES:
                entry["norm_glu_ms"] = _norm(ws, x, n, tilings, dev, g, glu=True)
            elif a.norm and name in NORM_SHAPES:
                entry["input_norm_ms"] = _norm(ws, x, n, tilings, dev, g, glu=False, zero_centred=NORM_SHAPES[name])
            if a.conv and name in CONV_SHAPES:
                entry["conv_ms"] = _conv(ws, x, n, CONV_SHAPES[name], tilings, dev, g)
            entry["tb_per_s"] = {t: mb / 1e6 / (v / 1e3) for t, v in entry["ms"].items()}
            best = min((t for t in entry["ms"] if t != "cublas"), key=entry["ms"].get, default=None)
            entry["best"] = best
            entry["best_over_cublas"] = entry["ms"][best] / entry["ms"]["cublas"] if best else None
            results[f"{name}@{rows}"] = entry
            print(f"{name}@{rows}: cublas {entry['tb_per_s']['cublas']:.2f} TB/s, best {best} "
                  f"{entry['tb_per_s'].get(best, 0):.2f} TB/s ({time.monotonic() - t0:.0f} s)", flush=True)
            json.dump({"meta": meta, "results": results}, open(a.out, "w"), indent=1)
        ws.clear()  # free the copies before the next shape
    return 0


if __name__ == "__main__":
    sys.exit(main())
