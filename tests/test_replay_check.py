"""Replay qualification on the CPU: the reference executor (shared-memory arena, torch
worker) reproduces preparation's golden digests bit for bit, and a wrong digest is
reported as a mismatch (the check can fail)."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys

from tests.conftest import TINY_OPTS, prepare_core


def test_reference_executor_reproduces_golden_replays():
    core = prepare_core("llama-tiny", [*TINY_OPTS, "--qualify", "2"], name="llama-tiny-qualified")
    proc = subprocess.run([sys.executable, "-m", "flare.runtime.replay_check", str(core), "reference"],
                          capture_output=True, text=True, timeout=300)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert report["all_bitwise_equal"] and report["mismatches"] == []
    assert not report["torch_imported"]
    names = {p["name"] for p in json.loads((core / "manifest.json").read_text())["programs"]}
    assert set(report["programs"]) == names
    assert all(v["sets"] == 2 for v in report["programs"].values())


def test_a_wrong_digest_is_a_mismatch(tmp_path):
    core = prepare_core("llama-tiny", [*TINY_OPTS, "--qualify", "2"], name="llama-tiny-qualified")
    bad = tmp_path / "core"
    shutil.copytree(core, bad)
    golden = json.loads((bad / "qualification.json").read_text())
    golden["decode.2"][1]["state.counter"] = "0" * 32
    (bad / "qualification.json").write_text(json.dumps(golden))
    from flare.runtime.replay_check import check

    report = asyncio.run(check(bad, "reference"))
    assert not report["all_bitwise_equal"]
    assert report["mismatches"] == [{"program": "decode.2", "set": 1, "buffers": ["state.counter"]}]
