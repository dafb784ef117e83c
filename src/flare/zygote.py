"""Worker processes forked from a preloaded process instead of started afresh.

The torch side of Flare runs in worker processes (``flare.prepare.worker`` for
``flare-prepare``, ``flare.prepare.reference_worker`` for the reference executor),
and each one spends most of its start importing torch and Transformers (about 8 s
on a 2-core machine, before it does any work). Where many workers are started one
after another (a test suite, a CPU machine restarting servers), a *zygote* imports
those modules once and forks a child for each worker:

    python -m flare.zygote serve SOCKET [--preload MODULE,...]     # the zygote (PRELOAD by default)
    FLARE_WORKER_ZYGOTE=SOCKET flare-serve CORE ...                # its clients

With ``FLARE_WORKER_ZYGOTE`` set, ``worker_command(module)`` is a small client
(``python -m flare.zygote run SOCKET MODULE ARGS...``, no torch) in place of
``python -m MODULE ARGS...``. The client hands the zygote its standard input,
output and error, environment and working directory; the zygote forks, and the
child runs the module as ``__main__`` with them, in a process of its own as a
fresh worker would (nothing runs in the zygote but imports). The client forwards
the signals it is sent to the child, exits with the child's status, and the zygote
kills a child whose client is gone (killed). A zygote that is not there, or that
was started with other values of the variables its imports read (``TRITON_*``,
``TORCH*``, ``HF_*``, ...: ``SENSITIVE``), refuses nothing silently: the client
then runs the module itself, as without a zygote.

Only the Linux process model is supported (``os.fork``, ``SCM_RIGHTS``, pidfds).
Use it on CPU machines: on a GPU machine a worker's CUDA context is made after the
fork in any case, but nothing here has been qualified there.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import struct
import sys

ENV = "FLARE_WORKER_ZYGOTE"
# Environment variables that modules read when they are imported: a client whose values
# differ from the zygote's runs its module itself. OMP_NUM_THREADS differs on purpose
# (the reference executor's --torch-threads): the child sets torch's thread count.
SENSITIVE = ("TRITON_", "TORCH", "PYTORCH_", "CUDA_", "NVIDIA_", "HF_", "TRANSFORMERS_", "TOKENIZERS_", "TQDM_",
             "PYTHON", "OMP_", "KMP_", "MKL_", "OPENBLAS_", "GOMP_", "LD_", "NCCL_", "XDG_CACHE_HOME")
_HEADER = struct.Struct("!I")
# What ``serve`` imports when not told: the workers' heavy imports (torch, Transformers and
# its model-building machinery, the preparation and reference worker modules).
PRELOAD = ("torch", "transformers", "transformers.modeling_utils", "flare.prepare.programs", "flare.prepare.worker",
           "flare.prepare.reference_worker", "flare.prepare.recipes")


def worker_command(module: str) -> list[str]:
    """The command that runs ``python -m module``: through the zygote when one is set."""
    path = os.environ.get(ENV)
    if path:
        return [sys.executable, "-m", "flare.zygote", "run", path, module]
    return [sys.executable, "-m", module]


def _sensitive(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(SENSITIVE) and k != "OMP_NUM_THREADS"}


# -- the client ------------------------------------------------------------


def _run_client(path: str, module: str, args: list[str]) -> int:
    request = json.dumps({"module": module, "args": args, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)
        socket.send_fds(sock, [_HEADER.pack(len(request)) + request], [0, 1, 2])
        reader = sock.makefile("rb")
        first = reader.readline().split()
    except OSError:
        first = []
    if first[:1] != [b"pid"]:  # no zygote, or one that refuses (another environment): run it here
        os.execv(sys.executable, [sys.executable, "-m", module, *args])
    child = int(first[1])

    def forward(signum, _frame):
        try:
            os.kill(child, signum)
        except ProcessLookupError:
            pass

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(s, forward)
    line = reader.readline().split()  # (signals forwarded meanwhile: the read resumes, PEP 475)
    if line[:1] != [b"exit"]:  # the zygote is gone: so is the child's only waiter
        forward(signal.SIGKILL, None)
        return 1
    code = int(line[1])
    if code < 0:  # killed by a signal: so is the client, as a process started afresh would be
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


# -- the zygote ------------------------------------------------------------


def _recv_request(conn: socket.socket) -> tuple[dict, list[int]]:
    conn.settimeout(10)
    data, fds, _flags, _addr = socket.recv_fds(conn, 1 << 16, 3)
    if len(data) < _HEADER.size:
        raise ConnectionError("short request")
    (n,) = _HEADER.unpack_from(data)
    data = data[_HEADER.size:]
    while len(data) < n:
        more = conn.recv(n - len(data))
        if not more:
            raise ConnectionError("request cut short")
        data += more
    conn.settimeout(None)
    return json.loads(data), fds


def _child(request: dict, fds: list[int]) -> None:
    """In the forked child: become the worker (never returns)."""
    code = 1
    try:
        for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD):
            signal.signal(s, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        import random

        random.seed()  # a fresh process's seed, not the zygote's state
        if "torch" in sys.modules and request["env"].get("OMP_NUM_THREADS", "").isdigit():
            sys.modules["torch"].set_num_threads(int(request["env"]["OMP_NUM_THREADS"]))
        import runpy

        sys.argv = [request["module"], *request["args"]]
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 (reported as a fresh interpreter would)
        import traceback

        traceback.print_exc()
    finally:
        try:
            import atexit

            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


class _Child:
    """A forked worker: its pidfd (readable once it exits) and its client's connection
    (readable only once the client is gone: it sends nothing after its request)."""

    def __init__(self, pid: int, conn: socket.socket):
        self.pid, self.conn, self.pidfd = pid, conn, os.pidfd_open(pid)
        self.done = False  # reaped
        self.watched = True  # its connection in the selector


def serve(path: str, preload: list[str]) -> None:
    """Listen at ``path`` (before the imports, so that clients queue rather than fall back
    while they run), import ``preload``, then fork a worker for each client."""
    import ctypes
    import importlib

    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: gone with its parent
    started_env = _sensitive(dict(os.environ))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    if os.path.exists(path):
        os.unlink(path)
    listener.bind(path)
    listener.listen(64)
    for module in preload:
        importlib.import_module(module)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    children: set[_Child] = set()
    try:
        while True:
            for key, _ in sel.select():
                if key.fileobj is listener:
                    child = _accept(listener, started_env, sel, children)
                    if child is not None:
                        children.add(child)
                        sel.register(child.pidfd, selectors.EVENT_READ, ("exited", child))
                        sel.register(child.conn, selectors.EVENT_READ, ("client", child))
                    continue
                what, child = key.data
                if child.done:
                    continue
                if what == "exited":  # reap it and tell its client how it ended
                    _, status = os.waitpid(child.pid, 0)
                    child.done = True
                    children.discard(child)
                    sel.unregister(child.pidfd)
                    if child.watched:
                        sel.unregister(child.conn)
                    os.close(child.pidfd)
                    try:
                        child.conn.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
                    except OSError:
                        pass
                    child.conn.close()
                else:  # its client is gone (killed): so goes the child, reaped when its pidfd says so
                    sel.unregister(child.conn)
                    child.watched = False
                    try:
                        os.kill(child.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
    finally:
        listener.close()
        if os.path.exists(path):
            os.unlink(path)


def _accept(listener: socket.socket, started_env: dict[str, str], sel, children: set[_Child]) -> _Child | None:
    conn, _ = listener.accept()
    try:
        request, fds = _recv_request(conn)
    except (OSError, ValueError, ConnectionError):
        conn.close()
        return None
    if len(fds) != 3 or _sensitive(request["env"]) != started_env:
        for fd in fds:
            os.close(fd)
        try:
            conn.sendall(b"refused: another environment\n")
        except OSError:
            pass
        conn.close()
        return None
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # nothing of the zygote's stays open in the worker
        sel.close()
        listener.close()
        for other in children:
            other.conn.close()
            os.close(other.pidfd)
        conn.close()
        _child(request, fds)
    for fd in fds:
        os.close(fd)
    child = _Child(pid, conn)
    try:
        conn.sendall(f"pid {pid}\n".encode())
    except OSError:
        pass  # its client is gone already: the selector sees it and kills the child
    return child


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) >= 3 and argv[0] == "run":
        return _run_client(argv[1], argv[2], argv[3:])
    if len(argv) >= 2 and argv[0] == "serve":
        preload = list(PRELOAD)
        if len(argv) >= 4 and argv[2] == "--preload":
            preload = [m for m in argv[3].split(",") if m]
        serve(argv[1], preload)
        return 0
    print("usage: python -m flare.zygote serve SOCKET [--preload MODULE,...]\n"
          "       python -m flare.zygote run SOCKET MODULE [ARGS...]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
