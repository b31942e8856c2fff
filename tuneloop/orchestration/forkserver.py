"""A warm interpreter that the flow's stage commands fork from, instead of importing torch,
transformers, PEFT and MLflow again in each of them.

Each DVC stage is its own process (``python -m stages.<name>``, as dvc.yaml says), and a
stage that touches a model spends 4-6 s importing the stack before its first line of work:
on the tiny demo model that is most of the stage, and most of a retrain. The retrain flow
therefore starts this server for its run (``serving``): it imports the stack once, then
listens on a Unix socket. DVC still runs each stage's command as written; the command's
first import (``stages/__init__.py``) calls ``run_forked``, which sends the command line,
working directory, environment and standard streams to the server and waits. The server
forks a copy of itself that becomes the stage: the same ``python -m`` module, arguments,
environment, directory and file descriptors, in a process group of its own. Its exit status
(or the signal that ended it) becomes the command's, so DVC sees what it would have seen.

Written here, not taken from ``multiprocessing.forkserver``: that one starts Python
functions from a parent that it spawned, and cannot stand in for a command that another
program (DVC, through a shell) started.

The command runs as it always did whenever the server cannot serve it exactly: no
``TUNELOOP_FORKSERVER`` set (``dvc repro`` by hand; ``off`` turns the server off), the
server not up yet or gone, another interpreter, Python options before ``-m``, or an
environment that differs from the server's in a variable that a preloaded library may read
when it is imported (``HF_HOME``, ``CUDA_VISIBLE_DEVICES``, ``PYTHONHASHSEED``:
``IMPORT_TIME``).

Signals sent to the command (Ctrl-C, a cancelled flow's SIGTERM) are passed to the stage,
even one sent as it starts, and the stage starts with a fresh interpreter's handlers for
them; a command killed outright (SIGKILL) takes the stage's process group with it, as a
stage killed outright would have gone. A fork copies only the thread that forks, so the
server refuses to serve with a second Python thread; it never runs a torch operation (no
OpenMP pool) and never starts CUDA.

A served stage may start its own ``python -m`` job as a fork of itself (``start_warm``): the
train stage's watcher does, so the job it watches starts warm too, still its child, in a
session of its own.

Only the preloaded third-party libraries are shared: the project's own modules (``tuneloop``,
``stages``) are dropped from the fork and imported from the stage's directory, so a DVC
experiment's workspace runs its own code.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import io
import json
import os
import runpy
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

import setproctitle

ENV = "TUNELOOP_FORKSERVER"
OFF = "off"  # ENV's value that runs every stage cold

# What the stages import before their first line of work (measured with ``-X importtime``).
PRELOAD = (
    "numpy",
    "torch",
    "transformers",
    "transformers.generation",
    "transformers.models.auto.modeling_auto",
    "transformers.models.auto.tokenization_auto",
    "peft",
    "safetensors.torch",
    "compressed_tensors",
    "mlflow",
    "mlflow.tracking",
    "sqlalchemy",
    "pydantic",
    "yaml",
    "orjson",
    "psutil",
)

# The variables a preloaded library (or the interpreter) may read when it starts or is
# imported: the cache folders, thread pools, devices, locale, hash seed. A command whose
# value differs from the server's runs cold; the others (MLflow's run, DVC's stage, PATH)
# are read when used, and the fork takes the command's.
IMPORT_TIME_PREFIXES = (
    *("HF_", "HUGGINGFACE", "TRANSFORMERS", "DATASETS", "SAFETENSORS", "TOKENIZERS", "PEFT"),
    *("TORCH", "PYTORCH", "CUDA", "NVIDIA", "NCCL", "OMP_", "MKL", "OPENBLAS", "KMP_"),
    *("PYTHON", "LD_", "LC_", "XDG_", "USE_", "NUMPY", "PYDANTIC", "SQLALCHEMY"),
)
IMPORT_TIME = frozenset({"HOME", "LANG", "LANGUAGE", "TZ", "TMPDIR", "TEMP", "TMP"})

# The project's modules, never shared: a fork imports them from its own directory.
OWN_PACKAGES = ("tuneloop", "stages", "flows")

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
FORWARDED_TOO = (signal.SIGUSR1, signal.SIGUSR2)

PARENT_POLL_S = 1.0
# A hung-up stage's time to act (the Slurm stage cancels its job, up to 120 s).
HANGUP_GRACE_S = 150.0
_HEADER = struct.Struct("!I")


def comparable_env(env: Mapping[str, str]) -> dict[str, str]:
    """The part of an environment that must match the server's for a fork to be exact."""
    return {
        key: value
        for key, value in env.items()
        if key in IMPORT_TIME or key.startswith(IMPORT_TIME_PREFIXES)
    }


