"""Worker processes forked from a preloaded process instead of started afresh.

The torch side of Flare runs in worker processes (``flare.prepare.worker`` for
``flare-prepare``, ``flare.prepare.reference_worker`` for the reference executor),
and each one spends most of its start importing torch and Transformers (about 8 s
on a 2-core machine, before it does any work). Where many workers are started one
after another (a test suite, a CPU machine restarting servers), a *zygote* imports
those modules once and forks a child for each worker:

    python -m flare.zygote serve SOCKET [--preload M,...] [--exit-with-parent]  # the zygote
    FLARE_WORKER_ZYGOTE=SOCKET flare-serve CORE ...                             # its clients

With ``FLARE_WORKER_ZYGOTE`` set, ``worker_command(module)`` is a small client
(``python -m flare.zygote run SOCKET MODULE ARGS...``, no torch) in place of
``python -m MODULE ARGS...``. The client hands the zygote its standard input,
output and error, arguments, environment, working directory and ignored signals;
the zygote forks, and the child runs the module as ``__main__`` with them, in a
process of its own, and exits as the interpreter does (threads joined, exit
functions run, standard streams flushed) without tearing its modules down (``_exit``:
2 s with torch imported; so files the worker leaves open unflushed are lost).
Nothing runs in the zygote but imports.
The client forwards SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1 and SIGUSR2 to the
child and ends as the child did (its exit code, or killed by the same signal); a
client that is killed takes its child with it (the zygote sees its connection
close), and so does a zygote that goes away.

What a forked worker does not get from its client: values read when the preloaded
modules were imported. A client whose import-time variables (``SENSITIVE``:
``TRITON_*``, ``TORCH*``, ``HF_*``, locale, ``HOME``, ...) differ from the zygote's,
or that finds no zygote, runs the module itself, as without one (quietly: the result
is the same, only slower). ``OMP_NUM_THREADS`` may differ when the client sets it (the
reference executor's ``--torch-threads``): the child sets torch's thread count (not
OpenBLAS's or OpenMP's other users', which keep the zygote's). The process's limits,
affinity, session and hash seed are the zygote's.

Only the Linux process model is supported (``os.fork``, ``SCM_RIGHTS``, pidfds).
Meant for CPU machines; the GPU suite does not use it.
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
# differ from the zygote's runs its module itself.
SENSITIVE = ("TRITON_", "TORCH", "PYTORCH_", "CUDA_", "NVIDIA_", "HF_", "TRANSFORMERS_", "TOKENIZERS_", "TQDM_",
             "PYTHON", "OMP_", "KMP_", "MKL_", "OPENBLAS_", "GOMP_", "LD_", "NCCL_", "XDG_", "HOME", "TMPDIR",
             "LANG", "LC_")
# What the worker modules set before their imports (they read them), and so the zygote before its.
WORKER_DEFAULTS = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
                   "TQDM_DISABLE": "1"}
# What ``serve`` imports when not told: the workers' heavy imports (torch, Transformers and
# its model-building machinery, the preparation modules; not the worker modules, which
# run as ``__main__``).
PRELOAD = ("torch", "transformers", "transformers.modeling_utils", "flare.prepare.programs", "flare.prepare.recipes")
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
_HEADER = struct.Struct("!I")
_PR_SET_PDEATHSIG = 1


def worker_command(module: str) -> list[str]:
    """The command that runs ``python -m module``: through the zygote when one is set."""
    path = os.environ.get(ENV)
    if path:
        return [sys.executable, "-m", "flare.zygote", "run", path, module]
    return [sys.executable, "-m", module]


def _compared(env: dict[str, str]) -> dict[str, str]:
    env = {**WORKER_DEFAULTS, **env}
    return {k: v for k, v in env.items() if k.startswith(SENSITIVE) and k != "OMP_NUM_THREADS"}


def _threads(env: dict[str, str]) -> int | None:
    value = env.get("OMP_NUM_THREADS", "")
    return int(value) if value.isdigit() and int(value) > 0 else None


# -- the client ------------------------------------------------------------


def _run_client(path: str, module: str, args: list[str]) -> int:
    ignored = [int(s) for s in FORWARDED if signal.getsignal(s) is signal.SIG_IGN]  # kept ignored, as across exec
    request = json.dumps({"module": module, "args": args, "env": dict(os.environ), "cwd": os.getcwd(),
                          "ignored": ignored}).encode()
    # Until the child is known, signals are kept, then forwarded (or, running the module here, raised again).
    pending: list[int] = []
    target: list[int] = []  # the child's pidfd, once known

    def forward(signum, _frame=None):
        if not target:
            pending.append(signum)
            return
        try:
            signal.pidfd_send_signal(target[0], signum)
        except OSError:  # gone (or never seen: -1)
            pass

    for s in FORWARDED:
        if s not in ignored:
            signal.signal(s, forward)
    first: list[bytes] = []
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)
        data = _HEADER.pack(len(request)) + request
        sent = socket.send_fds(sock, [data], [0, 1, 2])
        sock.sendall(data[sent:])
        reader = sock.makefile("rb")
        first = reader.readline().split()
    except OSError:
        pass
    if first[:1] != [b"pid"]:  # no zygote, or one that refuses (another environment): run it here
        for s in FORWARDED:
            if s not in ignored:
                signal.signal(s, signal.SIG_DFL)
        for s in pending:  # what this process was sent meanwhile ends it, as it would have
            os.kill(os.getpid(), s)
        os.execv(sys.executable, [sys.executable, "-m", module, *args])
    try:  # signals go to this process, not to whatever reuses its pid after the zygote reaps it
        target.append(os.pidfd_open(int(first[1])))
    except ProcessLookupError:
        target.append(-1)
    for s in pending:
        forward(s)
    line = reader.readline().split()  # (signals forwarded meanwhile: the read resumes, PEP 475)
    if line[:1] != [b"exit"]:  # the zygote is gone (its children die with it): make sure
        forward(signal.SIGKILL)
        return 1
    code = int(line[1])
    if code < 0:  # killed by a signal: so is the client, as a process started afresh would be
        if -code != signal.SIGKILL:
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        return 128 - code
    return code


# -- the zygote ------------------------------------------------------------


def _recv_request(conn: socket.socket) -> tuple[dict, list[int]]:
    """The client's request and its three descriptors (closed here if the request is bad)."""
    conn.settimeout(5)
    data, fds, _flags, _addr = socket.recv_fds(conn, 1 << 16, 3)
    try:
        if len(data) < _HEADER.size or len(fds) != 3:
            raise ValueError("short request")
        (n,) = _HEADER.unpack_from(data)
        data = data[_HEADER.size:]
        while len(data) < n:
            more = conn.recv(n - len(data))
            if not more:
                raise ValueError("request cut short")
            data += more
        request = json.loads(data)
        if not (isinstance(request, dict) and isinstance(request.get("module"), str)
                and isinstance(request.get("args"), list) and all(isinstance(a, str) for a in request["args"])
                and isinstance(request.get("env"), dict) and isinstance(request.get("cwd"), str)
                and isinstance(request.get("ignored"), list)):
            raise ValueError("malformed request")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    conn.settimeout(None)
    return request, fds


