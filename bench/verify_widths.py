"""A verify step's GPU cost by width at a deep model's per-layer geometry, from reduced-depth
cores (CUDA; issue 20: the verify programs' time against decode.1 for W = 2..6 on the 8B
shape, so the speed-up at a given acceptance is known for large models).

usage: python -m bench.verify_widths CONFIG OUT.json [--depths 4,8] [--drafts 1,2,3,4,5]
                                     [--jobs 5] [--steps 100]

A verify width is a core-wide constant (``flare-prepare --draft-tokens D``: W = D + 1), and a
full-depth 8B core per width would not fit the GPU machine's disk and time. So for each depth
L of ``--depths`` and each D of ``--drafts`` this writes CONFIG (a name from ``configs/``)
with ``num_hidden_layers = L`` into a scratch configs directory (``FLARE_CONFIGS``), prepares
it on the GPU with decode.1, one 128-row prefill program and verify.1 only (``--jobs``
preparations at a time: their kernel choices are timed on a shared GPU, as in the GPU
suite's parallel preparations), and times decode.1 and verify.1 with ``bench.floor``. A program's
time is a + b L (the layers, then the embedding, head and sampler), so two depths give a and
b exactly; the full-depth time is a + b N at the config's own N layers. The JSON holds every
core's times, the fits and, per width, the full-depth verify.1 against decode.1.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def with_depth(text: str, layers: int) -> str:
    """A config's TOML text with its ``num_hidden_layers`` set to ``layers``."""
    lines = text.splitlines()
    hits = [i for i, line in enumerate(lines) if line.split("=")[0].strip() == "num_hidden_layers"]
    if len(hits) != 1:
        raise SystemExit(f"the config names num_hidden_layers {len(hits)} times; expected once")
    lines[hits[0]] = f"num_hidden_layers = {layers}"
    return "\n".join(lines) + "\n"


def fit(times: dict[int, float], full: int) -> dict:
    """a + b L through the (depth, ms) points (least squares: exact for two), at ``full``."""
    xs, ys = list(times), list(times.values())
    if len(set(xs)) < 2:
        raise ValueError("a fit needs two depths")
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var
    a = my - b * mx
    return {"ms_fixed": a, "ms_per_layer": b, "ms_full_depth": a + b * full}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("config")
    p.add_argument("out")
    p.add_argument("--depths", default="4,8")
    p.add_argument("--drafts", default="1,2,3,4,5")
    p.add_argument("--jobs", type=int, default=5)
    p.add_argument("--steps", type=int, default=100)
    a = p.parse_args(argv)
    depths = list(dict.fromkeys(int(x) for x in a.depths.split(",")))
    drafts = [int(x) for x in a.drafts.split(",")]
    src = ROOT / "configs" / f"{a.config}.toml"
    full = int(tomllib.loads(src.read_text())["model"]["num_hidden_layers"])
    work = Path(tempfile.mkdtemp(prefix="verify-widths-"))
    configs = work / "configs"
    configs.mkdir()
    (configs / "tokenizers").symlink_to(ROOT / "configs" / "tokenizers")
    env = {**os.environ, "FLARE_CONFIGS": str(configs), "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "src"), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    cores = {}
    for layers in depths:
        name = f"{a.config}-{layers}l"
        (configs / f"{name}.toml").write_text(with_depth(src.read_text(), layers))
        for d in drafts:
            cores[(layers, d)] = (name, work / f"{name}-d{d}")

    def prepare(key) -> None:
        name, out = cores[key]
        log = out.parent / f"{out.name}.prepare.txt"  # (with_suffix would cut at "3.1" of a name)
        cmd = [sys.executable, "-m", "flare.prepare.cli", name, "--out", str(out), "--device", "cuda",
               "--draft-tokens", str(key[1]), "--decode-capacities", "1", "--prefill-chunk-size", "128",
               "--context-limit", "2048", "--kv-memory", "1"]
        with open(log, "w") as f:
            if subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env).returncode:
                raise SystemExit(f"flare-prepare {name} --draft-tokens {key[1]} failed: {log.read_text()[-3000:]}")

    # One depth at a time: its cores are prepared side by side, timed one after the other,
    # then deleted (ten full-vocabulary cores at once would not fit the GPU machine's disk).
    runs = {}
    try:
        for depth in depths:
            keys = [key for key in cores if key[0] == depth]
            with ThreadPoolExecutor(a.jobs) as pool:
                list(pool.map(prepare, keys))
            for layers, d in keys:
                name, out = cores[(layers, d)]
                floor = work / f"{out.name}.floor.json"
                subprocess.run([sys.executable, "-m", "bench.floor", str(out), str(floor), str(a.steps),
                                "--decode-only"], check=True, env=env, stdout=subprocess.DEVNULL)
                shutil.rmtree(out)
                r = json.loads(floor.read_text())
                runs[f"L{layers}-D{d}"] = {"layers": layers, "drafts": d, "width": d + 1,
                                           "decode_1_ms": r["decode"]["1"]["gpu_ms_per_step"],
                                           "verify_1_ms": r["verify"]["1"]["gpu_ms_per_step"]}
    finally:  # a failed preparation or timing leaves nothing on the disk
        shutil.rmtree(work, ignore_errors=True)
    decode = fit({L: statistics.mean(r["decode_1_ms"] for r in runs.values() if r["layers"] == L)
                  for L in depths}, full)
    widths = {}
    for d in drafts:
        v = fit({r["layers"]: r["verify_1_ms"] for r in runs.values() if r["drafts"] == d}, full)
        widths[d + 1] = {**v, "over_decode_full_depth": v["ms_full_depth"] / decode["ms_full_depth"]}
        print(f"W={d + 1}: verify.1 {v['ms_full_depth']:.3f} ms at {full} layers, "
              f"{widths[d + 1]['over_decode_full_depth']:.2f}x decode.1 ({decode['ms_full_depth']:.3f} ms)", flush=True)
    report = {"config": a.config, "full_depth_layers": full, "depths": depths, "cores": runs,
              "decode_1": decode, "verify_1_by_width": widths,
              "machine": {"host": platform.node(), "python": platform.python_version()},
              "command": "python -m bench.verify_widths " + " ".join(sys.argv[1:] if argv is None else argv)}
    Path(a.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
