"""The preparation subprocess: ``python -m flare.prepare.worker OPTIONS_JSON``.

Everything torch-related happens here, so the compiler workers, caching
allocators and Python model objects are gone when it exits.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from flare.zygote import WORKER_DEFAULTS

_T0 = time.time()  # replaced by flare-prepare's own start (``started_at``): one clock for every line


def progress(msg: str) -> None:
    print(f"[flare-prepare {time.time() - _T0:6.1f}s] {msg}", flush=True)


def main() -> int:
    for k, v in WORKER_DEFAULTS.items():  # read by the imports below
        os.environ.setdefault(k, v)
    global _T0
    args = json.loads(sys.argv[1])
    _T0 = args.pop("started_at", _T0)
    out = Path(args.pop("out"))
    model = args.pop("model")
    session = None
    tp = None
    if args.get("tp_size", 1) > 1:
        # The group first (gloo: no CUDA), so the ranks can agree on arena addresses.
        from flare.prepare.parallel import join_group

        tp = join_group(args["tp_rank"], args["tp_size"], args["tp_addr"])
    if args.get("device") == "cuda":
        # Before torch initialises CUDA: CUPTI must see every module load and the
        # arena's fixed address range must be ours.
        from flare.core.errors import CoreCompatibilityError
        from flare.prepare.cuda.session import CudaSession

        try:
            session = CudaSession.begin(rank=args.get("tp_rank", 0), agree=tp.gather_strings if tp else None)
        except CoreCompatibilityError as e:
            print(f"flare-prepare: error: {e}", file=sys.stderr, flush=True)
            return 2
        progress(f"CUDA session: {session.device.name} (sm {session.device.compute_capability}), "
                 f"arena address {session.base:#x}, {session.free_at_start / 2**30:.1f} GiB free")
    from flare.core.manifest import ManifestError
    from flare.prepare.build import Options, PrepareError, prepare
    from flare.prepare.parallel import SINGLE, leave_group
    from flare.prepare.recipes import UnsupportedArchitecture
    from flare.prepare.sources import SourceError, resolve

    opts = Options(**{**args, "decode_capacities": tuple(args["decode_capacities"])})
    tp = tp or SINGLE
    try:
        progress(f"loading {model}")
        src = resolve(model, progress=progress)
        prepare(src, opts, out, progress, session=session, tp=tp, started=_T0)
    except (PrepareError, SourceError, UnsupportedArchitecture, ManifestError) as e:
        print(f"flare-prepare: error: {e}", file=sys.stderr, flush=True)
        return 2
    finally:
        leave_group(tp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
