"""Workers forked from a zygote (``flare.zygote``) behave as workers started afresh.

Each test starts its own zygote (nothing preloaded: the mechanism, not the imports) and
runs this module as the worker (``__main__`` below): it reports what it sees, echoes its
input, and exits as told.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from flare import zygote

ROOT = Path(__file__).resolve().parents[1]
WORKER = "tests.test_zygote"
# The worker module is found from any working directory, by the zygote's children as by a fresh interpreter.
PYTHONPATH = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])


def _worker() -> int:
    print(json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "argv": sys.argv[1:], "cwd": os.getcwd(),
                      "marker": os.environ.get("ZYGOTE_TEST_MARKER"), "name": __name__}), flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd.startswith("exit "):
            return int(cmd.split()[1])
        if cmd == "stderr":
            print("to stderr", file=sys.stderr, flush=True)
        if cmd == "raise":
            raise ValueError("raised in the worker")
        if cmd == "trap":  # SIGTERM answered and ended with 5
            signal.signal(signal.SIGTERM, lambda *_: (print("caught", flush=True), os._exit(5)))
        if cmd == "sleep":
            time.sleep(60)
        if cmd == "interrupt":
            raise KeyboardInterrupt
        if cmd == "thread":  # a non-daemon thread the exit waits for, and an exit function
            atexit.register(lambda: open(sys.argv[1], "w").write("written at exit"))

            def late():
                time.sleep(0.5)
                print("thread done", flush=True)

            threading.Thread(target=late).start()
            return 0
        print("echo " + cmd, flush=True)
    return 0


@pytest.fixture
def zygote_at(tmp_path):
    path = str(tmp_path / "socket")
    env = {**{k: v for k, v in os.environ.items() if k != zygote.ENV}, "PYTHONPATH": PYTHONPATH}
    proc = subprocess.Popen([sys.executable, "-m", "flare.zygote", "serve", path, "--preload", ""], cwd=ROOT,
                            env=env, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert os.path.exists(path) and os.stat(path).st_mode & 0o777 == 0o600
    yield path, proc.pid
    proc.terminate()
    assert proc.wait(10) == 0
    assert not os.path.exists(path)  # it removes its socket on the way out


def _start(path: str, *args: str, cwd=ROOT, ignore_hup: bool = False, **env) -> subprocess.Popen:
    full = {**{k: v for k, v in os.environ.items() if k != zygote.ENV}, "PYTHONPATH": PYTHONPATH, zygote.ENV: path,
            **env}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(zygote.ENV, path)
        cmd = [*zygote.worker_command(WORKER), *args]
    return subprocess.Popen(cmd, cwd=cwd, env=full, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=(lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN)) if ignore_hup else None)


def _hello(proc: subprocess.Popen) -> dict:
    return json.loads(proc.stdout.readline())


def test_worker_command_without_and_with_a_zygote(monkeypatch):
    monkeypatch.delenv(zygote.ENV, raising=False)
    assert zygote.worker_command("m") == [sys.executable, "-m", "m"]
    monkeypatch.setenv(zygote.ENV, "/x/socket")
    assert zygote.worker_command("m") == [sys.executable, "-m", "flare.zygote", "run", "/x/socket", "m"]


def test_a_forked_worker_has_the_clients_io_arguments_environment_and_status(zygote_at, tmp_path):
    path, zpid = zygote_at
    proc = _start(path, "a", "b c", cwd=tmp_path, ZYGOTE_TEST_MARKER="m1")
    hello = _hello(proc)
    # A child of the zygote, not the client: the imports were not made again.
    assert hello["ppid"] == zpid and hello["pid"] != proc.pid
    assert hello == {**hello, "argv": ["a", "b c"], "cwd": str(tmp_path), "marker": "m1", "name": "__main__"}
    out, err = proc.communicate("one\nstderr\ntwo\nexit 7\n", timeout=30)
    assert out == "echo one\necho stderr\necho two\n" and "to stderr" in err
    assert proc.returncode == 7
    # End of input ends it with 0; an exception with 1 and its traceback, as a fresh interpreter.
    proc = _start(path)
    _hello(proc)
    assert proc.communicate("", timeout=30)[0] == "" and proc.returncode == 0
    proc = _start(path)
    _hello(proc)
    _, err = proc.communicate("raise\n", timeout=30)
    assert proc.returncode == 1 and "ValueError: raised in the worker" in err


def test_the_worker_leaves_through_the_interpreters_exit(zygote_at, tmp_path):
    """Non-daemon threads joined, then the exit functions run, as at a fresh interpreter's exit."""
    path, _ = zygote_at
    target = tmp_path / "from-atexit.txt"
    proc = _start(path, str(target))
    _hello(proc)
    out, _ = proc.communicate("thread\n", timeout=30)
    assert proc.returncode == 0 and out == "thread done\n"
    assert target.read_text() == "written at exit"


