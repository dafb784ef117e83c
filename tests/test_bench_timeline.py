"""The timeline's graph handling and attribution, and the report built from it.

bench/timeline.py runs on the GPU; its pure parts are checked here: node order
from edges, pointer attribution from kernel parameters (including pointers
inside a by-value struct, as library GEMMs pass them), the per-layer rule for
kernels without weights, operator classes, and the startup figures collect.py
reads from a run's files.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("cuda.bindings")

from bench import timeline as T
from bench.collect import startup
from bench.kernel_parts import op_of
from bench.report import timeline_section
from flare.core import graph as G

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"


def _kernel(params: bytes, layout) -> G.KernelNode:
    return G.KernelNode(function=0, grid=(1, 1, 1), block=(32, 1, 1), shared_bytes=0, params=params,
                        param_layout=tuple(layout), attributes=())


def test_order_follows_edges_and_keeps_spec_order_among_ready_nodes():
    nodes = tuple(G.EmptyNode() for _ in range(5))
    spec = G.GraphSpec(program="p", nodes=nodes, edges=(G.Edge(src=3, dst=0), G.Edge(src=0, dst=1),
                                                         G.Edge(src=4, dst=2)))
    assert T._order(spec) == [3, 0, 1, 4, 2]
    with pytest.raises(ValueError, match="cycle"):
        T._order(G.GraphSpec(program="p", nodes=nodes[:2], edges=(G.Edge(src=0, dst=1), G.Edge(src=1, dst=0))))


def test_pointers_are_found_in_scalars_and_inside_structs():
    base = 0x6000_0000_0000
    spans = [(base, base + 4096, "w.model.layers.3.mlp.up_proj.weight"), (base + 4096, base + 8192, "kv")]
    starts = [s for s, _, _ in spans]
    # A scalar pointer into kv, an int that points nowhere, and a 24-byte struct whose
    # second word points into the weight.
    params = ((base + 5000).to_bytes(8, "little") + (7).to_bytes(8, "little")
              + (1).to_bytes(8, "little") + (base + 16).to_bytes(8, "little") + bytes(8))
    node = _kernel(params, [(0, 8), (8, 8), (16, 24)])
    assert T._touched(node, spans, starts) == ["kv", "w.model.layers.3.mlp.up_proj.weight"]


def test_kernels_without_weights_take_the_layer_around_them():
    rows = [{"layer": None}, {"layer": 0}, {"layer": None}, {"layer": 1}, {"layer": None}]
    T.fill_layers(rows)
    assert [r["layer"] for r in rows] == ["head", 0, 0, 1, "tail"]


def test_parts_of_a_routed_layer_follow_the_weights_read():
    from bench.kernel_parts import part_of

    names = [["w.model.layers.0.input_layernorm.weight"], ["w.model.layers.0.self_attn.qkv_proj.weight"], [],
             ["w.model.layers.0.mlp.gate.weight"], [], [], ["w.model.layers.0.mlp.experts.gate_up_proj"],
             ["w.model.layers.0.mlp.experts.down_proj"], [],
             ["w.model.layers.0.mlp.shared_expert.gate_up_proj.weight"],
             ["w.model.layers.0.mlp.shared_expert_gate.weight"], ["w.model.layers.1.linear_attn.in_proj.weight"],
             ["w.lm_head.weight"], []]
    rows = [{"layer": 0 if w and "layers" in w[0] else None, "part": part_of(w)} for w in names]
    rows[2]["layer"] = rows[4]["layer"] = rows[5]["layer"] = rows[8]["layer"] = 0
    T.fill_layers(rows)
    assert [r["part"] for r in rows] == ["norm", "attention", "attention", "router", "router", "router", "experts",
                                         "experts", "experts", "shared_expert", "shared_expert", "gdn", "head",
                                         "other"]
    # A decode step's router GEMV (the shared expert's gate in its launch) and folded experts.
    assert part_of(["w.model.layers.2.mlp.gate.weight", "w.model.layers.2.mlp.shared_expert_gate.weight"]) == "router"
    assert part_of(["w.model.layers.2.mlp.experts.gate_up_proj",
                    "w.model.layers.2.mlp.shared_expert.gate_up_proj.weight"]) == "experts"


def test_operator_classes():
    assert op_of("nvjet_sm90_tst_64x8_64x16_2x1_v_bz_splitK_TNT") == "matmul"
    assert op_of("_ZN8cublasLt19splitKreduce_kernelILi32ELi16Eif13__nv_bfloat16") == "splitk_reduce"
    assert op_of("_attend_kernel") == op_of("_combine_kernel") == "attention"
    assert op_of("_write_kv_kernel") == "kv_write"
    assert op_of("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0") == "norm"
    assert op_of("triton_poi_fused__unsafe_view_mul_silu_1") == "mlp_act"
    assert op_of("triton_poi_fused__unsafe_view_add_2") == "compiled_other"
    assert op_of("_ZN2at6native29vectorized_elementwise_kernelILi2ENS0_13BinaryFunctorIlll") == "eager_other"


def test_committed_timeline_renders_and_adds_up():
    path = RESULTS / "timeline-llama-3.1-8b-shape-2026-11-29.json"
    t = json.loads(path.read_text())
    text = "\n".join(timeline_section(t, path.name))
    for b, r in t["batches"].items():
        s = T._summary(r["nodes"])
        assert s["timed_sum_ms"] == pytest.approx(r["timed_sum_ms"])
        assert sum(o["count"] for o in s["ops"].values()) == len(r["nodes"])
        assert sum(v["count"] for v in s["layers"].values()) == len(r["nodes"])
        assert f"**decode.{b}**: graph {r['graph_ms']:.3f} ms" in text
        for op, o in r["ops"].items():
            assert f"| {op} | {o['count']} | {o['ms']:.3f} |" in text
    assert "| lm_head | 1 |" in text


def test_prefill_runs_pick_the_schedulers_program_and_fit_the_slot(tiny_core):
    from flare.core.manifest import load_manifest

    assert T._prefills("16@0,2048@61440,11") == [(16, 0), (2048, 61440), (11, 0)]
    m = load_manifest(tiny_core)
    c, ps = m.capacities, m.pages.page_size
    short = T._Prefill(m, 16, 0)
    assert (short.program, short.start) == (f"prefill.{min(x for x in c.prefill_capacities if x >= 16)}", 0)
    staged = {name: (value, row) for name, value, row in short.writes}
    assert int(staged["state.len"][0]) == 0 and staged["state.len"][1] == 1
    # A history deeper than slot 1's pages (or the context) is cut to the deepest that leaves a whole chunk.
    deep = T._Prefill(m, c.prefill_chunk, 1 << 20)
    pages = min((m.pages.num_pages - 1) // c.slots, c.max_pages_per_slot)
    assert deep.program == f"prefill.{c.prefill_chunk}" and deep.start % ps == 0
    assert 0 < deep.start <= min(pages * ps - max(c.prefill_capacities), c.context_limit - c.prefill_chunk)
    with pytest.raises(ValueError, match="largest prefill"):
        T._Prefill(m, max(c.prefill_capacities) + 1, 0)


def test_a_pack_run_places_the_chunk_and_the_decode_rows_as_the_scheduler_does():
    from flare.core import interface as io
    from flare.core.manifest import load_manifest
    from flare.runtime import packing
    from tests.conftest import TINY_OPTS, prepare_core

    m = load_manifest(prepare_core("llama-tiny", [*TINY_OPTS, "--pack-capacities", "64"], name="llama-tiny-pack"))
    c = m.capacities
    assert T._packs("40@32+3,8+1") == [(40, 32, 3), (8, 0, 1)]
    # A prompt with 100 tokens left after 32 beside three decoders: the scheduler's plan cuts
    # the chunk to the whole tiles the decoders leave, and it does not sample (more is left).
    run = T._Pack(m, 100, 32, 3)
    capacity, (n,) = packing.plan([packing.Chunk(100, True)], 3, list(c.pack_capacities), c.pack_align,
                                  c.decode_capacities[-1])
    assert (run.program, run.n, run.start, run.left) == (f"pack.{capacity}", n, 32, 100) and n % c.pack_align == 0
    w = {(name, row): value for name, value, row in run.writes}
    assert int(w["state.len", 1]) == 32 and all(int(w["state.len", s]) == 16 for s in (2, 3, 4))
    starts, _ = packing.layout([(n, True), (1, False), (1, False), (1, False)], c.pack_align)
    table, tokens = w[io.PACK_INPUT, None], w[io.TOKENS, None]
    assert [tuple(r) for r in table[:4]] == [(1, n, 0, starts[0])] + [(s, 1, 1, starts[s - 1]) for s in (2, 3, 4)]
    assert not table[4:].any() and len(tokens) == capacity
    assert [int(tokens[starts[s - 1]]) for s in (2, 3, 4)] == [102, 103, 104]  # their pending tokens
    assert (tokens[starts[0]:starts[0] + n] >= 1000).all()
    # A cold prompt that fits whole samples after its last token.
    whole = T._Pack(m, 20, 0, 2)
    assert whole.n == 20 and tuple(dict(((k, r), v) for k, v, r in whole.writes)[io.PACK_INPUT, None][0])[:3] == (1, 20, 1)
    with pytest.raises(ValueError, match="no pack"):
        T._Pack(m, 100, 32, max(c.decode_capacities))  # no row left for a chunk


def test_a_prefill_profile_renders_beside_the_decode_steps():
    path = RESULTS / "timeline-llama-3.1-8b-shape-2026-11-29.json"
    t = json.loads(path.read_text())
    r = dict(t["batches"]["1"], program="prefill.128", tokens=16, history=4096)
    for k in ("step_bytes", "step_roofline_ms"):
        r.pop(k, None)
    pack = dict(r, program="pack.256", tokens=192, decoders=3, left=4096)
    text = "\n".join(timeline_section({**t, "prefills": {"16@4096": r}, "packs": {"4096@4096+3": pack}}, path.name))
    assert f"**prefill.128, 16 tokens after 4096**: graph {r['graph_ms']:.3f} ms a launch" in text
    assert "**pack.256, 192 tokens after 4096 and 3 decode rows**: graph" in text
    assert f"**decode.1**: graph {t['batches']['1']['graph_ms']:.3f} ms per step" in text


def test_startup_figures_from_a_runs_files(tmp_path):
    (tmp_path / "serve-m.log").write_text("x INFO flare.serve: ready in 5.07 s: serving m on http://h\n")
    (tmp_path / "startup-m.txt").write_text("# HELP a\nflare_executor_startup_arena_upload_ms 3008\n"
                                           "flare_executor_startup_graph_build_ms 400\n")
    (tmp_path / "prepare_time-m.txt").write_text("prepare_s 120\n")
    st = startup(tmp_path, "m")
    assert st == {"ready_s": 5.07, "arena_upload_ms": 3008.0, "graph_build_ms": 400.0, "prepare_s": 120.0,
                  "ready_minus_upload_s": pytest.approx(2.062)}
    assert startup(tmp_path / "missing", "m") == {}
    # Since process start where the log says it (the interpreter's start and imports included).
    (tmp_path / "serve-m.log").write_text("x INFO flare.serve: ready in 1.50 s (1.93 s after process start): "
                                          "serving m on http://h\n")
    st = startup(tmp_path, "m")
    assert (st["ready_s"], st["ready_since_serve_s"]) == (1.93, 1.50)
    assert st["ready_minus_upload_s"] == pytest.approx(1.93 - 3.008)


def test_host_gaps_from_a_servers_metrics(tmp_path):
    from bench.collect import host_gaps

    (tmp_path / "m.txt").write_text("# TYPE flare_engine_steps_total counter\nflare_engine_steps_total 400\n"
                                    "flare_engine_steps_ahead_total 380\nflare_engine_host_gap_seconds_total 0.02\n"
                                    "flare_engine_host_gaps_total 20\nflare_engine_ready 1\n")
    assert host_gaps(tmp_path / "m.txt") == {"gaps": 20, "seconds_total": 0.02, "mean_ms": pytest.approx(1.0),
                                             "steps": 400, "steps_ahead": 380}
    assert host_gaps(tmp_path / "missing.txt") is None


def test_program_times_table():
    from bench.report import program_lines

    p = {"history_tokens": 4096, "tail_tokens": 11, "short_tokens": 16,
         "admit": {"program": "admit.2048", "gpu_ms": 0.05}, "restore": {"program": "restore.1", "gpu_ms": 0.02},
         "prefill_cold_short": {"program": "prefill.128", "gpu_ms": 6.0},
         "prefill_hit_tail": {"program": "prefill.128", "gpu_ms": 6.5}}
    text = "\n".join(program_lines(p))
    assert "| prefill of 11 tokens after 4096 cached | `prefill.128` | 6.500 |" in text
    assert "prefix hit 6.57 ms (admit + restore + prefill), cold short prompt 6.05 ms" in text
    assert "resume" not in text and program_lines(None) == []
