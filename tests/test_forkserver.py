"""A stage command served by the forkserver runs as it would have run on its own.

A real server (``forkserver.serving``, its preload included) and real commands: ``python -m
pkg.job`` in a scratch folder, whose package calls ``run_forked`` first as ``stages/``
does. The job says whether torch was imported before it imported anything (preloaded: it
ran in a fork), and what it was given; the command must end with its status or signal, pass
its streams and signals, and run cold whenever a fork would not be exact.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import wait_until
from tuneloop.orchestration import forkserver

pytestmark = pytest.mark.fast

INNER = """
import json, os, signal, sys
from pkg.handlers import handlers

how, held = sys.argv[1], int(sys.argv[2])
try:
    os.fstat(held)
    inherited = True
except OSError:
    inherited = False
print(json.dumps({
    "preloaded": "torch" in sys.modules,
    "own_session": os.getsid(0) == os.getpid(),
    "parent": os.getppid(),
    "inherited": inherited,
    "var": os.environ.get("TUNELOOP_INNER_VAR"),
    "handlers": handlers(),
    "title": open("/proc/self/cmdline").read().replace("\\0", " ").strip(),
    "argv": sys.argv[1:],
}), flush=True)
if how == "signal":
    os.kill(os.getpid(), signal.SIGTERM)
sys.exit(5)
"""

INIT = "from tuneloop.orchestration.forkserver import run_forked\n\nrun_forked()\n"

# What a process's handlers for these signals are: a fresh interpreter's, ignored, or another's.
SIGNALS = ("INT", "TERM", "HUP")
HANDLERS = """
import signal

FRESH = {"INT": signal.default_int_handler, "TERM": signal.SIG_DFL, "HUP": signal.SIG_DFL}


def handlers():
    found = {name: signal.getsignal(getattr(signal, "SIG" + name)) for name in FRESH}
    return {
        name: "ignored" if h == signal.SIG_IGN else "fresh" if h == FRESH[name] else repr(h)
        for name, h in found.items()
    }
"""


# A stage's, and its warm job's: whatever the server, the stage or this test runner ignore.
FRESH_HANDLERS = dict.fromkeys(SIGNALS, "fresh")


def started_here() -> dict[str, str]:
    """The handlers of a Python this process starts cold: fresh, but for what this process
    ignores, which it inherits (a shell starts its background jobs ignoring SIGINT)."""
    return {
        name: "ignored"
        if signal.getsignal(getattr(signal, f"SIG{name}")) == signal.SIG_IGN
        else "fresh"
        for name in SIGNALS
    }


def default_signals() -> None:
    """``preexec_fn`` of a process the test signals: SIGTERM ends it, whatever this test
    runner ignores."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


JOB = """
import atexit, json, os, signal, sys, threading, time
from pkg.handlers import handlers

mode = sys.argv[1]
print(json.dumps({
    "preloaded": "torch" in sys.modules,
    "argv": sys.argv[1:],
    "cwd": os.getcwd(),
    "var": os.environ.get("TUNELOOP_JOB_VAR"),
    "served_again": "TUNELOOP_FORKSERVER" in os.environ,
    "own_group": os.getpgid(0) == os.getpid(),
    "line": sys.stdin.readline().strip(),
    "title": open("/proc/self/cmdline").read().replace("\\0", " ").strip(),
    "handlers": handlers(),
}), flush=True)
if mode == "exit":
    sys.exit(3)
if mode == "signal":
    os.kill(os.getpid(), signal.SIGTERM)
if mode == "raise":
    raise RuntimeError("the job broke")
if mode == "ending":
    threading.Thread(target=lambda: (time.sleep(0.3), print("thread joined"))).start()
    atexit.register(lambda: print("atexit ran"))
if mode == "warm":  # a served stage starting its own job, as the train stage's watcher does
    from tuneloop.orchestration import forkserver

    held = os.open(sys.argv[2] + ".held", os.O_CREAT | os.O_WRONLY)  # not for the job
    before = sys.argv[2] + ".before"
    ended = {}
    for how in ("exit", "signal"):
        started = forkserver.start_warm(
            [sys.executable, "-m", "pkg.inner", how, str(held)],
            dict(os.environ, TUNELOOP_INNER_VAR="inner"),
            before=lambda: open(before, "w").close(),
        )
        ended[how] = started and started.wait(60)
    print(json.dumps({"stage": os.getpid(), "ended": ended}), flush=True)
if mode == "wait":
    def said(name):
        def handler(signum, frame):
            with open(sys.argv[2] + ".part", "w") as out:  # whole when it appears
                out.write(name)
            os.replace(sys.argv[2] + ".part", sys.argv[2])
            sys.exit(0)
        return handler
    signal.signal(signal.SIGTERM, said("TERM"))
    signal.signal(signal.SIGHUP, said("HUP"))
    open(sys.argv[2] + ".ready", "w").close()
    time.sleep(60)
"""


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, str]]]:
    """The scratch folder and the environment that has its commands served."""
    folder = tmp_path_factory.mktemp("forkserver")
    (folder / "pkg").mkdir()
    (folder / "pkg" / "__init__.py").write_text(INIT)
    (folder / "pkg" / "job.py").write_text(JOB)
    (folder / "pkg" / "inner.py").write_text(INNER)
    (folder / "pkg" / "handlers.py").write_text(HANDLERS)
    with forkserver.serving(folder, folder / "logs") as path:
        env = dict(os.environ)
        os.environ.pop(forkserver.ENV)  # this process's other tests run as they would
        wait_until(path.exists, 180, "the forkserver's socket", step=0.2)
        yield folder, env