def test_two_clients_at_once_and_the_way_each_worker_ended(zygote_at):
    """Each worker has only its own client's descriptors: one ending leaves the other
    running; a worker killed (SIGKILL) or interrupted ends its client the same way."""
    path, _ = zygote_at
    a, b = _start(path), _start(path)
    ha, hb = _hello(a), _hello(b)
    assert ha["pid"] != hb["pid"]
    assert a.communicate("exit 4\n", timeout=30)[0] == "" and a.returncode == 4
    b.stdin.write("still\n")
    b.stdin.flush()
    assert b.stdout.readline() == "echo still\n"
    os.kill(hb["pid"], signal.SIGKILL)  # the worker itself, as the OOM killer would
    assert b.wait(30) == -signal.SIGKILL
    c = _start(path)
    _hello(c)
    _, err = c.communicate("interrupt\n", timeout=30)
    assert c.returncode == -signal.SIGINT and "KeyboardInterrupt" in err
    c = _start(path)  # a negative exit code is a code (254), not a signal
    _hello(c)
    assert c.communicate("exit -2\n", timeout=30)[0] == "" and c.returncode == 254


def test_signals_reach_the_worker_and_a_killed_client_takes_its_worker(zygote_at):
    path, _ = zygote_at
    proc = _start(path)
    _hello(proc)
    proc.stdin.write("trap\nsleep\n")
    proc.stdin.flush()
    assert proc.stdout.readline() == "echo trap\n"
    proc.send_signal(signal.SIGTERM)  # forwarded: the worker's handler answers
    assert proc.stdout.readline() == "caught\n" and proc.wait(30) == 5
    proc = _start(path)
    child = _hello(proc)["pid"]
    proc.stdin.write("sleep\n")
    proc.stdin.flush()
    proc.send_signal(signal.SIGTERM)  # the worker dies of it, and the client of the same signal
    assert proc.wait(30) == -signal.SIGTERM
    assert _gone(child)
    proc = _start(path)
    child = _hello(proc)["pid"]
    proc.kill()  # not forwardable: the zygote sees its client's connection close and kills the worker
    proc.wait(30)
    assert _gone(child)
    # A signal the client was started ignoring (nohup) stays ignored by the worker, as across exec.
    proc = _start(path, ignore_hup=True)
    _hello(proc)
    proc.send_signal(signal.SIGHUP)
    proc.stdin.write("after\n")
    proc.stdin.flush()
    assert proc.stdout.readline() == "echo after\n"
    assert proc.communicate("exit 0\n", timeout=30)[0] == "" and proc.returncode == 0


def test_without_a_zygote_or_in_another_environment_the_client_runs_the_module_itself(zygote_at, tmp_path):
    path, _ = zygote_at
    # Another value of a variable that imports read (TRITON_INTERPRET, ...): refused, run here.
    proc = _start(path, TRITON_INTERPRET="0" if os.environ.get("TRITON_INTERPRET") == "1" else "1")
    assert _hello(proc)["pid"] == proc.pid
    assert proc.communicate("exit 3\n", timeout=30)[0] == "" and proc.returncode == 3
    proc = _start(str(tmp_path / "nothing-listens-here"))
    assert _hello(proc)["pid"] == proc.pid
    proc.communicate("exit 0\n", timeout=30)
    # A thread count it sets is taken (the child sets torch's), one it cannot use is refused.
    proc = _start(path, OMP_NUM_THREADS="3")
    assert _hello(proc)["pid"] != proc.pid
    proc.communicate("exit 0\n", timeout=30)
    proc = _start(path, OMP_NUM_THREADS="0")
    assert _hello(proc)["pid"] == proc.pid
    proc.communicate("exit 0\n", timeout=30)


def test_a_bad_request_leaves_the_zygote_serving(zygote_at):
    path, _ = zygote_at
    for payload in (b"\0\0\0\x05[1,2]", b"\0\0\0\x40{", b"\0\0\0\x02{}"):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(path)
            r, w = os.pipe()
            socket.send_fds(s, [payload], [r, w, w])
            os.close(r)
            s.shutdown(socket.SHUT_WR)
            assert s.recv(100) == b""  # closed without a pid
            with pytest.raises(BrokenPipeError):  # the zygote closed its copy of the read end too
                os.write(w, b"x")
            os.close(w)
    proc = _start(path)
    assert _hello(proc)["pid"] != proc.pid
    proc.communicate("exit 0\n", timeout=30)


@pytest.mark.skipif(os.environ.get("FLARE_TEST_ZYGOTE") == "0" or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the CPU suite's zygote (conftest.py)")
def test_the_suite_forks_its_workers():
    """The CPU suite's workers come from its zygote (conftest.py): a worker started as the
    reference executor and flare-prepare start theirs is a child of the zygote."""
    assert zygote.ENV in os.environ
    proc = subprocess.Popen(zygote.worker_command(WORKER), cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    hello = _hello(proc)
    assert hello["pid"] != proc.pid
    assert "flare.zygote" in Path(f"/proc/{hello['ppid']}/cmdline").read_text()
    proc.communicate("exit 0\n", timeout=30)


def _gone(pid: int, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return True
        if stat.rsplit(")", 1)[-1].split()[:1] in (["Z"], ["X"]):
            return True
        time.sleep(0.05)
    return False


if __name__ == "__main__":
    sys.exit(_worker())
