"""``flare-serve CORE``: load a runtime core and serve it over HTTP.

Startup order: validate the core, start the executor and the engine (the
served model's tokenizer, template and grammar compiler load meanwhile on another
thread), and only then bind the socket; a startup failure exits non-zero with
no endpoint bound.
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
    p.add_argument("--prefill-while-decoding", type=int, default=0, metavar="TOKENS",
                   help="cap each prefill chunk, and the prefill rows run between two decode steps, at TOKENS "
                        "while other requests are decoding, so that they wait at most one such chunk between "
                        "tokens (0, the default: the core's whole prefill chunk)")
    p.add_argument("--decode-with-prefill", action="store_true",
                   help="while a prompt prefills, each decode step carries a chunk of it in a pack program (a "
                        "core prepared with --pack-capacities): running requests get a token every step; the "
                        "prompt advances by up to the largest pack capacity less the decoders per step (whole "
                        "attention tiles once it continues a history; at most --prefill-while-decoding when set)")
    p.add_argument("--admission-window-ms", type=float, default=5.0, metavar="MS",
                   help="when the engine is idle and prompts are waiting while others are still being rendered "
                        "and tokenized (requests sent together), wait up to MS for them so that they start in "
                        "one program; a lone request never waits (0 disables)")
    p.add_argument("--speculative", choices=("off", "copy", "copy-always", "mtp", "mtp-always"), default=None,
                   help="speculative decoding: copy drafts each request's next tokens from its own history "
                        "(prompt, earlier turns, tool results, output) and the core's verify programs check "
                        "them exactly, when the measured step costs say it pays; copy-always verifies "
                        "whenever there are drafts; mtp takes the drafts of the model's MTP head (a core "
                        "prepared with --mtp) instead, mtp-always verifies them every step; requests with log-probabilities or a "
                        "grammar decode without drafts (default: mtp on a core prepared with --mtp, copy on one "
                        "prepared with --draft-tokens, else off)")
    p.add_argument("--draft-tokens", type=int, default=None, metavar="N",
                   help="drafts per request and step with --speculative copy or mtp (default and maximum: the core's "
                        "--draft-tokens)")
    p.add_argument("--steps-in-flight", type=int, choices=(1, 2), default=2,
                   help="decode steps kept in flight: 2 queues the next decode before the current one "
                        "completes (host work overlaps the device); 1 runs one step at a time")
    p.add_argument("--torch-threads", type=int, default=None, help="reference executor: torch threads")
    p.add_argument("--api-key", default=os.environ.get("FLARE_API_KEY"),
                   help="require this key on /v1/* (Authorization: Bearer or x-api-key); default $FLARE_API_KEY")
    p.add_argument("--max-body-bytes", type=int, default=16 << 20, help="request body limit (413 above)")
    p.add_argument("--max-n", type=int, default=8, help="largest n (choices per request)")
    p.add_argument("--max-tokens-limit", type=int, default=None, help="ceiling on max_tokens (default: context)")
    p.add_argument("--max-stop", type=int, default=16, help="most stop strings per request")
    p.add_argument("--shutdown-grace", type=float, default=10.0,
                   help="seconds running requests get to finish after SIGTERM/SIGINT before they are cancelled")
    p.add_argument("--grammar-compile-timeout", type=float, default=5.0,
                   help="seconds an output grammar may take to compile before its request fails")
    p.add_argument("--log-level", default="info")
    return p


def make_executor(kind: str, core: Path, manifest, torch_threads: int | None):
    if kind == "auto":
        kind = "cuda" if manifest.identity.device == "cuda" else "reference"
    if kind == "reference":
        from flare.runtime.reference import ReferenceExecutor

        return ReferenceExecutor(core, manifest, torch_threads=torch_threads)
    from flare.runtime.cuda_tp import open_executor

    return open_executor(core, manifest)


async def serve(a: argparse.Namespace) -> int:
    import uvicorn

    from flare.runtime.engine import Engine
    from flare.server.app import ServedModel, ServerConfig, create_app
    from flare.server.params import Limits

    t0 = time.perf_counter()
    core = Path(a.core)
    try:
        manifest = load_manifest(core)
        if a.decode_with_prefill and not manifest.capacities.pack_capacities:
            log.error("startup failed: --decode-with-prefill needs a core prepared with --pack-capacities")
            return 2
        prepared, learned = manifest.capacities.draft_tokens, manifest.capacities.mtp_drafts
        speculative = a.speculative or ("mtp" if learned else "copy" if prepared else "off")
        if speculative == "off" and a.draft_tokens is not None:
            log.error("startup failed: --draft-tokens needs --speculative copy or mtp")
            return 2
        if speculative.startswith("mtp") and not learned:
            log.error("startup failed: --speculative mtp needs a core prepared with --mtp")
            return 2
        draft_tokens = (prepared if a.draft_tokens is None else a.draft_tokens) if speculative != "off" else 0
        if speculative != "off" and not 1 <= draft_tokens <= prepared:
            log.error("startup failed: --speculative copy needs a core prepared with --draft-tokens, and "
                      "--draft-tokens between 1 and the core's %d", prepared)
            return 2
        engine = Engine(make_executor(a.executor, core, manifest, a.torch_threads), max_waiting=a.max_waiting,
                        prefix_cache=not a.no_prefix_cache, steps_in_flight=a.steps_in_flight,
                        prefill_while_decoding=a.prefill_while_decoding,
                        decode_with_prefill=a.decode_with_prefill, draft_tokens=draft_tokens,
                        speculate_always=speculative.endswith("-always"), learned_drafts=speculative.startswith("mtp"),
                        admission_window_s=a.admission_window_ms / 1000)
    except FlareError as e:
        log.error("startup failed: %s (%s)", e.message, e.code)
        return 3
    # The served model's tokenizer, template and grammar compiler need only the manifest:
    # they load while the executor uploads and builds.
    started, loaded = await asyncio.gather(
        engine.start(), asyncio.to_thread(ServedModel, str(core), engine, a.served_model_name,
                                          grammar_timeout_s=a.grammar_compile_timeout),
        return_exceptions=True)
    if isinstance(started, BaseException) or isinstance(loaded, BaseException):
        if not isinstance(loaded, BaseException):
            loaded.close()
        err = started if isinstance(started, BaseException) else loaded
        if isinstance(err, FlareError):
            log.error("startup failed: %s (%s)", err.message, err.code)
            return 3
        raise err
    model = loaded
    limits = Limits(max_n=a.max_n, max_stop_strings=a.max_stop, max_tokens_cap=a.max_tokens_limit)
    app = create_app(engine, model, ServerConfig(max_body_bytes=a.max_body_bytes, limits=limits,
                                                    api_key=a.api_key))
    # uvicorn waits for open connections after the signal; the engine's drain (started
    # by the signal) ends every stream within the grace period, so this bound is a backstop.
    config = uvicorn.Config(app, host=a.host, port=a.port, loop="none", lifespan="off", log_level=a.log_level,
                            timeout_graceful_shutdown=a.shutdown_grace + 5, access_log=False)
    server = _keep_signals(uvicorn.Server, engine, a.shutdown_grace)(config)
    log.info("ready in %.2f s (%.2f s after process start): serving %s on http://%s:%d", time.perf_counter() - t0,
             _process_age_s(), model.served_name, a.host, a.port)
    try:
        await server.serve()
    finally:
        await engine.shutdown(grace_s=5.0)
        model.close()
        _report_modules()
    return 0 if server.started else 4


def _process_age_s() -> float:
    """Seconds since this process started (the kernel's start time, clock-tick
    resolution): the ready time includes the interpreter's start and every import."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rpartition(")")[2].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return float("nan")


def _keep_signals(server_cls, engine, grace_s: float):
    """uvicorn re-raises the SIGTERM/SIGINT it caught as ``serve()`` returns, so the
    default handler kills the process before the ``finally`` below runs: the engine
    never drains, the executor never closes (the reference worker and the shared
    arena file in /dev/shm are left behind) and the modules report is not written.
    Keep uvicorn's graceful HTTP shutdown, drop the re-raise; the process then exits
    normally once everything is released."""

    class Server(server_cls):
        drain_task = None

        def handle_exit(self, sig, frame) -> None:
            # Stop admission at once (new requests get 503) and give running ones the
            # grace period; uvicorn meanwhile stops accepting connections.
            if Server.drain_task is None:
                Server.drain_task = asyncio.get_event_loop().create_task(engine.drain(grace_s))
            super().handle_exit(sig, frame)

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
    p = parser()
    a = p.parse_args(argv)
    if not 0 <= a.admission_window_ms <= 1000:
        p.error(f"--admission-window-ms must lie in [0, 1000], got {a.admission_window_ms}")
    if a.prefill_while_decoding < 0:
        p.error(f"--prefill-while-decoding must not be negative, got {a.prefill_while_decoding}")
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