def job(
    served: tuple[Path, dict[str, str]], *args: str, env: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess[str], dict[str, object]]:
    folder, served_env = served
    done = subprocess.run(
        [sys.executable, "-m", "pkg.job", *args],
        cwd=folder,
        env=(env or served_env) | {"TUNELOOP_JOB_VAR": "given"},
        input="a line\n",
        capture_output=True,
        text=True,
        timeout=60,
    )
    return done, json.loads(done.stdout.splitlines()[0])


def test_a_served_command_gets_its_arguments_folder_streams_and_status(
    served: tuple[Path, dict[str, str]],
) -> None:
    done, said = job(served, "exit", "second")
    assert said["preloaded"], "the command ran cold"
    assert said["argv"] == ["exit", "second"]
    assert said["cwd"] == str(served[0])
    assert said["var"] == "given"
    assert said["line"] == "a line"
    assert said["own_group"], "the stage shares a process group with the server"
    assert not said["served_again"], "what the stage starts would ask to be served too"
    assert said["title"] == f"{sys.executable} -m pkg.job exit second", "ps shows the server"
    assert said["handlers"] == FRESH_HANDLERS, "the server's signal handlers"
    assert done.returncode == 3


def test_a_served_stage_starts_its_own_job_as_a_fork_of_itself(
    served: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    """The train stage's watcher starts its job so (``start_warm``): warm, and otherwise as
    ``Popen(start_new_session=True, preexec_fn=...)`` would have started it."""
    done, said = job(served, "warm", str(tmp_path / "mark"))
    assert said["preloaded"] and done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()[1:]]
    inner, stage = lines[:2], lines[2]
    assert stage["ended"] == {"exit": 5, "signal": -signal.SIGTERM}
    for each in inner:
        assert each["preloaded"], "the job imported the stack again"
        assert each["own_session"] and each["parent"] == stage["stage"]
        assert not each["inherited"], "the job holds the stage's files"
        assert each["var"] == "inner" and each["handlers"] == FRESH_HANDLERS
        assert each["title"] == " ".join([sys.executable, "-m", "pkg.inner", *each["argv"]])
    assert [each["argv"][0] for each in inner] == ["exit", "signal"]
    assert (tmp_path / "mark.before").exists()
    # Not a served stage (this test's process): the caller starts a process.
    assert forkserver.start_warm([sys.executable, "-m", "pkg.inner"], dict(os.environ)) is None


def test_a_stage_ended_by_a_signal_ends_its_command_by_that_signal(
    served: tuple[Path, dict[str, str]],
) -> None:
    done, said = job(served, "signal")
    assert said["preloaded"]
    assert done.returncode == -signal.SIGTERM


def test_a_failing_stage_prints_its_traceback_and_exits_1(
    served: tuple[Path, dict[str, str]],
) -> None:
    done, said = job(served, "raise")
    assert said["preloaded"]
    assert done.returncode == 1
    assert "RuntimeError: the job broke" in done.stderr


def test_the_stage_ends_as_an_interpreter_does(served: tuple[Path, dict[str, str]]) -> None:
    done, said = job(served, "ending")
    assert said["preloaded"]
    assert done.returncode == 0
    assert done.stdout.splitlines()[1:] == ["thread joined", "atexit ran"]