def _child(request: dict, fds: list[int], zygote: int, env: dict[str, str]) -> None:
    """In the forked child: become the worker, then exit as ``_exit`` says (never returns)."""
    code: object = 1
    interrupted = False
    try:
        import ctypes

        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # gone with the zygote, as its client would be
        if os.getppid() != zygote:
            os._exit(1)
        ignored = set(request["ignored"])
        for s in (*FORWARDED, signal.SIGCHLD):
            signal.signal(s, signal.SIG_IGN if s in ignored else
                          signal.default_int_handler if s == signal.SIGINT else signal.SIG_DFL)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.environ.clear()
        os.environ.update(env)
        os.chdir(request["cwd"])
        sys.path[0] = os.getcwd()  # as ``python -m`` puts it
        import tempfile

        tempfile.tempdir = None  # from this environment
        np = sys.modules.get("numpy")
        if np is not None:
            np.random.seed()  # (random reseeds itself after a fork; numpy's global state does not)
        threads = _threads(env)
        if threads and "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(threads)
        import runpy

        sys.argv = [request["module"], *request["args"]]
        signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)  # blocked by the zygote around the fork
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = e.code
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        interrupted = True
    except BaseException:  # noqa: BLE001 (reported as the interpreter reports it)
        sys.excepthook(*sys.exc_info())
    _exit(code, interrupted)


def _exit(code: object, interrupted: bool) -> None:
    """A fresh interpreter's exit, less the teardown of its modules (about 2 s once torch and
    Transformers are imported, the worker's whole exit otherwise): non-daemon threads joined,
    exit functions run, standard streams flushed. Files the worker left open and unflushed
    are not flushed (close them: the workers do)."""
    status = 130 if interrupted else 1
    try:
        if not interrupted:
            if code is None or isinstance(code, int):
                status = (code or 0) & 0xFF
            else:  # SystemExit("message"): printed, status 1
                print(code, file=sys.stderr)
        import atexit
        import threading

        for step in (threading._shutdown, atexit._run_exitfuncs):
            try:
                step()
            except BaseException:  # noqa: BLE001 (as the interpreter reports an error at exit)
                sys.unraisablehook(_Unraisable(*sys.exc_info(), f"Exception ignored in {step.__name__}", None))
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        if interrupted:  # an uncaught KeyboardInterrupt: killed by SIGINT, as CPython does
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        os._exit(status)


