"""The kernel benchmarks run end to end on the CPU (--smoke: Triton's interpreter, tiny
shapes) and every candidate that can run here reports no error and an accuracy within
its dtype's rounding (the GDN smoke runs in bfloat16, the experts in float32): the GPU
session spends its time measuring, not fixing scripts."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="triton is not installed")


@pytest.mark.parametrize("script, rel", [("bench/gdn_kernels.py", 2e-2), ("bench/moe_kernels.py", 1e-5),
                                         ("bench/attention_decode.py", 1e-5), ("bench/attention_prefill.py", 1e-5)])
def test_kernel_benchmark_smoke(script, rel, tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, script, "--smoke", "--out", str(out)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    ran = [r for r in results if not r.get("error")]
    errors = [r for r in results if r.get("error") and "fla not importable" not in r["error"]]
    assert ran and not errors, errors
    for r in ran:
        if r.get("max_abs_err") is not None:
            assert r["max_abs_err"] <= rel * max(r.get("out_scale") or 1.0, 1.0), r
        if r["name"].endswith(".segments"):  # decode attention with key segments: rows batch-invariant
            assert r["batch_invariant"], r
        if r["name"].endswith((".ours.full", ".ours.masked")):  # prompt attention: whole key blocks
            assert r["same_bits_as_default"], r  # unmasked or masked, the same bits


def test_prompt_attention_estimate_interpolates_each_chunk():
    """bench/attention_prefill.py's summary: a prompt's chunks each at the time
    interpolated in its history (dotted geometry names and candidates parsed whole)."""
    from bench.attention_prefill import prompt_estimates

    g = "llama-3.1-8b"
    rows = [{"name": f"{g}.h{h}.c2048.ours.{c}", "time_us": t * f} for h, t in ((0, 100.0), (4096, 300.0))
            for c, f in (("default", 1.0), ("full.r128.n64.w8.s3", 0.5))]
    rows.append({"name": f"{g}.h0.c2048.sdpa.cudnn", "error": "not run"})
    got = prompt_estimates(rows, {g: (32, 8, 128, 32)}, [0, 4096], 2048, 8192)
    # chunks after 0, 2,048, 4,096 and 6,144 tokens: 100 + 200 + 300 + 400 us a layer, 32 layers
    assert got == {f"{g}.ours.default": dict(attention_s=0.032, layers=32, prompt=8192, chunk=2048),
                   f"{g}.ours.full.r128.n64.w8.s3": dict(attention_s=0.016, layers=32, prompt=8192, chunk=2048)}