def test_an_environment_a_preloaded_library_reads_runs_the_command_cold(
    served: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    done, said = job(served, "exit", env=served[1] | {"HF_HOME": str(tmp_path)})
    assert not said["preloaded"], "served with another HF_HOME than the server imported with"
    assert done.returncode == 3


def test_no_server_runs_the_command_cold(served: tuple[Path, dict[str, str]]) -> None:
    gone = served[1] | {forkserver.ENV: str(served[0] / "no-such.sock")}
    done, said = job(served, "exit", env=gone)
    assert not said["preloaded"]
    assert done.returncode == 3


def start_waiting(served: tuple[Path, dict[str, str]], out: Path) -> subprocess.Popen[str]:
    folder, env = served
    command = subprocess.Popen(
        [sys.executable, "-m", "pkg.job", "wait", str(out)],
        cwd=folder,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    wait_until(Path(f"{out}.ready").exists, 60, "the stage to start", step=0.1)
    return command


def test_a_signal_to_the_command_reaches_the_stage(
    served: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    command = start_waiting(served, tmp_path / "said")
    command.send_signal(signal.SIGTERM)
    assert command.wait(timeout=30) == 0
    assert (tmp_path / "said").read_text() == "TERM"


def served_by_this_test(
    served: tuple[Path, dict[str, str]], tmp_path: Path, *args: str
) -> tuple[subprocess.Popen[str], socket.socket]:
    """``python -m pkg.job args`` sent to a server this test plays, to act at a moment the
    real one passes in microseconds; and the connection the command opened (its output is
    piped)."""
    folder, env = served
    path = tmp_path / "server.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(path))
        listener.listen(1)
        listener.settimeout(60)
        command = subprocess.Popen(
            [sys.executable, "-m", "pkg.job", *args],
            cwd=folder,
            env=env | {forkserver.ENV: str(path)},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            text=True,
        )
        conn, _ = listener.accept()
    return command, conn


def test_a_signal_sent_before_the_stages_pid_is_known_reaches_it(
    served: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    """The stage may run (and the flow be cancelled) before its pid reaches the command: the
    command holds the signal until then. This test answers as the server, to send the signal
    in that moment."""
    command, conn = served_by_this_test(served, tmp_path, "wait", str(tmp_path / "said"))
    with conn:
        forkserver._recv(conn)
        forkserver._send(conn, {"exact": True})
        _, fds = forkserver._recv(conn, max_fds=3)
        for fd in fds:
            os.close(fd)
        command.send_signal(signal.SIGTERM)
        with pytest.raises(subprocess.TimeoutExpired):
            command.wait(timeout=1)  # held, not the command's end
        stage = subprocess.Popen(["sleep", "60"], preexec_fn=default_signals)
        forkserver._send(conn, {"pid": stage.pid})
        assert stage.wait(timeout=30) == -signal.SIGTERM
        forkserver._send(conn, {"status": -signal.SIGTERM})
    assert command.wait(timeout=30) == -signal.SIGTERM


def test_a_server_gone_before_the_request_leaves_the_command_as_it_started(
    served: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    """Nothing ran, so the command runs cold, with the signal handlers it started with."""
    command, conn = served_by_this_test(served, tmp_path, "exit")
    with conn:
        forkserver._recv(conn)
        conn.shutdown(socket.SHUT_RD)  # the request is refused
        forkserver._send(conn, {"exact": True})
        out, _ = command.communicate(timeout=60)
    said = json.loads(out.splitlines()[0])
    assert not said["preloaded"] and said["handlers"] == started_here()
    assert command.returncode == 3


def test_a_command_killed_outright_hangs_up_on_its_stage(
    served: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    """As a stage whose parent died: the Slurm stage cancels its job on that SIGHUP."""
    command = start_waiting(served, tmp_path / "said")
    command.kill()
    command.wait(timeout=30)
    wait_until((tmp_path / "said").exists, 30, "the stage to be hung up on", step=0.1)
    assert (tmp_path / "said").read_text() == "HUP"


def test_off_starts_no_server_and_leaves_the_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(forkserver.ENV, forkserver.OFF)
    with forkserver.serving(tmp_path, tmp_path / "logs") as path:
        assert path is None
        assert os.environ[forkserver.ENV] == forkserver.OFF
    assert not (tmp_path / "logs").exists()


def test_a_block_inside_another_uses_its_server(
    served: tuple[Path, dict[str, str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The demo holds one server for all its months; each month's retrain uses it."""
    outer = served[1][forkserver.ENV]
    monkeypatch.setenv(forkserver.ENV, outer)
    with forkserver.serving(tmp_path, tmp_path / "logs") as path:
        assert path == Path(outer)
    assert os.environ[forkserver.ENV] == outer
    assert not (tmp_path / "logs").exists(), "a second server was started"