def _send(sock: socket.socket, message: dict[str, Any], fds: list[int] | None = None) -> None:
    data = json.dumps(message).encode()
    payload = _HEADER.pack(len(data)) + data
    if fds:
        socket.send_fds(sock, [payload], fds)
    else:
        sock.sendall(payload)


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    chunks = b""
    while len(chunks) < size:
        chunk = sock.recv(size - len(chunks))
        if not chunk:
            raise ConnectionError("the other end closed the connection")
        chunks += chunk
    return chunks


def _recv(sock: socket.socket, max_fds: int = 0) -> tuple[dict[str, Any], list[int]]:
    fds: list[int] = []
    if max_fds:
        head, fds, _, _ = socket.recv_fds(sock, _HEADER.size, max_fds)
        if len(head) < _HEADER.size:
            head += _recv_exact(sock, _HEADER.size - len(head))
    else:
        head = _recv_exact(sock, _HEADER.size)
    (size,) = _HEADER.unpack(head)
    return json.loads(_recv_exact(sock, size)), fds


# --- the command's side ----------------------------------------------------------------


def _module_command() -> tuple[str, list[str]] | None:
    """``(module, args)`` when this process is exactly ``python -m module args``, else None."""
    argv = list(getattr(sys, "orig_argv", []))
    if len(argv) < 3 or argv[1] != "-m":
        return None  # other options before -m, or not started with -m
    return argv[2], argv[3:]


def run_forked() -> None:
    """Run this ``python -m`` command in a fork of the server named by ``TUNELOOP_FORKSERVER``
    and exit as it did; return (so that the command runs here) when the server cannot."""
    path = os.environ.get(ENV)
    command = _module_command()
    if not path or command is None:
        return
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)
        hello = {"command": [command[0], *command[1]], "executable": sys.executable}
        _send(sock, hello | {"env": comparable_env(os.environ)})
        answer, _ = _recv(sock)
    except OSError:
        return  # not up yet, or gone: run cold
    if not answer.get("exact"):
        sock.close()
        return
    module, args = command
    request = {
        "module": module,
        "args": args,
        "argv": list(sys.orig_argv),
        "cwd": os.getcwd(),
        "env": dict(os.environ),
    }
    # Armed before the stage can exist: a signal sent once it runs (a flow cancelled as the
    # stage starts) is never lost to the moment before we know its pid.
    forward = _Forwarder()
    try:
        _send(sock, request, [0, 1, 2])
    except OSError:
        forward.disarm()
        return  # not sent (a closed stream, the server gone): nothing ran, run cold
    try:
        started, _ = _recv(sock)
    except (OSError, ValueError) as error:
        # The stage may have started: running it again here could run it twice.
        print(f"{module}: the forkserver failed to start it ({error})", file=sys.stderr)
        os._exit(1)
    forward.to(int(started["pid"]))
    _wait_for(sock)


class _Forwarder:
    """Our signals, passed to the stage; those that come before its pid are held, and passed
    once it is known."""

    def __init__(self) -> None:
        self.pid: int | None = None
        self.held: list[int] = []
        self.before = {s: signal.signal(s, self) for s in (*FORWARDED, *FORWARDED_TOO)}

    def __call__(self, signum: int, _frame: object) -> None:
        if self.pid is None:
            self.held.append(signum)
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signum)

    def to(self, pid: int) -> None:
        self.pid = pid
        for signum in self.held:
            self(signum, None)

    def disarm(self) -> None:
        """Nothing was started: the handlers we found, and the held signals sent to us."""
        for each, handler in self.before.items():
            signal.signal(each, handler)
        for signum in self.held:
            os.kill(os.getpid(), signum)