class _Unraisable:
    def __init__(self, exc_type, exc_value, exc_traceback, err_msg, obj):
        self.exc_type, self.exc_value, self.exc_traceback = exc_type, exc_value, exc_traceback
        self.err_msg, self.object = err_msg, obj


class _Child:
    """A forked worker: its pidfd (readable once it exits) and its client's connection
    (readable only once the client is gone: it sends nothing after its request)."""

    def __init__(self, pid: int, conn: socket.socket):
        self.pid, self.conn, self.pidfd = pid, conn, os.pidfd_open(pid)
        self.done = False  # reaped
        self.watched = True  # its connection in the selector


def serve(path: str, preload: list[str], exit_with_parent: bool = False) -> None:
    """Listen at ``path`` (before the imports, so that clients queue rather than fall back
    while they run), import ``preload``, then fork a worker for each client."""
    import importlib

    owner = os.getpid()
    if exit_with_parent:
        import ctypes

        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    for k, v in WORKER_DEFAULTS.items():
        os.environ.setdefault(k, v)
    before = dict(os.environ)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    staging = f"{path}.{owner}"  # renamed to ``path`` once listening: a client never finds it unready
    if os.path.exists(staging):
        os.unlink(staging)
    old_umask = os.umask(0o177)
    try:
        listener.bind(staging)
    finally:
        os.umask(old_umask)
    listener.listen(64)
    os.rename(staging, path)
    try:
        for module in preload:
            importlib.import_module(module)
        # What the imports set themselves (torch: TORCHINDUCTOR_CACHE_DIR) is not compared.
        own = {k for k in {*before, *os.environ} if before.get(k) != os.environ.get(k)}
        started = _compared({k: v for k, v in os.environ.items() if k not in own})
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        _loop(listener, started, own, owner)
    finally:
        if os.getpid() == owner:  # never in a forked child that unwinds through here
            listener.close()
            if os.path.exists(path):
                os.unlink(path)


def _loop(listener: socket.socket, started: dict[str, str], own: set[str], owner: int) -> None:
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    children: set[_Child] = set()
    while True:
        for key, _ in sel.select():
            if key.fileobj is listener:
                child = _accept(listener, started, own, owner, sel, children)
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
                    signal.pidfd_send_signal(child.pidfd, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def _accept(listener, started: dict[str, str], own: set[str], owner: int, sel, children) -> _Child | None:
    try:
        conn, _ = listener.accept()
    except OSError:
        return None
    uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[1]
    if uid != os.getuid():
        conn.close()
        return None
    try:
        request, fds = _recv_request(conn)
    except (OSError, ValueError):
        conn.close()
        return None
    env = request["env"]
    # What the zygote's imports set (and its modules now use) stays in the child where the client has
    # nothing else for it.
    theirs = _compared({k: v for k, v in env.items() if k not in own})
    differ = {k for k in {*theirs, *started} if theirs.get(k) != started.get(k)} | {
        k for k in own if env.get(k, os.environ.get(k)) != os.environ.get(k)}
    if ("OMP_NUM_THREADS" in env and _threads(env) is None) or (
            "OMP_NUM_THREADS" not in env and "OMP_NUM_THREADS" in os.environ):
        differ.add("OMP_NUM_THREADS")
    if differ:
        print(f"flare.zygote: {request['module']} runs afresh: its environment differs in {', '.join(sorted(differ))}",
              file=sys.stderr, flush=True)
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
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)  # until the child has reset its handlers
    try:
        pid = os.fork()
    except OSError:
        pid = -1
    if pid == 0:  # nothing of the zygote's stays open in the worker
        sel.close()
        listener.close()
        for other in children:
            other.conn.close()
            os.close(other.pidfd)
        conn.close()
        _child(request, fds, owner, {**{k: os.environ[k] for k in own if k in os.environ}, **env})
    signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
    for fd in fds:
        os.close(fd)
    if pid < 0:
        conn.close()  # its client runs nothing: it reads no pid, and falls back
        return None
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
        preload, rest = list(PRELOAD), argv[2:]
        exit_with_parent = "--exit-with-parent" in rest
        rest = [a for a in rest if a != "--exit-with-parent"]
        if len(rest) == 2 and rest[0] == "--preload":
            preload = [m for m in rest[1].split(",") if m]
        elif rest:
            return _usage()
        serve(argv[1], preload, exit_with_parent)
        return 0
    return _usage()


def _usage() -> int:
    print("usage: python -m flare.zygote serve SOCKET [--preload MODULE,...] [--exit-with-parent]\n"
          "       python -m flare.zygote run SOCKET MODULE [ARGS...]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
