"""flare-serve on the GPU: the CUDA executor behind the real HTTP server."""

from __future__ import annotations

import concurrent.futures
import json
import time

import httpx
import pytest

from tests.conftest import running_server, scrape_metrics
from tests.gpu.conftest import SHAPES, gpu_core, record

MODELS = [m for m in ["llama-3.2-1b-shape", "qwen3_5-small-shape", "qwen3-moe-small-shape",
                      "qwen3_5-moe-small-shape", "qwen3-next-small-shape"] if m in SHAPES]


def _stream(url: str, i: int, n: int, model: str) -> dict:
    body = {"model": f"{model}-gpu", "prompt": f"Request number {i}: the quick brown fox", "max_tokens": n,
            "stream": True, "ignore_eos": True, "seed": i, "stream_options": {"include_usage": True}}
    chunks, finish, usage, t0, first = [], None, None, time.perf_counter(), None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            ev = json.loads(data)
            if ev.get("usage"):
                usage = ev["usage"]
            for c in ev["choices"]:
                if c["text"]:
                    first = first or time.perf_counter()
                    chunks.append(c["text"])
                finish = c["finish_reason"] or finish
    return {"text": "".join(chunks), "finish": finish, "usage": usage, "ttft_s": (first or t0) - t0,
            "total_s": time.perf_counter() - t0}


@pytest.mark.parametrize("MODEL", MODELS)
def test_four_concurrent_streams_and_no_allocation_after_ready(results_dir, MODEL):
    core = gpu_core(MODEL)
    t0 = time.perf_counter()
    with running_server(core) as srv:
        ready_s = time.perf_counter() - t0
        before = scrape_metrics(srv.url)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda i: _stream(srv.url, i, 64, MODEL), range(4)))
        again = _stream(srv.url, 9, 16, MODEL)
        after = scrape_metrics(srv.url)
    for r in results:
        assert r["finish"] == "length"
        assert r["usage"]["completion_tokens"] == 64
    assert again["usage"]["completion_tokens"] == 16
    for key in ("allocations_after_ready", "module_loads_after_ready", "instantiations_after_ready"):
        assert after[f"flare_executor_{key}"] == 0, key
    assert after["flare_executor_device_free_now"] == before["flare_executor_device_free_at_ready"]
    assert after["flare_kv_pages_used"] == 0 and after["flare_requests_running"] == 0
    # No snapshot row leaked: every row is free or holds a published checkpoint.
    assert (after["flare_prefix_cache_snapshot_rows_free"] + after["flare_prefix_cache_checkpoints"]
            == after["flare_prefix_cache_snapshot_rows_total"])
    startup = {k.removeprefix("flare_executor_"): v for k, v in after.items() if "startup_" in k}
    record(results_dir, "qualification", {f"{MODEL}-serve": {
        "concurrent_streams": 4, "tokens_each": 64, "results": results, "process_ready_s": ready_s,
        "executor_startup_ms": startup, "launches": after["flare_executor_launches"],
        "device_free_bytes_at_ready": after["flare_executor_device_free_at_ready"],
        "device_free_bytes_after": after["flare_executor_device_free_now"]}})