def _wait_for(sock: socket.socket) -> NoReturn:
    """End as the stage ended. If our parent goes (DVC killed), we go too: the server then
    hangs up on the stage, as a stage sees its parent go."""
    parent = os.getppid()
    while not select.select([sock], [], [], PARENT_POLL_S)[0]:
        if os.getppid() != parent:
            os._exit(128 + signal.SIGHUP)
    try:
        ended, _ = _recv(sock)
    except (OSError, ValueError):
        os._exit(1)  # the server died with the stage: nothing to report but failure
    status = int(ended["status"])
    if status < 0:  # ended by a signal: end by the same one, as the caller would have seen
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
        os._exit(128 - status)
    os._exit(status)


# --- the server's side -----------------------------------------------------------------


def _say(message: str) -> None:
    # print, not logging: a handler set up here would be the stages' (basicConfig is a no-op
    # once the root logger has one).
    print(f"{time.strftime('%H:%M:%S')} forkserver: {message}", file=sys.stderr, flush=True)


def serve(path: Path) -> None:
    """Preload, then fork a stage for each command that connects, until our parent ends."""
    parent, started = os.getppid(), time.monotonic()
    before = dict(os.environ)
    mine = comparable_env(before)
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError as error:  # an optional library: its stages import it themselves
            _say(f"not preloaded: {error}")
    # A fork copies only the thread that forks: a Python thread holding a lock would leave
    # it held forever in the stage. (Native pools started at import, OpenBLAS's and
    # jemalloc's, restart or stop at a fork by their own atfork handlers.)
    if threading.active_count() != 1:
        raise SystemExit(f"forkserver: Python threads after the imports: {threading.enumerate()}")
    # What the imports set for themselves (setdefault: KMP_INIT_AT_FORK, ...): a fresh stage
    # sets it when it imports them, so a fork does too.
    imported_env = {key: value for key, value in os.environ.items() if key not in before}
    gc.freeze()  # the preloaded objects: no collection in a fork walks (and copies) them
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(16)
    listener.settimeout(PARENT_POLL_S)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    _say(f"preloaded in {time.monotonic() - started:.1f} s; serving on {path}")
    while os.getppid() == parent:
        _reap()
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        conn.settimeout(None)
        if os.fork() == 0:
            listener.close()
            _supervise(conn, mine, imported_env)
        conn.close()


def _reap() -> None:
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


def _mismatch(hello: dict[str, Any], uid: int, mine: dict[str, str]) -> str | None:
    """Why a command cannot be served exactly (names only: values may be secrets), or None."""
    if uid != os.getuid():
        return f"another user (uid {uid})"
    if hello["executable"] != sys.executable:
        return f"another interpreter ({hello['executable']})"
    theirs: dict[str, str] = hello["env"]
    if differ := sorted(k for k in theirs.keys() | mine.keys() if theirs.get(k) != mine.get(k)):
        return f"its environment differs in {', '.join(differ)}"
    return None


