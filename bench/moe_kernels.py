"""Routed-expert kernels at Qwen3-30B-A3B's and Qwen3.5-35B-A3B's layer geometry: GPU time
per layer, capture, accuracy, and the active-bytes bandwidth.

usage: python bench/moe_kernels.py --out RESULT.json [--replays 100] [--budget-s 150] [--cases router.,ours.decode]
       python bench/moe_kernels.py --smoke --out /tmp/moe-smoke.json   (CPU, Triton interpreter, tiny, float32)

Per geometry and token count T (decode 1 and 4, prefill chunks of 128 and 2,048), the
router's choices come from random hidden rows and a random router (so the experts a
batch hits are as many as real routing would hit, not one), and each candidate computes
the routed experts' weighted sum for the chunk:

* ``ours[bm,bn,bk,w]``  kernels/moe.py's tiled path (prefill chunks): the invariant router GEMM,
  routing per token (``route_rows``) and the plan in two launches (``plan_triton``, as the recipe), grouped gate/up,
  grouped down, the weighted sum (``BLOCK_M`` 64, the recipe's, for prefill; 16 at decode sizes,
  against the GEMVs).
* ``ours.decode``  the decode path (at most ``DECODE_PAIRS`` pairs): router GEMV,
  ``route_rows``, a gate/up GEMV program per pair and feature block, and the down GEMVs
  summed over each token's pairs in place (two expert launches, no tiles);
  ``decode_gate_up[...]`` / ``decode_down[...]`` sweep one kernel's blocks (the whole
  expert computation is timed, the other kernel at its default blocks);
  ``decode_down_wide[...]`` the down kernel that loads a token's pairs together;
  ``shared.apart`` / ``shared.folded`` (shapes with a gated shared expert) the decode step's
  experts with the shared expert run after them as torch ops, or as one more pair of every
  token inside the two GEMV kernels.
* ``ours.route_plan`` / ``ours.route+plan``  the fixed cost before any expert GEMM: the
  fused launch, and the torch ops (softmax, sort, scatter, cumsum, search) it replaces;
  ``plan.torch`` / ``plan.triton``  the plan alone of the chunk's routing, as torch ops and in
  ``plan_triton``'s two launches (what prompt programs run).
* ``router.invariant_linear`` / ``router.gemv[...]`` / ``router.cublas``  the router GEMM alone,
  as prompt programs run it, as decode steps run it (blocks of experts swept), and by cuBLAS
  (what batch invariance costs).
* ``torch_grouped_mm``  torch._grouped_mm over the pairs sorted by expert (offsets on the
  device), where this torch has it for the dtype.
* ``torch_reference``   (CPU smoke only) the reference path's expert loop on the host.

``active_bytes`` is what a step must read: the union of the experts the batch routes to
(their gate/up and down rows) plus the router; ``gb_per_s`` = active_bytes / time.
Timing, capture and checks are bench/gdn_kernels.py's (``measure``): a median over graph
replays of R rotating input sets, bitwise replay against eager, determinism, and the
error of the first set against a float64 loop over pairs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv:  # the interpreter switch is read when Triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.gdn_kernels import Case, _line, run  # noqa: E402
from flare.prepare.kernels import moe as K  # noqa: E402

F64 = torch.float64
GEOMETRIES = {  # name: (E, k, H, I)
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "qwen3_5-35b-a3b": (256, 8, 2048, 512),
    "qwen3-next-80b-a3b": (512, 10, 2048, 512),
}
# The gated shared expert's intermediate size, where the model has one.
SHARED = {"qwen3_5-35b-a3b": 512, "qwen3-next-80b-a3b": 512, "tiny": 40}  # tiny: the CPU smoke
# Decode GEMV blocks (rows, K columns, warps) swept per kernel, the other at its default.
DECODE_GATE_UP = [(8, 512, 4), (16, 512, 4), (16, 256, 4), (32, 256, 8), (16, 1024, 8), (4, 1024, 4)]
DECODE_DOWN = [(8, 256, 4), (16, 256, 4), (4, 512, 4), (8, 512, 4), (16, 512, 8), (4, 1024, 4), (2, 1024, 4)]
# The down kernel that loads a token's pairs together (``wide_down``): rows, K columns, warps.
DECODE_DOWN_WIDE = [(4, 128, 4), (4, 256, 4), (8, 128, 4), (8, 128, 8), (2, 256, 4), (16, 64, 8), (4, 64, 4)]
# The fold's blocks (gate/up, wide down) beside its defaults ((16, 512, 4), (8, 128, 4)); the
# folded wide down kernel's default was (8, 128, 8) until the 2026-12-04 sweep: at four tokens of
# Qwen3-Next (top-10: 16 pair slots) it needs 162 registers a thread with the shared pair (ptxas,
# sm_90a), one 8-warp program an SM.
FOLDED_BLOCKS = [((16, 512, 4), (8, 128, 8)), ((16, 512, 4), (4, 64, 4)), ((16, 512, 4), (8, 64, 8)),
                 ((8, 512, 4), (8, 128, 4)), ((4, 1024, 4), (8, 128, 4)), ((8, 256, 4), (4, 128, 4))]


def loop64(x, w, ids, gate_up, down):
    E = gate_up.shape[0]
    out = torch.zeros(x.shape, dtype=F64, device=x.device)
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e < E:
                g, u = (gate_up[e].to(F64) @ x[t].to(F64)).chunk(2)
                out[t] += float(w[t, j]) * (down[e].to(F64) @ (F.silu(g) * u))
    return out


def by_expert64(x, w, ids, gate_up, down):
    """The same sum, one float64 GEMM per expert over the rows routed to it."""
    out = torch.zeros(x.shape, dtype=F64, device=x.device)
    for e in range(gate_up.shape[0]):
        t, j = (ids == e).nonzero(as_tuple=True)
        if t.numel():
            g, u = (x[t].to(F64) @ gate_up[e].to(F64).T).chunk(2, dim=-1)
            out.index_add_(0, t, w[t, j].to(F64)[:, None] * ((F.silu(g) * u) @ down[e].to(F64).T))
    return out


def _plan_tensors(p) -> tuple:
    return p.order, p.tile_expert, p.tile_start, p.tile_end


def grouped_mm_candidate(x, w, ids, gate_up, down):
    """torch._grouped_mm over the pairs sorted by expert: offsets from a device cumsum."""
    E = gate_up.shape[0]
    T, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(E + 1, dtype=torch.long, device=x.device).scatter_add(0, flat, torch.ones_like(flat))
    offs = torch.cumsum(counts[:E], 0).to(torch.int32)
    xs = x[order // k]
    gu = torch._grouped_mm(xs, gate_up.transpose(1, 2), offs=offs)
    g, u = gu.chunk(2, dim=-1)
    y = torch._grouped_mm((F.silu(g) * u).to(x.dtype), down.transpose(1, 2), offs=offs)
    out = torch.empty_like(y).index_copy_(0, order, y)
    return K.combine_triton(out, w, ids, E)


def shared_cases(tag, name, geo, T, sets, router, gate_up, down, device, dtype):
    """A decode step's experts with the gated shared expert: as before the fold (the tiled
    router and gate, then the shared expert's gate/up GEMM, SiLU * up, down GEMM and gated sum
    as torch ops, which the compiled layer fused in part) against the recipe's decode step
    now (router and gate in one ``router_gemv`` launch, the shared expert one more pair of
    every token in the routed kernels: ``experts_decode(shared=...)``)."""
    E, k, H, I = geo
    I_s = SHARED[name]
    g = torch.Generator(device="cpu").manual_seed(100 + T)
    s_gate_up = (torch.randn(2 * I_s, H, generator=g) * H ** -0.5).to(dtype).to(device)
    s_down = (torch.randn(H, I_s, generator=g) * I_s ** -0.5).to(dtype).to(device)
    s_gate = torch.randn(1, H, generator=g).to(dtype).to(device)

    def shared_mlp(x, gl):  # the shared expert apart: gate/up GEMM, SiLU * up, down GEMM, gated
        gu, up = F.linear(x, s_gate_up).chunk(2, dim=-1)
        return torch.sigmoid(gl) * F.linear(F.silu(gu) * up, s_down)

    compiled_mlp = torch.compile(shared_mlp, dynamic=False) if device == "cuda" else shared_mlp

    def apart(x):  # as decode steps ran before the fold: tiled router and gate, the expert apart (eager)
        w, ids = K.route_rows(K.invariant_linear(x, router), k, True)
        return (K.experts_decode(x, w, ids, gate_up, down) + shared_mlp(x, K.invariant_linear(x, s_gate)),)

    def folded(x, gu=(16, 512, 4), dn=None):  # as the recipe runs decode steps: router and
        logits, gl = K.router_gemv(x, router, s_gate)   # gate in one GEMV launch, the fold
        w, ids = K.route_rows(logits, k, True)
        return (K.experts_decode(x, w, ids, gate_up, down, shared=(s_gate_up, s_down, gl), gate_up_blocks=gu,
                                 down_blocks=dn),)

    def apart_compiled(x):  # decode steps without the fold today: the router GEMV, the shared expert compiled
        logits, gl = K.router_gemv(x, router, s_gate)
        w, ids = K.route_rows(logits, k, True)
        return (K.experts_decode(x, w, ids, gate_up, down) + compiled_mlp(x, gl),)

    def check(outs, state):  # folded against apart: the same sums but for rounding
        ref = apart(sets[0][0])[0].double()
        return dict(max_abs_err=float((outs[0].double() - ref).abs().max()), out_scale=float(ref.abs().max()))

    return [Case(f"{tag}.shared.apart", [(lambda s=s: apart(s[0])) for s in sets], [], None,
                 "router, route_rows, shared gate GEMV, the two GEMV kernels, then the shared expert as torch ops"),
            Case(f"{tag}.shared.folded", [(lambda s=s: folded(s[0])) for s in sets], [], check,
                 "router, route_rows, shared gate GEMV, the two GEMV kernels with the shared expert as one more pair"),
            Case(f"{tag}.shared.apart_compiled", [(lambda s=s: apart_compiled(s[0])) for s in sets], [], check,
                 "router GEMV with the gate, route_rows, the two GEMV kernels, the shared expert torch.compile'd "
                 "as the compiled layer runs it when it does not fold")] + [
        Case(f"{tag}.shared.folded[gu{gu[0]},{gu[1]},{gu[2]};dn{dn[0]},{dn[1]},{dn[2]}]",
             [(lambda s=s, gu=gu, dn=dn: folded(s[0], gu, dn)) for s in sets], [], None,
             "the fold with other blocks (gate/up; wide down)")
        # (the CPU smoke runs one of them: under the interpreter each costs seconds, and the
        # blocks' code is the same)
        for gu, dn in (FOLDED_BLOCKS if device == "cuda" else FOLDED_BLOCKS[:1])]


def cases_for(name, geo, T, device, dtype, rotations, configs, sweeps=(DECODE_GATE_UP, DECODE_DOWN, DECODE_DOWN_WIDE),
              decode=True):
    E, k, H, I = geo
    g = torch.Generator(device="cpu").manual_seed(T)
    gate_up = (torch.randn(E, 2 * I, H, generator=g) * H ** -0.5).to(dtype).to(device)
    down = (torch.randn(E, H, I, generator=g) * I ** -0.5).to(dtype).to(device)
    router = torch.randn(E, H, generator=g).to(dtype).to(device)
    sets = []
    for _ in range(rotations):
        x = torch.randn(T, H, generator=g).to(dtype).to(device)
        w, ids = K.route(x, router, k, True)
        sets.append((x, w, ids))
    x0, w0, ids0 = sets[0]
    hit = torch.unique(ids0).numel()
    active = hit * 3 * H * I * gate_up.element_size() + router.numel() * router.element_size()

    def check(outs, state):
        ref = loop64(x0, w0, ids0, gate_up, down) if T <= 4 else None
        got = outs[0]
        if ref is None:  # long chunks: expert by expert in float64 (a pair loop is too slow)
            ref = by_expert64(x0, w0, ids0, gate_up, down)
        return dict(max_abs_err=float((got.double() - ref).abs().max()), out_scale=float(ref.abs().max()),
                    experts_hit=hit)

    tag = f"{name}[T{T}]"
    out = []
    if decode and T * k <= K.DECODE_PAIRS:
        def decode(x, w, ids, gu=(16, 512, 4), dn=None):
            logits = K.router_gemv(x, router)[0]
            w, ids = K.route_rows(logits, k, True)
            return (K.experts_decode(x, w, ids, gate_up, down, gate_up_blocks=gu, down_blocks=dn),)
        out.append(Case(f"{tag}.ours.decode", [(lambda s=s: decode(*s)) for s in sets], [], check,
                        "as the recipe runs a decode step: router GEMV, route_rows, the two GEMV kernels",
                        bytes_per_call=active))
        if name in SHARED:
            out += shared_cases(tag, name, geo, T, sets, router, gate_up, down, device, dtype)
        expert_bytes = hit * H * I * gate_up.element_size()
        for gu in sweeps[0]:
            out.append(Case(f"{tag}.decode_gate_up[bn{gu[0]},bk{gu[1]},w{gu[2]}]",
                            [(lambda s=s, gu=gu: (K.experts_decode(*s, gate_up, down, gate_up_blocks=gu),))
                             for s in sets], [], None, "both decode kernels; gate/up blocks swept",
                            bytes_per_call=3 * expert_bytes))
        for dn in sweeps[1]:
            out.append(Case(f"{tag}.decode_down[bn{dn[0]},bk{dn[1]},w{dn[2]}]",
                            [(lambda s=s, dn=dn: (K.experts_decode(*s, gate_up, down, down_blocks=dn,
                                                                  wide_down=False),))
                             for s in sets], [], None, "both decode kernels, the down kernel pair after pair; "
                                                       "its blocks swept",
                            bytes_per_call=3 * expert_bytes))
        for dn in sweeps[2]:
            out.append(Case(f"{tag}.decode_down_wide[bn{dn[0]},bk{dn[1]},w{dn[2]}]",
                            [(lambda s=s, dn=dn: (K.experts_decode(*s, gate_up, down, down_blocks=dn, wide_down=True),))
                             for s in sets], [], check if dn == sweeps[2][0] else None,
                            "both decode kernels, the down kernel loading a token's pairs together; its blocks swept",
                            bytes_per_call=3 * expert_bytes))
    for bm, bn, bk, warps in configs:
        if (T <= 4) != (bm == 16):
            continue

        def ours(x, w, ids, bm=bm, bn=bn, bk=bk, warps=warps):
            # As the recipe runs a prefill chunk: the invariant router, routing per token, the plan.
            w, ids = K.route_rows(K.invariant_linear(x, router), k, True)
            p = K.plan_triton(ids, E, bm)
            h = K.grouped_gate_up(x, gate_up, p, k, block_n=bn, block_k=bk, num_warps=warps)
            return (K.combine_triton(K.grouped_down(h, down, p, block_n=bn, block_k=bk, num_warps=warps), w, ids,
                                     E),)
        out.append(Case(f"{tag}.ours[bm{bm},bn{bn},bk{bk},w{warps}]",
                        [(lambda s=s, f=ours: f(*s)) for s in sets], [], check, bytes_per_call=active))
    out.append(Case(f"{tag}.router.invariant_linear", [(lambda s=s: (K.invariant_linear(s[0], router),)) for s in sets],
                    [], None, "the router GEMM as the recipe runs it (fixed tiles, batch-invariant rows)"))
    if T * k <= K.DECODE_PAIRS and (device == "cuda" or T <= 4):  # (the CPU smoke: at 1 and 4 tokens, as on the GPU)
        for bn in (1, 2, 4, 8, 16) if device == "cuda" else (1,):  # (the CPU smoke: the default)
            out.append(Case(f"{tag}.router.gemv[bn{bn}]",
                            [(lambda s=s, bn=bn: (K.router_gemv(s[0], router, block_n=bn)[0],)) for s in sets],
                            [], None, "the router GEMV of decode steps (a program per token and block of experts)"))
        tickets = torch.zeros(T, dtype=torch.int32, device=device)
        # Routing in the launch: the last ticket routes; with fewer warps (the routing's reductions
        # then stay within a warp or two, its GEMV programs streaming a row with fewer threads) too,
        # as a measure for ``ROUTE_WARPS``, which route_rows and a routing router share.
        # ``ranks``: the top k by ranks (``ROUTE_RANKS``) instead of k maxima one after another.
        for bn, warps, ranks in (((1, 4, 0), (4, 4, 0), (1, 2, 0), (1, 1, 0), (1, 4, 1), (1, 2, 1), (1, 1, 1))
                                 if device == "cuda" else ((1, 4, 0), (1, 1, 1))):
            out.append(Case(f"{tag}.router.gemv_route[bn{bn},w{warps}{',ranks' if ranks else ''}]",
                            [(lambda s=s, bn=bn, w=warps, r=ranks: tuple(
                                K.router_gemv(s[0], router, block_n=bn, num_warps=w, route=(k, True, None, tickets),
                                              exact=False, ranks=bool(r))[2:]))
                             for s in sets],
                            [], None, "the router GEMV routing in its launch (decode steps with ticket counters)"))
    out.append(Case(f"{tag}.router.cublas", [(lambda s=s: (F.linear(s[0], router),)) for s in sets],
                    [], None, "the router GEMM by cuBLAS (rows depend on the batch size)"))
    out.append(Case(f"{tag}.ours.route+plan", [(lambda s=s: (K.plan(K.route(s[0], router, k, True)[1], E, 16).order,))
                                               for s in sets], [], None, "router GEMM, route and plan as torch ops"))
    routed = [K.route_rows(K.invariant_linear(s[0], router), k, True)[1] for s in sets]
    for name, fn in (("torch", K.plan), ("triton", K.plan_triton)):
        how = "torch ops" if name == "torch" else "two launches"
        out.append(Case(f"{tag}.plan.{name}", [(lambda r=r, fn=fn: _plan_tensors(fn(r, E, K.BLOCK_M))) for r in routed],
                        [], None, f"the plan of the chunk's routing ({how})"))
    if K.fits_route_plan(T, k):
        out.append(Case(f"{tag}.ours.route_plan", [(lambda s=s: (K.route_plan(F.linear(s[0], router), k, True, None,
                                                                              16)[2].order,)) for s in sets],
                        [], None, "router GEMM and the fused route_plan launch"))
    if hasattr(torch, "_grouped_mm") and device == "cuda":
        out.append(Case(f"{tag}.torch_grouped_mm", [(lambda s=s: (grouped_mm_candidate(*s, gate_up, down),))
                                                    for s in sets], [], check, bytes_per_call=active))
    if device == "cpu":  # the reference loops over experts on the host: it cannot be captured
        out.append(Case(f"{tag}.torch_reference", [(lambda s=s: (K.experts_torch(*s, gate_up, down),)) for s in sets],
                        [], check, bytes_per_call=active))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--replays", type=int, default=100)
    p.add_argument("--budget-s", type=float, default=150.0)
    p.add_argument("--tokens", default=None, help="token counts, comma separated (default 1,4,128,2048)")
    p.add_argument("--geometries", default=None, help=f"comma separated, of {', '.join(GEOMETRIES)} (default: all)")
    p.add_argument("--cases", default=None, help="only the cases whose names contain one of these comma-separated strings")
    args = p.parse_args(argv)
    started = time.perf_counter()
    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        print("no CUDA device: run with --smoke for the CPU check", file=sys.stderr)
        return 2
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    geos = GEOMETRIES if cuda else {"tiny": (8, 2, 32, 48)}
    if args.geometries and cuda:
        geos = {g: GEOMETRIES[g] for g in args.geometries.split(",")}
    # Smoke: 12 tokens covers what a larger chunk would under the interpreter (a non-power-of-two
    # T for the fused route_plan's masks, the prefill tiles at BLOCK_M 64). The decode candidates
    # run at 1 and 4 tokens only, as on the GPU (at 128 and 2,048 the pairs exceed DECODE_PAIRS):
    # the GEMVs' code does not depend on the number of pairs, only their grid does, and under the
    # interpreter their cost grows with it (12 tokens: ~20 s of the smoke's ~33 s here).
    tokens = [int(t) for t in (args.tokens or ("1,4,128,2048" if cuda else "1,4,12")).split(",")]
    configs = ([(16, 32, 128, 4), (64, 64, 64, 4), (64, 128, 64, 8)] if cuda
               else [(16, 32, 32, 4), (64, 32, 32, 4)])
    if args.smoke:
        args.replays = 2
    cases = []
    for name, geo in geos.items():
        for T in tokens:
            rot = max(1, min(16, (3 * 50 << 20) // (T * geo[1] * 3 * geo[2] * geo[3] * 2 + 1))) if cuda else 2
            sweeps = (DECODE_GATE_UP, DECODE_DOWN, DECODE_DOWN_WIDE) if cuda else ([(8, 16, 4)], [(16, 16, 4)],
                                                                                    [(16, 16, 4)])
            cases += cases_for(name, geo, T, device, dtype, rot, configs, sweeps, decode=cuda or T <= 4)
    if args.cases:
        cases = [c for c in cases if any(s in c.name for s in args.cases.split(","))]
    results = run(cases, args, cuda, started, lambda line: print(line, flush=True))
    report = dict(
        machine=dict(device=torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu"),
        versions=dict(python=platform.python_version(), torch=torch.__version__, triton=triton.__version__),
        config=dict(smoke=args.smoke, geometries=geos, tokens=tokens, dtype=str(dtype), replays=args.replays,
                    cases=args.cases, configs=configs),
        results=results, wall_s=round(time.perf_counter() - started, 1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1, default=str))
    print(f"\n== routed experts, per layer ({report['machine']['device']}); {report['wall_s']} s")
    for r in results:
        print(_line(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
