"""The serving process never imports torch or transformers (design: the runtime
boundary). Checked on a fresh interpreter and on a live server after it has
served requests and shut down."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest

from tests.conftest import QUALIFIED, ROOT, running_server

SERVING_MODULES = ("flare.core.manifest", "flare.runtime.engine", "flare.runtime.reference",
                   "flare.runtime.scheduler", "flare.server.app", "flare.server.cli",
                   "flare.runtime.cuda_executor", "flare.runtime.cuda_tp")


def forbidden(modules) -> list[str]:
    return sorted(m for m in modules if m.split(".")[0] in ("torch", "transformers")
                  or m.startswith("transformers"))


def imported_by(*modules: str) -> tuple[list[str], str]:
    code = ("import json, sys\n" + "".join(f"import {m}\n" for m in modules)
            + "import flare\nprint(json.dumps([flare.__file__, sorted(sys.modules)]))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    origin, mods = json.loads(out.stdout)
    return mods, origin


def test_serving_modules_import_no_torch():
    mods, origin = imported_by(*SERVING_MODULES)
    assert origin.startswith(str(ROOT / "src"))  # this worktree's code, not another install
    assert all(m in mods for m in SERVING_MODULES)
    assert forbidden(mods) == []


def test_the_check_detects_torch():
    # Positive control: the preparation side does import torch, and the check sees it.
    mods, _ = imported_by("flare.prepare.sampling")
    assert "torch" in forbidden(mods)


@pytest.mark.parametrize("core", ["tiny_core", "hybrid_core", "qwen3_5-moe-tiny"])
def test_live_server_never_imports_torch(core, request, tmp_path):
    """Dense, hybrid, and hybrid with routed experts alike. Also checks the shutdown that writes the report is complete: SIGTERM ends the
    process with status 0 after the executor removed its shared arena file."""
    report = tmp_path / "modules.json"
    shm = tmp_path / "shm"
    shm.mkdir()
    env = {"FLARE_MODULES_REPORT": str(report), "FLARE_SHM_DIR": str(shm)}
    path = QUALIFIED[core]() if core == "qwen3_5-moe-tiny" else request.getfixturevalue(core)  # (HYBRID_OPTS)
    with running_server(path, env=env) as srv:
        assert [p.name[:12] for p in shm.iterdir()] == ["flare-arena-"]
        model = httpx.get(srv.url + "/v1/models").json()["data"][0]["id"]
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
            "model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 5, "seed": 1})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        r = httpx.post(srv.url + "/v1/completions", timeout=60, json={
            "model": model, "prompt": "Once upon a time", "max_tokens": 5, "stream": True})
        assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
        assert not report.exists()  # written at exit only
    assert srv.proc.returncode == 0, srv.output()
    assert list(shm.iterdir()) == []
    mods = json.loads(report.read_text())
    assert isinstance(mods, list) and len(mods) > 100
    # The report really comes from the serving process after it served.
    for m in ("flare.server.app", "flare.runtime.reference", "flare.runtime.scheduler", "uvicorn", "starlette"):
        assert m in mods
    assert forbidden(mods) == []
