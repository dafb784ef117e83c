"""The serving benchmark client, every scenario at tiny sizes, against a live CPU flare-serve.

It checks what the JSON says, not how fast: fields present, counts exact, cold
prompts cold, cached prefixes reported cached, sizes over the context limit
skipped with the reason.
"""

from __future__ import annotations

import itertools
import json
import statistics
import subprocess
import sys

import httpx

from tests.conftest import ROOT

PREFIX = 32


def test_all_scenarios_at_tiny_sizes(smol_server, tmp_path):
    model = httpx.get(smol_server.url + "/v1/models").json()["data"][0]["id"]
    out = tmp_path / "serve.json"
    subprocess.run([sys.executable, "-m", "bench.serve_bench", smol_server.url, model, str(out),
                    "--scenarios", "decode,cold,prefill,prefix,agent,interference,arrivals,rewrite", "--tokens", "8",
                    "--concurrency", "1,2", "--cold-prompts", "32", "--prefill-prompts", "32,4096",
                    "--prefix-tokens", str(PREFIX), "--short-prompt", "16", "--agent-turns", "3",
                    "--agent-tokens", "8", "--agent-result-items", "2", "--interference-decoders", "1",
                    "--interference-tokens", "24", "--interference-after", "4", "--interference-prompt", "96",
                    "--rewrite-items", "2", "--rewrite-tokens", "6", "--repeats", "1", "--decode-rounds", "2"],
                   cwd=ROOT, check=True, timeout=240)
    r = json.loads(out.read_text())

    for mode in ("sampled", "greedy"):
        (run,) = r["rewrite"][mode]["raw"]
        assert run["tokens"] == 6 and run["prompt_tokens"] > 60 and r["rewrite"][mode]["decode_tokens_per_s"] > 0
    assert r["model"] == model and r["sampling"] == {"temperature": 1.0, "top_p": 0.95, "top_k": 20}
    assert r["machine"]["versions"]["httpx"] and r["machine"]["python"]
    assert (r["options"]["context_limit"], r["options"]["limit_source"]) == (2048, "/v1/models max_model_len")
    assert r["server_models"]["data"][0]["max_model_len"] == 2048

    for c in (1, 2):
        d = r["concurrency"][str(c)]
        assert [run["tokens"] for run in d["raw"]] == [8] * (2 * c)  # two rounds of c stories
        assert all(len(run["gaps_s"]) == 7 and run["ttft_s"] > 0 for run in d["raw"])
        assert d["decode_tokens_per_s"] == statistics.median(d["rounds_tokens_per_s"]) > 0
        assert 0 < d["itl_s_p50"] <= d["itl_s_p99"]
    # What each scenario made the server do: decode's 2 x (1 + 2) stories of 8 tokens.
    counted = r["server_counters_by_scenario"]
    assert counted["decode"]["flare_generation_tokens_total"] == 2 * 3 * 8
    assert set(counted) == set(r["scenarios"]) and counted["cold"]["flare_generation_tokens_total"] == 1

    cold = r["cold_ttft"]["32"]
    assert cold["ttft_s"] > 0 and cold["cached_tokens"] == [0]

    assert r["prefill"]["32"]["cached_tokens"] == [0] and r["prefill"]["32"]["prefill_tokens_per_s"] > 0
    assert r["prefill"]["4096"]["skipped"] is True
    assert "context limit of 2048" in r["prefill"]["4096"]["reason"]

    # Checkpoints sit at exact endpoints (docs/prefix-cache.md): the prompt endpoint of
    # the warming request is the whole prefix.
    p = r["prefix"]
    assert all(n >= PREFIX for n in p["cached_tokens"]), p["cached_tokens"]
    assert [run["prompt_tokens"] for run in p["raw_hit"]] == [PREFIX + 11]
    assert [run["cached_tokens"] for run in p["raw_cold_short"]] == [0]
    assert p["hit_ttft_s"] > 0 and p["ratio"] == p["hit_ttft_s"] / p["cold_short_ttft_s"]

    turns = r["agent"]["turns"]
    assert [t["turn"] for t in turns] == [0, 1, 2, 3]
    assert turns[0]["cached_tokens"] == 0
    for prev, t in itertools.pairwise(turns):
        # Each turn's prompt extends the last one, whose prompt endpoint was captured.
        assert prev["prompt_tokens"] <= t["cached_tokens"] < t["prompt_tokens"], (prev, t)
    assert all(t["ttft_s"] > 0 and t["completion_tokens"] == 8 for t in turns)

    a = r["arrivals"]
    assert len(a["raw_together_ttft_s"]) == 1 and len(a["raw_together_ttft_s"][0]) == 4
    assert a["cached_tokens"] == [0] * 5 and a["last_over_lone"] == a["last_ttft_s"] / a["lone_ttft_s"] > 0

    i = r["interference"]
    assert i["long_cached_tokens"] == 0 and i["prefill_window_s"] > 0
    assert i["itl_before"]["count"] >= 3 and i["itl_during"]["count"] >= 1
    assert i["itl_during"]["max_ms"] >= i["itl_during"]["p50_ms"] > 0


def test_ab_serve_runs_two_configurations_of_one_core(tmp_path):
    """bench.ab_serve: the same scenarios against flare-serve without and with
    --decode-with-prefill on a core with pack programs; both runs complete, every prompt
    cold, the options recorded."""
    from tests.conftest import TINY_OPTS, prepare_core

    core = prepare_core("llama-tiny", [*TINY_OPTS, "--pack-capacities", "64"], name="llama-tiny-pack")
    out = tmp_path / "ab.json"
    subprocess.run([sys.executable, "-m", "bench.ab_serve", str(core), str(out), "--b=--decode-with-prefill", "--",
                    "--scenarios", "arrivals,interference", "--tokens", "8", "--interference-decoders", "2",
                    "--interference-tokens", "40", "--interference-after", "4", "--interference-prompt", "300",
                    "--repeats", "1"], cwd=ROOT, check=True, timeout=300)
    r = json.loads(out.read_text())
    assert (r["a"]["serve_options"], r["b"]["serve_options"]) == ("", "--decode-with-prefill")
    # Both servers got the same prompts: one salt, not one per run.
    assert r["a"]["results"]["options"]["salt"] == r["b"]["results"]["options"]["salt"]
    for key in ("a", "b"):
        res = r[key]["results"]
        assert res["arrivals"]["cached_tokens"] == [0] * 5 and res["arrivals"]["last_ttft_s"] > 0
        assert res["interference"]["itl_during"]["count"] >= 1
