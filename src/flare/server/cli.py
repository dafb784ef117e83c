"""``flare-serve CORE``: load a runtime core and serve it over HTTP.

Startup order: validate the core, start the executor and the engine, and only
then bind the socket; a startup failure exits non-zero with no endpoint bound.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import sys
import time
from pathlib import Path

from flare.core.errors import FlareError
from flare.core.manifest import load_manifest

log = logging.getLogger("flare.serve")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flare-serve", description=__doc__)
    p.add_argument("core", help="runtime core directory written by flare-prepare")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--executor", choices=("auto", "reference", "cuda"), default="auto",
                   help="auto: cuda for CUDA cores, reference for CPU cores")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--max-waiting", type=int, default=256, help="bounded admission queue length")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="disable checkpoint reuse and capture (every prompt is prefilled in full)")
    p.add_argument("--torch-threads", type=int, default=None, help="reference executor: torch threads")
    p.add_argument("--log-level", default="info")
    return p


def make_executor(kind: str, core: Path, manifest, torch_threads: int | None):
    if kind == "auto":
        kind = "cuda" if manifest.identity.device == "cuda" else "reference"
    if kind == "reference":
        from flare.runtime.reference import ReferenceExecutor

        return ReferenceExecutor(core, manifest, torch_threads=torch_threads)
    from flare.runtime.cuda_executor import CudaExecutor

    return CudaExecutor(core, manifest)


async def serve(a: argparse.Namespace) -> int:
    import uvicorn

    from flare.runtime.engine import Engine
    from flare.server.app import Frontend, create_app

    t0 = time.perf_counter()
    core = Path(a.core)
    try:
        manifest = load_manifest(core)
        engine = Engine(make_executor(a.executor, core, manifest, a.torch_threads), max_waiting=a.max_waiting,
                        prefix_cache=not a.no_prefix_cache)
        await engine.start()
        frontend = Frontend(str(core), engine, a.served_model_name)
    except FlareError as e:
        log.error("startup failed: %s (%s)", e.message, e.code)
        return 3
    app = create_app(engine, frontend)
    config = uvicorn.Config(app, host=a.host, port=a.port, loop="none", lifespan="off", log_level=a.log_level,
                            timeout_graceful_shutdown=10, access_log=False)
    server = _keep_signals(uvicorn.Server)(config)
    log.info("ready in %.2f s: serving %s on http://%s:%d", time.perf_counter() - t0, frontend.served_name,
             a.host, a.port)
    try:
        await server.serve()
    finally:
        await engine.shutdown(grace_s=5.0)
        _report_modules()
    return 0 if server.started else 4


def _keep_signals(server_cls):
    """uvicorn re-raises the SIGTERM/SIGINT it caught as ``serve()`` returns, so the
    default handler kills the process before the ``finally`` below runs: the engine
    never drains, the executor never closes (the reference worker and the shared
    arena file in /dev/shm are left behind) and the modules report is not written.
    Keep uvicorn's graceful HTTP shutdown, drop the re-raise; the process then exits
    normally once everything is released."""

    class Server(server_cls):
        @contextlib.contextmanager
        def capture_signals(self):
            with super().capture_signals():
                try:
                    yield
                finally:
                    self._captured_signals.clear()

    return Server


def _report_modules() -> None:
    """Tests set FLARE_MODULES_REPORT to check what the serving process imported."""
    path = os.environ.get("FLARE_MODULES_REPORT")
    if path:
        Path(path).write_text(json.dumps(sorted(sys.modules)))


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%Y-%m-%dT%H:%M:%S%z")
    logging.Formatter.converter = time.gmtime
    try:
        import uvloop

        return uvloop.run(serve(a))
    except ImportError:
        return asyncio.run(serve(a))


if __name__ == "__main__":
    sys.exit(main())
