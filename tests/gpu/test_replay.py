"""Exported graphs replayed by the torch-free runtime equal preparation's in-process
torch replay bit for bit, for every program and capacity on three input sets."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.gpu.conftest import record


def test_runtime_replay_is_bitwise_equal(gpu_shape_core, results_dir):
    model, core = gpu_shape_core
    proc = subprocess.run([sys.executable, "-m", "flare.runtime.replay_check", str(core)],
                          capture_output=True, text=True, timeout=600)
    assert proc.stdout.strip(), proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    prep = json.loads((core / "prepare_report.json").read_text())
    record(results_dir, "qualification", {model: {"replay": report, "prepare": prep}})
    assert not report["torch_imported"]
    assert report["mismatches"] == []
    assert report["all_bitwise_equal"]
    names = {p.name for p in __import__("flare.core.manifest", fromlist=["x"]).load_manifest(core).programs}
    assert set(report["programs"]) == names
    stats = report["executor_stats"]
    assert stats["allocations_after_ready"] == 0
    assert stats["module_loads_after_ready"] == 0
    assert stats["instantiations_after_ready"] == 0
    assert stats["device_free_now"] == stats["device_free_at_ready"]
