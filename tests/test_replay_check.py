"""Replay qualification on the CPU: the reference executor (shared-memory arena, torch
worker) reproduces preparation's golden digests bit for bit, and a wrong digest is
reported as a mismatch (the check can fail)."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys

import pytest

from tests.conftest import HYBRID_OPTS, QUALIFIED


# (llama-tiny's own replays: test_a_wrong_digest_is_a_mismatch below replays every program and
# set of that core, and all but the one digest it breaks must match; llama-tiny-pack's core
# holds the same programs and more, replayed here in a worker without torch.)
@pytest.mark.parametrize("model", sorted(set(QUALIFIED) - {"llama-tiny"}))
def test_reference_executor_reproduces_golden_replays(model):
    core = QUALIFIED[model]()
    proc = subprocess.run([sys.executable, "-m", "flare.runtime.replay_check", str(core), "reference"],
                          capture_output=True, text=True, timeout=300)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert report["all_bitwise_equal"] and report["mismatches"] == []
    assert not report["torch_imported"]
    names = {p["name"] for p in json.loads((core / "manifest.json").read_text())["programs"]}
    assert set(report["programs"]) == names
    assert {"resume.1", "snapshot.1", "restore.1"} <= names
    assert all(v["sets"] == 3 for v in report["programs"].values())
    assert ("pack.64" in names) == ("verify.8" in names) == (model == "llama-tiny-pack")
    assert ("verify.4" in names) == (model in ("llama-tiny-pack", "qwen3_5-tiny"))


def test_pack_programs_are_refused_for_recurrent_models(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "flare.prepare.cli", "qwen3_5-tiny", "--out", str(tmp_path / "c"),
                           *HYBRID_OPTS, "--pack-capacities", "64"], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "recurrent state" in proc.stderr + proc.stdout, proc.stderr[-2000:]
    assert not (tmp_path / "c" / "manifest.json").exists()


def test_golden_replays_see_the_checkpoint_copies():
    """The digests cover the snapshot buffers: each snapshot set changes its row of every
    continuation twin and of the tail buffer, and each restore set changes the slot's
    continuation rows (a replay that copied nothing could not match)."""
    core = QUALIFIED["qwen3_5-tiny"]()
    golden = json.loads((core / "qualification.json").read_text())
    base = golden["resume.1"][0]  # resume writes none of the buffers compared here
    for s in golden["snapshot.1"]:
        for name in ("snap.state.hidden", "snap.state.gdn.conv", "snap.state.gdn.recurrent", "snap.kv_tail"):
            assert s[name] != base[name], name
    for s in golden["restore.1"]:
        for name in ("state.hidden", "state.gdn.conv", "state.gdn.recurrent", "state.len"):
            assert s[name] != base[name], name


def test_a_wrong_digest_is_a_mismatch(tmp_path):
    core = QUALIFIED["llama-tiny"]()
    bad = tmp_path / "core"
    shutil.copytree(core, bad)
    golden = json.loads((bad / "qualification.json").read_text())
    golden["decode.2"][1]["state.counter"] = "0" * 32
    (bad / "qualification.json").write_text(json.dumps(golden))
    from flare.runtime.replay_check import check

    report = asyncio.run(check(bad, "reference"))
    assert not report["all_bitwise_equal"]
    # Every other program and set of the core replays bit for bit.
    assert report["mismatches"] == [{"program": "decode.2", "set": 1, "buffers": ["state.counter"]}]
    names = {p["name"] for p in json.loads((core / "manifest.json").read_text())["programs"]}
    assert set(report["programs"]) == names and {"resume.1", "snapshot.1", "restore.1"} <= names
    assert all(v["sets"] == 3 for v in report["programs"].values())
