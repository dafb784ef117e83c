"""Two flare-serve configurations of one core, measured one after the other in one run
with the same serving client: what a serving option (``--decode-with-prefill``,
``--prefill-while-decoding N``) does to the scenarios it is for.

usage: python -m bench.ab_serve CORE OUT.json --a="OPTIONS" --b="OPTIONS" -- [serve_bench options]
       (e.g. --b=--decode-with-prefill: the = keeps options that start with -- a value)

Each configuration gets a fresh ``flare-serve`` on the core (port 8391), the
``bench.serve_bench`` options after ``--`` (the same for both, with one prompt salt for both
unless they name one: the two servers get the same prompts), and is stopped before the
next starts. The JSON holds both serve_bench outputs under ``a`` and ``b`` with their
flare-serve options, the server's startup log tail and its step, token and speculation
counters after the run (``server_counters``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.client import server_counters

PORT = 8391


async def _counters(url: str) -> dict[str, float]:
    async with httpx.AsyncClient(timeout=30) as client:
        return await server_counters(client, url)


def _serve(core: str, options: str, bench_args: list[str], log: Path, out: Path) -> dict:
    url = f"http://127.0.0.1:{PORT}"
    with open(log, "w") as f:
        cmd = [sys.executable, "-m", "flare.server.cli", core, "--port", str(PORT), "--served-model-name", "ab",
               *shlex.split(options)]
        server = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"flare-serve {options!r} exited: {log.read_text()[-2000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"flare-serve {options!r} not ready after 300 s")
            time.sleep(0.25)
        subprocess.run([sys.executable, "-m", "bench.serve_bench", url, "ab", str(out), *bench_args], check=True)
        result = json.loads(out.read_text())
        # The server's own counters after the run (steps, tokens, speculation's drafts).
        result["server_counters"] = asyncio.run(_counters(url))
        return result
    finally:
        server.terminate()
        server.wait(timeout=60)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("core")
    p.add_argument("out")
    p.add_argument("--a", default="", help="flare-serve options of the first configuration")
    p.add_argument("--b", default="", help="flare-serve options of the second configuration")
    a = p.parse_args(argv[:split])
    bench_args = argv[split + 1 :]
    if "--salt" not in bench_args and not any(x.startswith("--salt=") for x in bench_args):
        # One salt for both: each configuration gets a fresh server (nothing is cached across
        # them) and sends the same prompts.
        bench_args += ["--salt", secrets.token_hex(4)]
    report = {"core": a.core, "serve_bench": bench_args}
    with tempfile.TemporaryDirectory() as tmp:
        for key, options in (("a", a.a), ("b", a.b)):
            log = Path(tmp) / f"{key}.log"
            results = _serve(a.core, options, bench_args, log, Path(tmp) / f"{key}.json")
            report[key] = {"serve_options": options, "results": results, "server_log_tail": log.read_text()[-3000:]}
    Path(a.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