def _supervise(conn: socket.socket, mine: dict[str, str], imported_env: dict[str, str]) -> NoReturn:
    """In a fork of the server: check the command can be served exactly, fork the stage,
    report its pid and then its status."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        hello, _ = _recv(conn)
        command = " ".join(hello["command"])
        why = _mismatch(hello, struct.unpack("3i", creds)[1], mine)
        _send(conn, {"exact": why is None})
        if why is not None:
            _say(f"{command}: runs cold: {why}")
            os._exit(0)
        request, fds = _recv(conn, max_fds=3)
    except (OSError, ValueError, KeyError):
        os._exit(0)
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:
        conn.close()
        _become_stage(request, fds, imported_env)
    for fd in fds:
        os.close(fd)
    with contextlib.suppress(OSError):  # the stage does it too: whichever runs first
        os.setpgid(pid, pid)
    with contextlib.suppress(OSError):
        _send(conn, {"pid": pid})
    _say(f"{command}: pid {pid} in {request['cwd']}")
    status = _watch(conn, pid)
    ended = f"signal {-status}" if status < 0 else f"exit {status}"
    _say(f"{command}: pid {pid} ended ({ended}) after {time.monotonic() - started:.1f} s")
    with contextlib.suppress(OSError):
        _send(conn, {"status": status})
    os._exit(0)


def _watch(conn: socket.socket, pid: int) -> int:
    """The stage's status (negative: the signal that ended it). If the command goes first
    (killed, or its own parent gone), the stage is hung up on (SIGHUP, what a stage whose
    parent died acts on), and its process group is killed if it is still there after
    ``HANGUP_GRACE_S``."""
    pidfd = os.pidfd_open(pid)
    try:
        ready = select.select([pidfd, conn.fileno()], [], [])[0]
        if conn.fileno() not in ready or conn.recv(1, socket.MSG_PEEK):
            return _status(pid)  # ended (the command sends nothing more while it waits)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGHUP)
        if not select.select([pidfd], [], [], HANGUP_GRACE_S)[0]:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        return _status(pid)
    finally:
        os.close(pidfd)


def _status(pid: int) -> int:
    _, status = os.waitpid(pid, 0)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _become_stage(
    request: dict[str, Any], fds: list[int], imported_env: dict[str, str]
) -> NoReturn:
    """Turn this fork into ``python -m <module> <args>`` as the command would have run it,
    and end as its interpreter would: the same status, threads joined, atexit handlers run,
    streams flushed. Not through the interpreter's own exit, which would also tear down every
    preloaded module: seconds, on a stage that ran in a fraction of one."""
    os.setpgid(0, 0)
    _fresh_handlers()
    setproctitle.setproctitle(" ".join(request["argv"]))  # `ps` shows the command's line
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    env = imported_env | request["env"]
    env.pop(ENV, None)  # the stage is served: commands it starts run cold
    _fresh(env, [request["module"], *request["args"]])
    sys.path[0] = request["cwd"]
    # ... but the job it starts itself may be a fork of it (``start_warm``): said in this
    # module as the stage's directory has it, the one the stage imports.
    importlib.import_module("tuneloop.orchestration.forkserver").mark_served()
    if isinstance(sys.stdout, io.TextIOWrapper):  # line by line to a terminal, as it starts
        sys.stdout.reconfigure(line_buffering=os.isatty(1))
    os._exit(_run_main(request["module"]))


def _fresh_handlers() -> None:
    """A fresh interpreter's handlers for the signals a command passes on. Not those of the
    server or of the stage that forks: a Python handler of theirs would run in the fork, and
    what they ignore the command may not (it passes every one of them on)."""
    for signum in (*FORWARDED, *FORWARDED_TOO):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _fresh(env: Mapping[str, str], argv: list[str]) -> None:
    """What a fork shares with its server but a fresh ``python -m`` would not have: the
    environment, the project's own modules (imported afresh), numpy's global generator (a
    fresh process's, not the server's copy), and ``sys.argv``."""
    os.environ.clear()
    os.environ.update(env)
    for name in list(sys.modules):
        if name.split(".")[0] in OWN_PACKAGES:
            del sys.modules[name]
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    sys.argv = argv


def _run_main(module: str) -> int:
    """Run ``module`` as ``__main__``; the exit status the interpreter would give it."""
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as done:
        if done.code is None or isinstance(done.code, int):
            code = done.code or 0
        else:
            print(done.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # MLflow's end of run, logging's flush, ...
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    return code


# --- a served stage's own job ----------------------------------------------------------

# Set in a stage the server forked: its interpreter holds the preloaded stack.
_served = False


def mark_served() -> None:
    """Say that this process is a stage the server forked (``_become_stage`` calls it)."""
    global _served
    _served = True


class Forked:
    """A command started by ``start_warm``: the part of ``subprocess.Popen`` a caller that
    waits for its child uses (``pid``, ``poll``, ``wait``, ``returncode``: negative for the
    signal that ended it)."""

    def __init__(self, pid: int, args: Sequence[str]) -> None:
        self.pid = pid
        self.args = list(args)
        self.returncode: int | None = None
        self._pidfd = os.pidfd_open(pid)

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
                os.close(self._pidfd)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None and not select.select([self._pidfd], [], [], timeout)[0]:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        pid, status = os.waitpid(self.pid, 0) if self.returncode is None else (0, 0)
        if pid:
            self.returncode = os.waitstatus_to_exitcode(status)
            os.close(self._pidfd)
        assert self.returncode is not None
        return self.returncode


def start_warm(
    command: Sequence[str], env: Mapping[str, str], before: Callable[[], None] | None = None
) -> Forked | None:
    """Start ``command``, a ``python -m module args`` of this interpreter, as a fork of this
    process in a session of its own (``start_new_session``), with ``env`` and no file
    descriptor but the standard streams (``close_fds``); ``before`` runs in it first
    (``preexec_fn``). None when that would not be exact, and the caller starts a process:
    this process is not a stage the server forked (so it has not imported the stack the
    command needs), it runs a second Python thread, or ``env`` differs from this process's
    in a variable read at import (``IMPORT_TIME``).

    The train stage's watcher starts its job so: the job, the process that trains, then
    skips the 5-10 s of imports a process of its own spends. It is still the watcher's child,
    in its own session, and ends like a process (its status, or the signal that ended it).
    """
    if not _served or list(command[:2]) != [sys.executable, "-m"] or len(command) < 3:
        return None
    if threading.active_count() != 1 or comparable_env(env) != comparable_env(os.environ):
        return None
    for stream in (sys.stdout, sys.stderr):  # nothing buffered here is written twice
        stream.flush()
    pid = os.fork()
    if pid:
        return Forked(pid, command)
    try:
        os.setsid()
        for fd in [int(name) for name in os.listdir("/proc/self/fd")]:
            if fd > 2:
                with contextlib.suppress(OSError):
                    os.close(fd)
        _fresh_handlers()
        if before is not None:
            before()
        setproctitle.setproctitle(" ".join(command))
        _fresh(env, [command[2], *command[3:]])
    except BaseException:
        traceback.print_exc()
        os._exit(127)
    os._exit(_run_main(command[2]))


def _answers(path: Path) -> bool:
    """Whether a server listens at ``path`` (the fork that answers sees us hang up, and ends)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(path))
        except OSError:
            return False
    return True


