"""Decode GPU time of two cores of one model, measured alternately in one run: what a
preparation option costs a decode step (``--max-logprobs 0`` against the default 20 for
issue 18's "at most 2 %", or any other pair).

usage: python -m bench.ab_decode CORE_A CORE_B OUT.json [--rounds 5] [--steps 200]

Each round runs ``bench.floor --decode-only`` on A and on B, alternating which goes
first, in fresh processes (two cores cannot share one process: each reserves its
arena's address range). The JSON holds every round's GPU ms per step for each decode
capacity, the medians, and B over A.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np


def _gpu() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30).stdout.strip()
    except OSError:
        return "unknown"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("core_a")
    p.add_argument("core_b")
    p.add_argument("out")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=200)
    a = p.parse_args(argv)
    runs: dict[str, dict[str, list[float]]] = {"a": {}, "b": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            order = (("a", a.core_a), ("b", a.core_b))
            for key, core in order if r % 2 == 0 else order[::-1]:  # alternate which goes first
                out = Path(tmp) / f"{key}{r}.json"
                proc = subprocess.run([sys.executable, "-m", "bench.floor", core, str(out), str(a.steps),
                                       "--decode-only"], capture_output=True, text=True)
                if proc.returncode:
                    print(proc.stdout[-2000:], proc.stderr[-4000:], file=sys.stderr)
                    return proc.returncode
                for b, row in json.loads(out.read_text())["decode"].items():
                    runs[key].setdefault(b, []).append(row["gpu_ms_per_step"])
    cores = {}
    for key, core in (("a", a.core_a), ("b", a.core_b)):
        m = json.loads((Path(core) / "manifest.json").read_text())
        cores[key] = {"core": core, "capacities": m["capacities"], "model": m["frontend"]["served_name"]}
    median = {k: {b: float(np.median(v)) for b, v in runs[k].items()} for k in runs}
    report = dict(machine=dict(gpu=_gpu(), host=platform.node()), versions=dict(python=platform.python_version()),
                  config=dict(rounds=a.rounds, steps=a.steps), cores=cores, gpu_ms_per_step=runs, median=median,
                  b_over_a={b: median["b"][b] / median["a"][b] for b in median["a"] if b in median["b"]})
    Path(a.out).write_text(json.dumps(report, indent=1))
    print(json.dumps({"median": median, "b_over_a": report["b_over_a"]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
