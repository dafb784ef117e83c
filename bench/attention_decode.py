"""Decode attention: the even split of a row's keys against key segments at fixed positions
(``attend_triton(..., segments=True)``): GPU time of one layer's call, and whether a row's
bits depend on the live rows of its step.

usage: python bench/attention_decode.py --out RESULT.json [--contexts 1024,...] [--limit KEYS]
           [--split-blocks 0,1,...] [--replays 50]
       python bench/attention_decode.py --smoke --out /tmp/attention-decode-smoke.json   (CPU, interpreter)

For each geometry (Llama-3.1-8B: 32 query heads over 8 kv heads; Qwen3-30B-A3B: 32 over 4;
head dim 128, pages of 16 tokens, bfloat16 KV) and context, a decode launch of capacity 4
whose rows each have that context (the launch's page table is as wide as the context:
a core whose context limit it is; ``--limit``: as wide as that many keys, a core of that context
limit, every row's history still the context), with 1 and with 4 rows live. Per mode (``split``: the
even split decode steps take, summed by the combine kernel; ``segments``: the prompt programs'
fixed segments; ``fold``: the even split with ticket counters, as a CUDA core's decode steps
run it, the splits summed by each tile's last program, no combine launch; ``fold.sbN``: the
same with at most one split per N key blocks of a row instead of ``SPLIT_BLOCKS``, for each N of
``--split-blocks``, 0 the split over every program the launch offers, however short the history):

* ``time_us``: one layer's call, the median over graph replays of R calls on R layers of
  the KV pool (rotating past the L2 cache), divided by R; ``gb_per_s`` the live rows' KV
  bytes over it;
* ``max_abs_err`` of the first call against float64 attention over the same keys;
* ``batch_invariant``: row 0's output alone (1 live row) bit for bit its output among 4
  live rows (the device then picks fewer programs per row).

Each case goes through ``bench.gdn_kernels.run`` (determinism and bitwise replay checked,
failures recorded without stopping the rest).
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402

from bench.gdn_kernels import Case, kernel_bench_args, run  # noqa: E402
from flare.prepare.attention import PagedBatch  # noqa: E402
from flare.prepare.kernels.paged_attention import SPLIT_BLOCKS, attend_triton  # noqa: E402

GEOMETRIES = {"llama-3.1-8b": (32, 8, 128), "qwen3-30b-a3b": (32, 4, 128)}
SMOKE_GEOMETRIES = {"tiny": (4, 2, 16)}
PAGE = 16
CAPACITY = 4
F64 = torch.float64


def _pool(H, KVH, D, context, layers, device, gen, dtype):
    """KV pool of ``layers`` layers, slot s (1..CAPACITY) owning ``context / PAGE`` pages (page 0:
    the null page), a page table as wide as ``context`` keys, and queries for CAPACITY rows."""
    per = -(-context // PAGE)
    kv = torch.randn(layers, 2, 1 + CAPACITY * per, PAGE, KVH, D, generator=gen, device=device).to(dtype)
    table = torch.zeros(CAPACITY + 1, per, dtype=torch.int32, device=device)
    for s in range(1, CAPACITY + 1):
        table[s] = torch.arange(1 + (s - 1) * per, 1 + s * per, dtype=torch.int32, device=device)
    q = torch.randn(CAPACITY, H, D, generator=gen, device=device).to(dtype)
    return kv, table, q


def _batch(kv, table, context, live, device, tickets=None) -> PagedBatch:
    rows = torch.arange(CAPACITY, device=device)
    return PagedBatch(kv, table, token_slot=rows + 1, positions=torch.full((CAPACITY,), context - 1, device=device),
                      slot_mapping=torch.full((CAPACITY,), -1, device=device), valid=rows < live, impl="triton",
                      tickets=tickets)


def _reference(kv, table, q, layer, row, context, scale):
    """Float64 attention of query row ``row`` over its slot's ``context`` keys."""
    H, KVH = q.shape[1], kv.shape[-2]
    pages = table[row + 1].long()
    k = kv[layer, 0, pages].reshape(-1, KVH, kv.shape[-1])[:context].to(F64)
    v = kv[layer, 1, pages].reshape(-1, KVH, kv.shape[-1])[:context].to(F64)
    k, v = (t.repeat_interleave(H // KVH, dim=1) for t in (k, v))
    s = torch.einsum("hd,khd->hk", q[row].to(F64), k) * scale
    return torch.einsum("hk,khd->hd", s.softmax(-1), v)


def _context_cases(gname, H, KVH, D, context, device, l2_bytes, limit=None, split_blocks=()) -> list[Case]:
    """The cases (1 and 4 live rows, each mode) of one geometry and context, on one pool whose
    page table is as wide as ``limit`` keys (default: the context)."""
    scale = D ** -0.5
    width = max(context, limit or 0)
    row_bytes = context * KVH * D * 2 * 2  # K and V, bfloat16
    layers = max(2, min(64, -(-3 * l2_bytes // row_bytes))) if device == "cuda" else 2
    gen = torch.Generator(device=device).manual_seed(context)
    # bfloat16 on the GPU; float32 under the interpreter (which truncates float32 -> bfloat16 casts)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    try:
        kv, table, q = _pool(H, KVH, D, width, layers, device, gen, dtype)
    except torch.OutOfMemoryError as e:
        return [Case(name=f"{gname}.ctx{context}", calls=[], state=[], notes=f"pool: {e}"[:300])]

    def row0(live, segments, sb, tickets=None):
        return attend_triton(_batch(kv, table, context, live, device, tickets), 0, q, scale, segments=segments,
                             split_blocks=sb)[0]

    out = []
    tickets = torch.zeros(1 << 14, dtype=torch.int32, device=device)
    modes = [("split", None, SPLIT_BLOCKS), ("segments", True, SPLIT_BLOCKS), ("fold", None, SPLIT_BLOCKS)]
    modes += [(f"fold.sb{sb}", None, sb) for sb in split_blocks]
    for live in (1, CAPACITY):
        for mode, segments, sb in modes:
            folds = mode.startswith("fold")
            batch = _batch(kv, table, context, live, device, tickets if folds else None)

            def call(layer, batch=batch, segments=segments, sb=sb):
                return (attend_triton(batch, layer, q, scale, segments=segments, split_blocks=sb),)

            def check(outs, _state, segments=segments, sb=sb, folds=folds):
                ref = _reference(kv, table, q, 0, 0, context, scale)
                alone, among = (row0(n, segments, sb, tickets if folds else None) for n in (1, CAPACITY))
                return dict(max_abs_err=float((outs[0][0].to(F64) - ref).abs().max()),
                            out_scale=float(ref.abs().max()), batch_invariant=bool(torch.equal(alone, among)))

            out.append(Case(name=f"{gname}.ctx{context}.live{live}.{mode}",
                            calls=[lambda i=i, c=call: c(i) for i in range(layers)], state=[], check=check,
                            notes=f"H {H}, KVH {KVH}, D {D}, table {width} keys, {layers} layers rotated",
                            bytes_per_call=live * row_bytes))
    return out


def cases(geometries, contexts, device, l2_bytes, limit=None, split_blocks=()) -> list[Case]:
    return [c for gname, (H, KVH, D) in geometries.items() for context in contexts
            for c in _context_cases(gname, H, KVH, D, context, device, l2_bytes, limit, split_blocks)]


def main(argv=None) -> int:
    def add(p):
        p.add_argument("--contexts", default=None, help="comma separated (default 1024,4096,16384,65536,131072)")
        p.add_argument("--geometries", default=None, help=f"comma separated, of {', '.join(GEOMETRIES)}")
        p.add_argument("--limit", type=int, default=None,
                       help="page table width in keys, a core's context limit (default: each context)")
        p.add_argument("--split-blocks", default="",
                       help=f"comma separated: fold.sbN cases besides the default's {SPLIT_BLOCKS} (--smoke: 0)")
    _, args, device = kernel_bench_args(__doc__, argv, add, replays=50, budget_s=240.0)
    if device is None:
        return 2
    cuda = device == "cuda"
    geos = SMOKE_GEOMETRIES if args.smoke else {g: GEOMETRIES[g] for g in (args.geometries or ",".join(GEOMETRIES)).split(",")}
    # (the smoke: three key blocks in a page table of four, a split of at most two, and over all)
    contexts = [int(c) for c in (args.contexts or ("160" if args.smoke else "1024,4096,16384,65536,131072")).split(",")]
    limit = args.limit or (256 if args.smoke else None)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size if cuda else 0
    meta = {"machine": platform.node(), "device": torch.cuda.get_device_name() if cuda else "cpu (interpreter)",
            "torch": torch.__version__, "triton": triton.__version__, "python": sys.version.split()[0],
            "capacity": CAPACITY, "page_size": PAGE, "kv_dtype": "bfloat16", "replays": args.replays,
            "limit": limit, "split_blocks": SPLIT_BLOCKS,
            "command": "python bench/attention_decode.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    started = time.perf_counter()
    sbs = [int(v) for v in (args.split_blocks or ("0" if args.smoke else "")).split(",") if v]
    results = run(cases(geos, contexts, device, l2, limit, sbs), args, cuda, started, print)
    Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
