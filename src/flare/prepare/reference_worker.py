"""The torch side of the reference executor (see ``flare.runtime.reference``).

``python -m flare.prepare.reference_worker CORE_DIR ARENA_FILE [RANK GROUP_ADDR]``

Maps the arena file the serving process created, rebuilds the recipe's model
over it (parameters are views of the arena: no copy) and runs programs when
asked. Reports ``ready`` once every program is bound. On a tensor-parallel core
it is rank RANK of the core's TP size, joined in the gloo group at GROUP_ADDR;
its arena file holds that rank's image.
"""

from __future__ import annotations

import mmap
import os
import sys
import traceback

from flare.zygote import WORKER_DEFAULTS


def main() -> int:
    for k, v in WORKER_DEFAULTS.items():  # read by the imports below
        os.environ.setdefault(k, v)
    core_dir, arena_path = sys.argv[1], sys.argv[2]
    rank, addr = (int(sys.argv[3]), sys.argv[4]) if len(sys.argv) > 4 else (0, None)
    try:
        import torch

        from flare.core.manifest import load_manifest
        from flare.prepare.parallel import join_group
        from flare.prepare.programs import ProgramSet, arena_views

        m = load_manifest(core_dir)
        tp = join_group(rank, m.parallel.tp_size, addr)
        with open(arena_path, "r+b") as f:
            mm = mmap.mmap(f.fileno(), m.arena.nbytes)
        arena = torch.frombuffer(mm, dtype=torch.uint8)
        programs = ProgramSet.for_core(m, arena_views(arena, m.buffers), tp=tp)
        table = {p.name: programs.callable(p.kind, p.capacity) for p in m.programs}
    except Exception:
        traceback.print_exc()
        print("failed", flush=True)
        return 1
    print("ready", flush=True)
    for line in sys.stdin:
        cmd, _, arg = line.strip().partition(" ")
        if cmd == "exit":
            break
        if cmd != "run" or arg not in table:
            print(f"error unknown command {line.strip()!r}", flush=True)
            continue
        try:
            table[arg]()
        except Exception as e:  # reported to the runtime, which fails the engine
            traceback.print_exc()
            print(f"error {type(e).__name__}: {e}".replace("\n", " "), flush=True)
            continue
        print("ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
