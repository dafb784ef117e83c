"""Capture every program, record golden replays, export graphs and kernels.

Runs inside the CUDA preparation session with torch's allocations routed into
the arena's pool. Warmup compiles (Inductor) and autotunes; a program whose
compiled forward fails to build falls back to the eager forward, and the
report says so. Golden replays (``--qualify N``) restore a deterministic base
state, apply N input sets per program (``flare.runtime.qualify``), replay the
torch graph and record a digest of every runtime-owned buffer, which the
torch-free runtime must reproduce bit for bit.
"""

from __future__ import annotations

import time
import traceback
from pathlib import Path

import msgspec
import torch

from flare.core import graph as G
from flare.core.manifest import Buffer, BufferRole, DType, Manifest
from flare.prepare.cuda.export import KernelTableBuilder, export_graph
from flare.prepare.layout import align
from flare.prepare.parallel import SINGLE, TensorParallel
from flare.prepare.golden import record as record_golden


def capture_and_export(session, programs, manifest: Manifest, views, pool_offset: int, out: Path, opts,
                       progress, tp: TensorParallel = SINGLE) -> dict:
    """``out``: this rank's directory. Ranks of a TP group export graphs of their own
    and agree on one arena size (the largest scratch pool any rank used)."""
    stream = torch.cuda.Stream()
    graphs: dict[str, torch.cuda.CUDAGraph] = {}
    compiled: dict[str, bool] = {}
    timings: dict[str, dict] = {}
    for p in sorted(manifest.programs, key=lambda p: (p.kind.value, -p.capacity)):
        t0 = time.perf_counter()
        eager = not opts.compile
        fn = programs.callable(p.kind, p.capacity, eager=eager)
        refused = session.allocator.stats()["failed"] if session.allocator is not None else 0
        try:
            with torch.cuda.use_mem_pool(session.pool), torch.cuda.stream(stream):
                fn()
                fn()
            torch.cuda.synchronize()
        except Exception as e:
            # A TP rank falling back alone would run other collectives than its peers.
            if eager or tp.active:
                raise
            session.check_no_escapes(refused)  # this program ran out of scratch: eager would too
            progress(f"{p.name}: compiled forward failed ({type(e).__name__}: {str(e)[:300]}); capturing eager")
            traceback.print_exc()
            eager = True
            fn = programs.callable(p.kind, p.capacity, eager=True)
            with torch.cuda.use_mem_pool(session.pool), torch.cuda.stream(stream):
                fn()
                fn()
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        g = torch.cuda.CUDAGraph(keep_graph=True)
        with torch.cuda.graph(g, pool=session.pool.id, stream=stream):
            fn()
        g.instantiate()
        torch.cuda.synchronize()
        graphs[p.name] = g
        compiled[p.name] = not eager
        timings[p.name] = {"warmup_s": round(t1 - t0, 2), "capture_s": round(time.perf_counter() - t1, 3)}
        progress(f"captured {p.name} ({'compiled' if not eager else 'eager'}): warmup {t1 - t0:.1f} s, "
                 f"capture {time.perf_counter() - t1:.2f} s")

    golden = {}
    if opts.qualify:

        def run(name: str) -> None:
            torch.cuda.synchronize()
            graphs[name].replay()
            torch.cuda.synchronize()

        with torch.cuda.use_mem_pool(session.pool):
            golden = record_golden(manifest, views, run, opts.qualify)
        progress(f"recorded golden replays: {opts.qualify} input sets x {len(golden)} programs")

    session.check_no_escapes()
    # The export scans every kernel parameter word for device addresses outside the arena.
    # ATen fills only the dimensions a tensor has of its kernels' offset calculators (the rest
    # of the 25 is whatever the host stack held, often a recent device pointer), so cached but
    # unused memory of torch's default allocator could make such a word look like a pointer
    # (an 8B-geometry preparation failed so once, intermittently). Releasing it first leaves
    # only live allocations for the scan to find.
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    used = align(session.allocator.used, 2 << 20)
    if tp.active:
        used = max(int(u) for u in tp.gather_strings(str(used)))
    arena = (session.base, pool_offset + used)
    builder = KernelTableBuilder(session.recorder)
    (out / "graphs").mkdir(parents=True, exist_ok=True)
    (out / "kernels").mkdir(parents=True, exist_ok=True)
    node_counts = {}
    for name, g in graphs.items():
        spec = export_graph(name, int(g.raw_cuda_graph()), builder, arena)
        G.save(out / "graphs" / f"{name}.json", spec)
        node_counts[name] = len(spec.nodes)
    table = builder.table()
    G.save(out / "kernels.json", table)
    for img in table.images:
        (out / "kernels" / f"{img.sha}.cubin").write_bytes(session.recorder.images[img.sha].data)
    if golden:
        (out / "qualification.json").write_bytes(msgspec.json.encode(golden))
    progress(f"exported {len(graphs)} graphs ({sum(node_counts.values())} nodes), {len(table.functions)} kernels "
             f"from {len(table.images)} images ({sum(i.nbytes for i in table.images) / 2**20:.1f} MiB)")
    pool = Buffer(name="pool", role=BufferRole.scratch, dtype=DType.uint8, shape=(used,), offset=pool_offset,
                  nbytes=used)
    return {
        "buffers": (pool,),
        "arena_nbytes": pool_offset + used,
        "report": {
            "scratch_pool": session.allocator.stats(),
            "graph_nodes": node_counts,
            "compiled": compiled,
            "capture": timings,
            "kernel_images_bytes": sum(i.nbytes for i in table.images),
            "cupti_callback_errors": session.recorder.callback_errors[:5],
        },
    }
