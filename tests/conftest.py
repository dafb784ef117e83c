"""Shared fixtures: prepared cores (cached across runs) and live servers.

Cores are prepared through the real ``flare-prepare`` CLI into
``.cache/test-cores/<key>``; the key covers the preparation code, the configs
and the options, so a change to any of them re-prepares.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import hashlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("FLARE_TEST_CACHE", ROOT / ".cache" / "test-cores"))
# Under pytest-xdist (make test: -n 2 on the 2-core CI machine) each worker's torch would start
# one thread per core: the workers' OpenMP teams then share the cores and every barrier waits
# for a descheduled thread (test_programs' smol acceptance fixture: 20 s with one thread per
# worker, 238 s with two beside another busy process). The cores are shared out instead, as
# FLARE_TEST_TORCH_THREADS sets them (below): in-process programs, preparation subprocesses
# and the workers the tests start take cores // workers threads each (one on CI).
def _threads_per_worker(workers: int) -> int:
    return max(1, len(os.sched_getaffinity(0)) // workers)


if "PYTEST_XDIST_WORKER_COUNT" in os.environ and "FLARE_TEST_TORCH_THREADS" not in os.environ:
    os.environ["FLARE_TEST_TORCH_THREADS"] = str(_threads_per_worker(int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
# Torch threads of the reference workers the tests start. One: two spin against the
# event loop and the client on a 2-core machine (each OpenMP barrier waits for a
# descheduled thread; the sampler's elementwise ops take ~10 ms instead of ~0.1 ms).
TORCH_THREADS = int(os.environ.get("FLARE_TEST_TORCH_THREADS", "1"))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def _no_cuda() -> bool:
    import torch

    return not torch.cuda.is_available()


# Without CUDA the Triton kernels run in Triton's CPU interpreter. The switch is
# read when Triton is imported, and importing transformers imports Triton, so it
# must be set here, before any test module imports flare.prepare.
if _no_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")

if "FLARE_TEST_TORCH_THREADS" in os.environ:  # also for in-process programs and preparation subprocesses
    import torch

    torch.set_num_threads(TORCH_THREADS)
    os.environ.setdefault("OMP_NUM_THREADS", str(TORCH_THREADS))


def _start_zygote(threads: int | None) -> None:
    """The preparation and reference workers the tests start (about 120 in a run, through
    flare-prepare and the reference executors of the servers and engines) are forked from
    a zygote that has imported torch and Transformers once (``flare.zygote``): each worker
    started afresh spent about 8 s of a CI core importing them. Started where this file is
    first imported (under xdist: the controller, whose environment the workers inherit,
    ``FLARE_WORKER_ZYGOTE`` with it), with the environment above and the workers' torch
    threads (``threads``: the xdist workers' share of the cores), so that OpenBLAS and OpenMP
    in its children count the threads as in workers started afresh. Not on a CUDA
    machine (the GPU suite), nor with FLARE_TEST_ZYGOTE=0. Its log (a worker that ran
    afresh says why there) is CACHE/zygote.log."""
    from flare import zygote

    if os.environ.get("FLARE_TEST_ZYGOTE", "1") == "0" or zygote.ENV in os.environ or not _no_cuda():
        return
    folder = tempfile.mkdtemp(prefix="flare-zygote-")
    path = os.path.join(folder, "socket")
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / "zygote.log", "w") as log:  # its own session: a Ctrl-C reaches it through its clients
        env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
        proc = subprocess.Popen([sys.executable, "-m", "flare.zygote", "serve", path, "--exit-with-parent"], env=env,
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def stop():
        try:
            proc.terminate()
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    deadline = time.monotonic() + 10
    while not os.path.exists(path) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)  # it listens before its imports: clients queue behind them
    if not os.path.exists(path):  # workers then start afresh, as without it
        stop()
        return
    os.environ[zygote.ENV] = path
    atexit.register(stop)


def pytest_configure(config):
    """The zygote, before xdist starts its workers (at the session's start), which inherit it."""
    if hasattr(config, "workerinput"):  # an xdist worker: the controller started it
        return
    n = getattr(config.option, "numprocesses", None)
    workers = n if isinstance(n, int) and n > 0 else None
    threads = os.environ.get("FLARE_TEST_TORCH_THREADS") or (
        str(_threads_per_worker(workers)) if workers else os.environ.get("OMP_NUM_THREADS"))
    _start_zygote(int(threads) if threads else None)

# Options shared by the test cores: small context, small chunks so that chunking and
# page boundaries are exercised with short prompts.
SMOL_OPTS = ["--device", "cpu", "--context-limit", "2048", "--prefill-chunk-size", "128", "--kv-pages", "600",
             "--page-size", "16", "--decode-capacities", "1,2,4", "--snapshot-rows", "64"]
TINY_OPTS = ["--device", "cpu", "--context-limit", "1024", "--prefill-chunk-size", "128", "--kv-pages", "256",
             "--page-size", "16", "--decode-capacities", "1,2,4,8", "--snapshot-rows", "32"]
# The hybrid (Gated DeltaNet + attention) fixture: a context long enough for the
# ten-turn agent conversation, snapshot rows for eight captures per slot.
HYBRID_OPTS = ["--device", "cpu", "--context-limit", "2048", "--prefill-chunk-size", "128", "--kv-pages", "600",
               "--page-size", "16", "--decode-capacities", "1,2,4", "--snapshot-rows", "64"]
# Added to a core's options for the tests that run the CUDA path's programs against the
# reference path under Triton's CPU interpreter: prefill programs of 64 rows instead of 128.
# The interpreter runs every row of a program, padded or not (the paged attention's combine
# runs one program per row), so a short chunk in prefill.64 costs about half what it
# does in prefill.128; 64 rows are still two attention tiles of 32 tokens (the second empty
# for chunks up to 32) and one delta-rule block, and the chunks those tests prefill (up to 49
# tokens) fit either program.
INTERPRETER_CHUNK = ["--prefill-chunk-size", "64"]


# Under pytest-xdist (make test: -n 2) the tests of these modules run on one worker. Each
# shares module-scope fixtures that cost 10 s to over a minute on the CI machine (Transformers'
# float32/float64 references and the programs' outcomes, the conversation acceptance runs, the
# TP=1/TP=2 drives, a module's server), which xdist's default load scheduling computes again
# on every worker it sends one of the module's tests to (seen: test_programs' and
# test_conversation_cache's twice, ~50 s and ~75 s each; test_logprobs' Transformers model four
# times, 3 s each; test_fuzz's server twice; test_mtp's requests without speculation, which both
# learned-draft cases compare with). ``--dist loadgroup`` with xdist_group
# marks would do this, but xdist 3.8 tags node ids through Item._nodeid, which pytest 9 ignores.
ONE_WORKER_MODULES = frozenset(f"tests/{name}.py" for name in (
    "test_programs", "test_conversation_cache", "test_tensor_parallel", "test_qwen3_5", "test_qwen3_moe",
    "test_agent_http", "test_mtp", "test_logprobs", "test_fuzz"))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist's ``load`` mode test by test (each worker asks for more as it runs out), but each
    module of ONE_WORKER_MODULES one unit of work; those are handed out first (most tests first)."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModulesOnOneWorker(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return module if module in ONE_WORKER_MODULES else nodeid

    return ModulesOnOneWorker(config, log)


def _code_digest() -> str:
    """What a core depends on: the preparation code, the contract, the configs and the
    qualification inputs its golden replays record (the rest of the runtime and the
    server never change a core, so editing them does not re-prepare)."""
    h = hashlib.sha256()
    for base in (ROOT / "src" / "flare" / "prepare", ROOT / "src" / "flare" / "core", ROOT / "configs",
                 ROOT / "src" / "flare" / "runtime" / "qualify.py"):
        for p in sorted(base.rglob("*")) if base.is_dir() else [base]:
            if p.is_file() and p.suffix in (".py", ".toml", ".c", ".jinja"):
                h.update(str(p.relative_to(ROOT)).encode())
                h.update(p.read_bytes())
    return h.hexdigest()[:16]


def prepare_core(model: str, opts: list[str], name: str | None = None) -> Path:
    # The thread count is part of the key: CPU golden replays (--qualify) reproduce bit
    # for bit only with the reduction order, hence the thread count, they were recorded with.
    threads = os.environ.get("OMP_NUM_THREADS", "")
    key = hashlib.sha256(("|".join([model, *opts, _code_digest(), threads])).encode()).hexdigest()[:16]
    out = CACHE / f"{name or model}-{key}"
    if (out / "manifest.json").is_file():
        return out
    CACHE.mkdir(parents=True, exist_ok=True)
    # Processes that want the same core (the GPU suite's parallel phases) take turns: the
    # first prepares it, the others then find it.
    with open(out.with_name(out.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / "manifest.json").is_file():
            return out
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        cmd = [sys.executable, "-m", "flare.prepare.cli", model, "--out", str(tmp), *opts]
        if name:
            cmd += ["--served-name", name]
        subprocess.run(cmd, check=True)
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    return out


# Cores with golden replays (tests/test_replay_check.py). --qualify adds qualification.json and
# nothing else (same programs and weights; the served name aside): tests of the same options take
# these cores rather than prepare twins of them (tiny_core, test_hybrid_verify, test_qwen3_moe,
# test_hybrid_moe, test_no_torch).
# Three input sets: the snapshot/restore sets cycle through a tail page of the slot, another
# one, and the null page (a page-aligned endpoint); resume's third set is a finished request.
QUALIFIED = {
    # (tiny_core itself: its served name is the default's)
    "llama-tiny": lambda: prepare_core("llama-tiny", [*TINY_OPTS, "--qualify", "3"]),
    # pack and verify programs (speculative decoding's), one core for both
    "llama-tiny-pack": lambda: prepare_core("llama-tiny", [*TINY_OPTS, "--pack-capacities", "64", "--draft-tokens", "3",
                                                           "--qualify", "3"], name="llama-tiny-pack-qualified"),
    # with verify programs: per-position recurrent state (the hybrid's rollback)
    "qwen3_5-tiny": lambda: prepare_core("qwen3_5-tiny", [*HYBRID_OPTS, "--draft-tokens", "3", "--qualify", "3"],
                                         name="qwen3_5-tiny-qualified"),
    "qwen3-moe-tiny": lambda: prepare_core("qwen3-moe-tiny", [*TINY_OPTS, "--qualify", "3"],
                                           name="qwen3-moe-tiny-qualified"),
    "qwen3_5-moe-tiny": lambda: prepare_core("qwen3_5-moe-tiny", [*HYBRID_OPTS, "--qualify", "3"],
                                             name="qwen3_5-moe-tiny-qualified"),
}


@pytest.fixture(scope="session")
def smol_core() -> Path:
    return prepare_core("smollm2-135m-instruct", SMOL_OPTS)


@pytest.fixture(scope="session")
def tiny_core() -> Path:
    return QUALIFIED["llama-tiny"]()  # TINY_OPTS, with golden replays (test_replay_check)


@pytest.fixture(scope="session")
def qwen3_core() -> Path:
    return prepare_core("qwen3-tiny", TINY_OPTS)


@pytest.fixture(scope="session")
def hybrid_core() -> Path:
    return prepare_core("qwen3_5-tiny", HYBRID_OPTS)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    # One torch thread in the reference worker: on a 2-core machine the server's event
    # loop and the test client need the other core, and two OpenMP threads competing with
    # them (or with anything else running) spin-wait and run ~8x slower than one.
    def __init__(self, core: Path, *extra: str, env: dict | None = None):
        self.core = core
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(CACHE / f"server-{self.port}.log", "w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "flare.server.cli", str(core), "--port", str(self.port),
             "--torch-threads", str(TORCH_THREADS), *extra],
            stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
        )

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"flare-serve exited with {self.proc.returncode}:\n{self.output()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            time.sleep(0.2)
        raise RuntimeError(f"flare-serve not ready after {timeout}s:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def stop(self, sig=signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@contextlib.contextmanager
def running_server(core: Path, *extra: str, env: dict | None = None):
    CACHE.mkdir(parents=True, exist_ok=True)
    srv = ServerProcess(core, *extra, env=env)
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def smol_server(smol_core):
    with running_server(smol_core) as srv:
        yield srv


@pytest.fixture(scope="session")
def hybrid_server(hybrid_core):
    with running_server(hybrid_core) as srv:
        yield srv


@pytest.fixture(scope="session")
def tiny_server(tiny_core):
    with running_server(tiny_core) as srv:
        yield srv


def count_calls(monkeypatch, owner, name: str, calls: dict, key: str) -> None:
    """``owner.name`` replaced (for the test) by itself counting its calls in ``calls[key]``."""
    real = getattr(owner, name)

    def counted(*args, **kwargs):
        calls[key] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)


def scrape_metrics(url: str) -> dict[str, float]:
    """The server's /metrics as {name (with labels): value}."""
    out = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out
