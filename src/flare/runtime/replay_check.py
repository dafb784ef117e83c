"""Reproduce a core's golden replays through an executor: ``python -m flare.runtime.replay_check CORE``.

For every program and every recorded input set: restore the deterministic
base state, apply the input set, launch the program once, and compare the
digest of every runtime-owned buffer with the digest preparation recorded
from its in-process torch replay. Prints one JSON report; exit status 0 only
when every digest matches and torch was never imported.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import msgspec

from flare.core.manifest import load_manifest
from flare.runtime import qualify


async def check(core: Path, executor_kind: str = "cuda") -> dict:
    m = load_manifest(core)
    golden = msgspec.json.decode((core / "qualification.json").read_bytes())
    if executor_kind == "cuda":
        from flare.runtime.cuda_executor import CudaExecutor

        ex = CudaExecutor(core, m)
        read = ex.read_bytes
    else:
        from flare.runtime.reference import ReferenceExecutor

        ex = ReferenceExecutor(core, m)
        read = lambda name: ex.view(name).tobytes()  # noqa: E731
    t0 = time.perf_counter()
    await ex.start()
    startup = time.perf_counter() - t0
    base = qualify.base_state(m)
    programs = {}
    mismatches = []
    for name, sets in golden.items():
        results = []
        for i, expected in enumerate(sets):
            for buf, value in base.buffers.items():
                ex.write(buf, value)
            for buf, value in qualify.input_writes(m, name, i, base).items():
                ex.write(buf, value)
            ex.submit(name)
            await ex.wait()
            got = qualify.digests(m, read)
            bad = sorted(k for k in expected if got.get(k) != expected[k])
            results.append(not bad)
            if bad:
                mismatches.append({"program": name, "set": i, "buffers": bad})
        programs[name] = {"bitwise_equal": all(results), "sets": len(results)}
    stats = ex.stats()
    await ex.close()
    return {
        "core": str(core),
        "programs": programs,
        "mismatches": mismatches,
        "all_bitwise_equal": not mismatches and bool(programs),
        "startup_s": round(startup, 3),
        "executor_stats": stats,
        "torch_imported": "torch" in sys.modules,
    }


def main() -> int:
    core = Path(sys.argv[1])
    kind = sys.argv[2] if len(sys.argv) > 2 else "cuda"
    report = asyncio.run(check(core, kind))
    print(json.dumps(report))
    return 0 if report["all_bitwise_equal"] and not report["torch_imported"] else 1


if __name__ == "__main__":
    sys.exit(main())
