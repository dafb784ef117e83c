"""Per-kernel GPU timeline of one decode step (or prefill chunk), attributed to operators and layers.

usage: python -m bench.timeline CORE OUT.json [--batches 1,4] [--prefills 16@0,2048@4096]
                                [--packs 4096@2048+3] [--launches 20]

For each requested decode capacity B the slots are set up as in bench.floor and
decode.B is timed with events around ``launches`` back-to-back launches (graph_ms,
the graph's own time). ``--prefills N@S``: the prefill program the scheduler picks for
N new tokens of one slot after S tokens in KV (S clamped to what the slot's pages hold),
its inputs staged before every launch, graph_ms the median of single launches (as
bench.floor's program times: staging and the completion copy included). ``--packs N@S+D``
(cores with pack programs): a decode step that carries a prompt's chunk, as
``flare-serve --decode-with-prefill`` runs it: slot 1's prompt has N tokens left after S,
D slots decode beside it, and the chunk, pack and rows are what ``runtime.packing`` plans
(for example 4096@2048+3: 192 tokens and three decode rows in pack.256 with 64-row tiles).
Then a *timed* copy of the same program is built from its
exported GraphSpec: the nodes in a topological order (spec order among ready
nodes) as one serial chain, an event-record node before the first node and after
every node. It is launched ``launches`` times; each node's time is the median of
the elapsed time between its two events. Serializing removes the overlap the real
graph may have and adds one event per node, so timed_sum_ms is expected to be a
little above graph_ms: the difference is what the breakdown cannot see.

Kernels are attributed by name (operator) and by the arena buffers their pointer
parameters fall in (weights, hence layer). Torch-free: runs in the serving env.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import heapq
import itertools
import json
import re
import sys

import numpy as np
from cuda.bindings import driver as d

from bench.collect import step_bytes
from bench.floor import LOGPROBS, _setup_slots, _timed_launch, copy_bandwidth, gpu_ms_per_step, prefill_writes, run_meta
from bench.kernel_parts import op_of, part_of
from flare.core import graph as G
from flare.core import interface as io
from flare.core.manifest import load_manifest
from flare.runtime.cuda_driver import ck
from flare.runtime import packing
from flare.runtime.cuda_executor import CudaExecutor

_LAYER = re.compile(r"layers\.(\d+)\.")


def _order(spec: G.GraphSpec) -> list[int]:
    n = len(spec.nodes)
    indeg, succ = [0] * n, [[] for _ in range(n)]
    for e in spec.edges:
        succ[e.src].append(e.dst)
        indeg[e.dst] += 1
    ready = [i for i in range(n) if indeg[i] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for j in succ[i]:
            indeg[j] -= 1
            if indeg[j] == 0:
                heapq.heappush(ready, j)
    if len(order) != n:
        raise ValueError(f"graph {spec.program} has a cycle")
    return order


def _timed_graph(ex: CudaExecutor, spec: G.GraphSpec):
    """The program as one serial chain with an event after every node (empty nodes,
    pure joins, are dropped). Returns (graph, exec, events, spec indices in order)."""
    order = [i for i in _order(spec) if not isinstance(spec.nodes[i], G.EmptyNode)]
    ex.rebuilder.apply_attributes_for(spec)
    graph = ck(d.cuGraphCreate(0), "cuGraphCreate")
    events = [ck(d.cuEventCreate(0), "cuEventCreate") for _ in range(len(order) + 1)]
    chain = [ck(d.cuGraphAddEventRecordNode(graph, None, 0, events[0]), "event node")]
    for k, i in enumerate(order):
        node = spec.nodes[i]
        chain.append(ex.rebuilder.add_node(graph, node))
        chain.append(ck(d.cuGraphAddEventRecordNode(graph, None, 0, events[k + 1]), "event node"))
    ck(d.cuGraphAddDependencies(graph, chain[:-1], chain[1:], None, len(chain) - 1), "cuGraphAddDependencies")
    gexec = ck(d.cuGraphInstantiate(graph, 0), f"cuGraphInstantiate timed {spec.program}")
    ck(d.cuGraphUpload(gexec, ex.stream), "cuGraphUpload")
    return graph, gexec, events, order


def _fresh_slots(ex: CudaExecutor, m, batch: int) -> None:
    _setup_slots(ex, m, batch)
    ex.sync()


class _Decode:
    """decode.B on B fresh slots, launched back to back."""

    def __init__(self, m, batch: int):
        self.m, self.batch, self.program = m, batch, f"decode.{batch}"

    def setup(self, ex: CudaExecutor) -> None:
        _fresh_slots(ex, self.m, self.batch)

    def before(self, ex: CudaExecutor) -> None:
        pass

    def graph_ms(self, ex: CudaExecutor, launches: int) -> float:
        self.setup(ex)
        return gpu_ms_per_step(ex, self.program, launches, warmup=3)


def _history(m, start: int) -> int:
    """``start`` cut to the deepest history slot 1's pages (``_setup_slots``) and the context
    hold with a whole prefill chunk after it, on a page boundary (as bench.floor.program_times)."""
    c, ps = m.capacities, m.pages.page_size
    pages = min((m.pages.num_pages - 1) // c.slots, c.max_pages_per_slot)
    return max(0, min(start, (pages * ps - max(c.prefill_capacities)) // ps * ps, c.context_limit - c.prefill_chunk))


class _Prefill:
    """The prefill of ``n`` tokens of slot 1 after ``start`` in KV, staged before every launch.
    Its graph_ms is a single launch's, staging and completion copy included (bench.floor's
    program times), since a launch advances the slot."""

    def __init__(self, m, n: int, start: int):
        if n > max(m.capacities.prefill_capacities):
            raise ValueError(f"{n} tokens: over the core's largest prefill program")
        self.m, self.n, self.start = m, n, _history(m, start)
        self.program, self.writes = prefill_writes(m, self.start, n, np.random.default_rng(0))

    def setup(self, ex: CudaExecutor) -> None:
        _fresh_slots(ex, self.m, 1)

    def before(self, ex: CudaExecutor) -> None:
        for buffer, value, row in self.writes:
            ex.write(buffer, np.asarray(value), row)

    def graph_ms(self, ex: CudaExecutor, launches: int) -> float:
        self.setup(ex)
        return _timed_launch(ex, self.program, self.writes, reps=launches)


class _Pack(_Prefill):
    """A decode step that carries a prompt's chunk, as the scheduler plans it
    (``runtime.packing.plan``): the prompt has ``left`` tokens to go after ``start`` in KV
    (slot 1), and ``decoders`` slots (2, 3, ...: 16 tokens of history, their pending tokens)
    decode beside it; the chunk is cut to the rows they leave (whole tiles when it continues
    a history) and samples only if it ends the prompt."""

    def __init__(self, m, left: int, start: int, decoders: int):
        c = m.capacities
        self.m, self.start, self.decoders, self.left = m, _history(m, start), decoders, left
        planned = packing.plan([packing.Chunk(left, self.start > 0)], decoders, list(c.pack_capacities),
                               c.pack_align, c.decode_capacities[-1])
        if planned is None:
            raise ValueError(f"a prompt with {left} tokens left after {self.start} and {decoders} decoders: no pack "
                             f"(pack capacities {c.pack_capacities}, tiles of {c.pack_align})")
        capacity, (n,) = planned
        self.n, self.program = n, f"pack.{capacity}"
        rows, _ = packing.layout([(n, self.start > 0)] + [(1, False)] * decoders, c.pack_align)
        chunk = dict((name, value) for name, value, _ in prefill_writes(m, self.start, n, np.random.default_rng(0))[1])
        tokens = np.zeros(capacity, np.int32)
        tokens[rows[0]:rows[0] + n] = chunk[io.TOKENS][:n]
        table = np.zeros((max(c.decode_capacities), len(io.PackSegment._fields)), np.int32)
        table[0] = io.pack(io.PackSegment(1, n, int(n == left), rows[0]))
        for i in range(decoders):
            slot = 2 + i
            tokens[rows[1 + i]] = 100 + slot  # its pending token (_setup_slots)
            table[1 + i] = io.pack(io.PackSegment(slot, 1, 1, rows[1 + i]))
        self.writes = [("state.len", np.int32(self.start), 1), *(("state.len", np.int32(16), 2 + i)
                                                                  for i in range(decoders)),
                       (io.TOKENS, tokens, None), (io.PACK_INPUT, table, None)]

    def setup(self, ex: CudaExecutor) -> None:
        _fresh_slots(ex, self.m, 1 + self.decoders)


def _node_ms(ex: CudaExecutor, run, gexec, events: list, launches: int) -> np.ndarray:
    run.setup(ex)
    samples = []
    for i in range(3 + launches):
        run.before(ex)
        ck(d.cuGraphLaunch(gexec, ex.stream), "cuGraphLaunch timed")
        ck(d.cuStreamSynchronize(ex.stream), "cuStreamSynchronize")
        if i >= 3:
            samples.append([ck(d.cuEventElapsedTime(a, b), "elapsed") for a, b in itertools.pairwise(events)])
    return np.median(np.array(samples, dtype=np.float64), axis=0)


def _spans(m, base: int) -> list[tuple[int, int, str]]:
    return sorted((base + b.offset, base + b.offset + b.nbytes, b.name) for b in m.buffers)


def _touched(node: G.KernelNode, spans: list, starts: list) -> list[str]:
    """Buffers that 8-byte-aligned words of the parameters point into. Words inside
    larger by-value parameters are read too: library GEMMs pass pointers in a struct."""
    names: list[str] = []
    for off, size in node.param_layout:
        for k in range(off + (-off % 8), off + size - 7, 8):
            v = int.from_bytes(node.params[k : k + 8], "little")
            j = bisect.bisect_right(starts, v) - 1
            if j >= 0 and v < spans[j][1] and spans[j][2] not in names:
                names.append(spans[j][2])
    return names


def _rows(ex: CudaExecutor, m, spec: G.GraphSpec, order: list[int], ms: np.ndarray, spans: list) -> list[dict]:
    starts = [s for s, _, _ in spans]
    rows = []
    for k, i in enumerate(order):
        node = spec.nodes[i]
        t = float(ms[k])
        row = {"i": k, "node": i, "ms": round(t, 5), "bytes": None, "GBps": None}
        if isinstance(node, G.KernelNode):
            name = ex.rebuilder.function_name(node.function)
            touched = _touched(node, spans, starts)
            weights = [t for t in touched if t.startswith("w.")]
            layer = next((int(g.group(1)) for t in touched if (g := _LAYER.search(t))), None)
            row.update(function=node.function, name=name if len(name) <= 96 else name[:93] + "...", op=op_of(name),
                       layer=layer, weights=[w[2:] for w in weights], part=part_of(weights))
            if row["op"] == "matmul" and len(weights) == 1 and t > 0:
                row["bytes"] = m.buffer(weights[0]).nbytes
                row["GBps"] = round(row["bytes"] / (t / 1e3) / 1e9, 1)
        else:
            kind = type(node).__name__.removesuffix("Node").lower()
            row.update(function=None, name=kind, op=kind, layer=None, weights=[], part=None)
        rows.append(row)
    fill_layers(rows)
    return rows


def fill_layers(rows: list[dict]) -> None:
    """Kernels without a layer weight: head before the first layer, tail after the last,
    otherwise the layer of the previous kernel (a residual add ends its layer's work);
    likewise their part (``bench.kernel_parts.part_of``): the part before them, else "other"."""
    known = [k for k, r in enumerate(rows) if r["layer"] is not None]
    for k, r in enumerate(rows):
        if r["layer"] is None:
            j = bisect.bisect_left(known, k)
            r["layer"] = "head" if j == 0 else "tail" if j == len(known) else rows[known[j - 1]]["layer"]
    part = "other"
    for r in rows:
        part = r["part"] = r.get("part") or (part if r["layer"] not in ("head", "tail") else "other")


def _summary(rows: list[dict]) -> dict:
    total = sum(r["ms"] for r in rows)
    ops: dict[str, dict] = {}
    parts: dict[str, dict] = {}
    layers: dict[object, dict] = {}
    for r in rows:
        p = parts.setdefault(r.get("part") or "other", {"ms": 0.0, "count": 0})  # older files: no parts
        p["ms"] += r["ms"]
        p["count"] += 1
        o = ops.setdefault(r["op"], {"ms": 0.0, "count": 0})
        o["ms"] += r["ms"]
        o["count"] += 1
        lay = layers.setdefault(r["layer"], {"ms": 0.0, "count": 0, "ops": {}})
        lay["ms"] += r["ms"]
        lay["count"] += 1
        lay["ops"][r["op"]] = lay["ops"].get(r["op"], 0.0) + r["ms"]
    for o in ops.values():
        o["fraction_of_sum"] = o["ms"] / total if total else 0.0
    ops = dict(sorted(ops.items(), key=lambda kv: -kv[1]["ms"]))
    body_idx = sorted((k for k in layers if isinstance(k, int)), key=lambda k: layers[k]["ms"])
    body = None
    if body_idx:
        med = body_idx[len(body_idx) // 2]
        body = {"layers": len(body_idx), "median_layer": med, "median_ms": layers[med]["ms"],
                "min_ms": layers[body_idx[0]]["ms"], "max_ms": layers[body_idx[-1]]["ms"],
                "kernels": layers[med]["count"], "ops_ms": layers[med]["ops"]}
    keys = sorted(layers, key=lambda k: (k == "tail", k != "head", k if isinstance(k, int) else 0))
    parts = dict(sorted(parts.items(), key=lambda kv: -kv[1]["ms"]))
    return {"timed_sum_ms": total, "ops": ops, "parts": parts, "layers": {str(k): layers[k] for k in keys},
            "layer_body": body}


def profile(ex: CudaExecutor, m, run, launches: int, spans: list) -> dict:
    program = m.program(run.program)
    spec = G.load_graph(ex.core_dir / program.graph)
    graph_ms = run.graph_ms(ex, launches)
    graph, gexec, events, order = _timed_graph(ex, spec)
    try:
        ms = _node_ms(ex, run, gexec, events, launches)
    finally:
        ck(d.cuStreamSynchronize(ex.stream), "cuStreamSynchronize")
        d.cuGraphExecDestroy(gexec)
        d.cuGraphDestroy(graph)
        for e in events:
            d.cuEventDestroy(e)
    rows = _rows(ex, m, spec, order, ms, spans)
    return {"program": program.name, "graph_ms": graph_ms,
            "kernel_count": sum(isinstance(spec.nodes[i], G.KernelNode) for i in order),
            **_summary(rows), "nodes": rows}


def _print(r: dict, roofline_ms: float) -> None:
    print(f"\n{r['program']}: graph {r['graph_ms']:.3f} ms a launch, serialized sum {r['timed_sum_ms']:.3f} ms "
          f"({r['kernel_count']} kernels), weight roofline {roofline_ms:.3f} ms, bytes-moved roofline "
          f"{r.get('step_roofline_ms', float('nan')):.3f} ms")
    for n in sorted(r["nodes"], key=lambda n: -n["ms"])[:15]:
        gb = f"{n['GBps']:.0f} GB/s" if n["GBps"] else ""
        print(f"  {n['ms'] * 1e3:8.1f} us  {n['op']:<10} {n['layer']!s:>5} {gb:>10}  {n['name'][:70]}")
    for op, o in r["ops"].items():
        print(f"  {op:<10} {o['ms']:8.3f} ms  {o['count']:4d} nodes  {o['fraction_of_sum']:6.1%}")
    print("  by part: " + ", ".join(f"{p} {v['ms']:.3f} ms ({v['count']})" for p, v in r["parts"].items()))
    if b := r["layer_body"]:
        print(f"  layer body: median {b['median_ms']:.3f} ms (layer {b['median_layer']}, {b['kernels']} kernels), "
              f"min {b['min_ms']:.3f}, max {b['max_ms']:.3f} over {b['layers']} layers")


async def main(core: str, batches: list[int], launches: int, prefills: list[tuple[int, int]] = (),
               packs: list[tuple[int, int, int]] = ()) -> dict:
    m = load_manifest(core)
    ex = CudaExecutor(core, m)
    await ex.start()
    bw = copy_bandwidth(ex, m)
    weight_bytes = sum(b.nbytes for b in m.buffers if b.name.startswith("w."))
    roofline_ms = weight_bytes / bw * 1e3
    results = {"core": core, "device": ex.device.name, "meta": run_meta(m, ex), "slots_ask_logprobs": LOGPROBS,
               "launches": launches,
               "copy_bandwidth_Bps": bw,
               "weight_bytes": weight_bytes, "roofline_ms": roofline_ms, "batches": {}, "prefills": {}, "packs": {}}
    spans = _spans(m, ex.arena.base)
    for b in batches:
        if b not in m.capacities.decode_capacities:
            print(f"batch {b}: no decode.{b} in this core (capacities {m.capacities.decode_capacities}), skipped")
            continue
        results["batches"][str(b)] = r = profile(ex, m, _Decode(m, b), launches, spans)
        r["batch"] = b
        # What the step must move (bench.collect: routed experts as the batch reads them, the
        # embedding by rows, recurrent state): the roofline a mixture of experts is held to.
        r["step_bytes"] = step_bytes(m, b)
        r["step_roofline_ms"] = r["step_bytes"]["total"] / bw * 1e3
        _print(r, roofline_ms)
    runs = []  # built before any is timed: a bad request costs a line, not the run
    for kind, make, args in [*(("prefills", _Prefill, a) for a in prefills), *(("packs", _Pack, a) for a in packs)]:
        try:
            runs.append((kind, make(m, *args)))
        except ValueError as e:
            print(f"{kind} {args}: skipped, {e}")
    for kind, run in runs:
        if kind == "prefills":
            key, extra = f"{run.n}@{run.start}", {}
        else:
            key, extra = f"{run.left}@{run.start}+{run.decoders}", {"decoders": run.decoders, "left": run.left}
        results[kind][key] = r = profile(ex, m, run, launches, spans)
        r.update(tokens=run.n, history=run.start, **extra)
        _print(r, roofline_ms)
    results["executor_stats"] = ex.stats()
    await ex.close()
    assert "torch" not in sys.modules
    return results


def _prefills(arg: str) -> list[tuple[int, int]]:
    out = []
    for item in filter(None, arg.split(",")):
        n, _, start = item.partition("@")
        out.append((int(n), int(start or 0)))
    return out


def _packs(arg: str) -> list[tuple[int, int, int]]:
    out = []
    for item in filter(None, arg.split(",")):
        chunk, _, decoders = item.partition("+")
        (n, start), = _prefills(chunk)
        out.append((n, start, int(decoders or 0)))
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("core")
    ap.add_argument("out")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--prefills", default="", help="N@S,...: prefill programs of N new tokens after S in KV")
    ap.add_argument("--packs", default="", help="N@S+D,...: a prompt with N tokens left after S in KV, D decoders")
    ap.add_argument("--launches", type=int, default=20)
    a = ap.parse_args()
    res = asyncio.run(main(a.core, [int(x) for x in a.batches.split(",") if x], a.launches, _prefills(a.prefills),
                           _packs(a.packs)))
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