@contextlib.contextmanager
def serving(repo: Path, logs: Path) -> Iterator[Path | None]:
    """A forkserver for the stage commands started inside the block (``TUNELOOP_FORKSERVER``
    is set in this process's environment until it ends): its socket's path. The server
    preloads while the first stages run cold, and ends with the block or with this process;
    its output goes to ``logs``/forkserver.log. With ``TUNELOOP_FORKSERVER=off`` none starts
    (None): every stage runs cold. Inside another block whose server answers, that one
    serves (the demo holds one for all its months)."""
    current = os.environ.get(ENV)
    if current == OFF:
        yield None
        return
    if current and _answers(Path(current)):  # an enclosing block's (the demo's months)
        yield Path(current)
        return
    folder = Path(tempfile.mkdtemp(prefix="tuneloop-fork-"))  # 0700: ours alone
    path = folder / "stages.sock"  # short: a socket's path is at most 107 bytes
    logs.mkdir(parents=True, exist_ok=True)
    with (logs / "forkserver.log").open("ab") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "tuneloop.orchestration.forkserver", str(path)],
            cwd=repo,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a terminal's Ctrl-C reaches the stages through DVC
        )
    os.environ[ENV] = str(path)
    try:
        yield path
    finally:
        if current is None:
            os.environ.pop(ENV, None)
        else:  # a server that no longer answered: named again, as found
            os.environ[ENV] = current
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        path.unlink(missing_ok=True)
        folder.rmdir()


if __name__ == "__main__":
    serve(Path(sys.argv[1]))
