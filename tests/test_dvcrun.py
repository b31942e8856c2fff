"""A flow's DVC call waits for another DVC command's locks, for a bounded time.

A tiny DVC repo (no git, no pipeline). Another process holds one of DVC's two
locks, as a person's ``dvc repro`` by hand would: the repo lock (held while
DVC reads, hashes and records; taken here with DVC's own lock class) or a
path lock (held on a stage's outs while its command runs; here a stage that
sleeps). The flow's call must wait and then run, or give up with a message
naming the holder, having run nothing.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tuneloop.orchestration.dvcrun import DvcLockTimeout, lock_holder, run_dvc

# The whole suite (`make test`): dvc repro
pytestmark = pytest.mark.slow

ENV = os.environ | {"DVC_NO_ANALYTICS": "1"}

# Holds DVC's repo lock for argv[1] seconds, then notes it let go, then lets go.
HOLD_REPO_LOCK = """
import sys, time
from dvc.lock import make_lock
lock = make_lock(".dvc/tmp/lock", tmp_dir=".dvc/tmp")
lock.lock()
time.sleep(float(sys.argv[1]))
with open("order.txt", "a") as order:
    order.write("hold\\n")
lock.unlock()
"""


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "dvc", "init", "--no-scm", "-q"], cwd=tmp_path, env=ENV, check=True
    )
    stages = {
        # Writes shared.txt (kept between runs) after a sleep: holds its path lock meanwhile.
        "writer": {
            "cmd": 'sleep "$(cat hold_s)" && echo hold >> order.txt && echo w > shared.txt',
            "always_changed": True,
            "outs": [{"shared.txt": {"cache": False, "persist": True}}],
        },
        "reader": {
            "cmd": "echo quick >> order.txt",
            "always_changed": True,
            "deps": ["shared.txt"],
        },
    }
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump({"stages": stages}))
    (tmp_path / "shared.txt").write_text("x\n")
    return tmp_path


def order(repo: Path) -> list[str]:
    path = repo / "order.txt"
    return path.read_text().split() if path.exists() else []


@pytest.fixture
def holder(repo: Path, request: pytest.FixtureRequest) -> Iterator[subprocess.Popen[bytes]]:
    """Another process holding a DVC lock: ``request.param`` = (which lock, for how long)."""
    which, seconds = request.param
    if which == "repo":
        command = [sys.executable, "-c", HOLD_REPO_LOCK, str(seconds)]
    else:
        (repo / "hold_s").write_text(str(seconds))
        command = [sys.executable, "-m", "dvc", "repro", "--single-item", "writer"]
    # Its own session, so that the writer's `sleep` goes with it at the end.
    process = subprocess.Popen(command, cwd=repo, env=ENV, start_new_session=True)
    rwlock = repo / ".dvc/tmp/rwlock"
    try:
        deadline = time.monotonic() + 120
        while not (
            lock_holder(repo) == process.pid
            if which == "repo"
            else rwlock.exists() and "writer" in rwlock.read_text()
        ):
            assert process.poll() is None, "the holder ended before taking the lock"
            assert time.monotonic() < deadline, "the holder never took the lock"
            time.sleep(0.1)
        yield process
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


@pytest.mark.parametrize("holder", [("repo", 4), ("path", 4)], indirect=True)
def test_waits_for_the_lock_then_runs(repo: Path, holder: subprocess.Popen[bytes]) -> None:
    done = run_dvc(["repro", "--single-item", "reader"], repo, ENV, wait_s=120)
    assert done.returncode == 0
    # It ran only once the holder was done with the lock.
    assert order(repo) == ["hold", "quick"]
    assert holder.wait(timeout=60) == 0


@pytest.mark.parametrize("holder", [("repo", 120), ("path", 120)], indirect=True)
def test_gives_up_after_the_wait_saying_who_holds_the_lock(
    repo: Path, holder: subprocess.Popen[bytes]
) -> None:
    started = time.monotonic()
    with pytest.raises(DvcLockTimeout) as error:
        run_dvc(["repro", "--single-item", "reader"], repo, ENV, wait_s=3)
    assert 3 <= time.monotonic() - started < 60
    message = str(error.value)
    assert message.startswith("`dvc repro --single-item reader` waited 3 s for another dvc")
    assert "Nothing was run" in message and "schedule.dvc_lock_wait_s" in message
    if lock_holder(repo) == holder.pid:
        assert f"the repo lock ({repo / '.dvc/tmp/lock'}, pid {holder.pid})" in message
    else:
        assert "is busy, it is being blocked by" in message and f"PID {holder.pid}" in message
    assert "quick" not in order(repo)  # nothing ran
    assert holder.poll() is None  # and the holder was left alone


def test_without_a_holder_it_runs_at_once_and_returns_the_exit_code(repo: Path) -> None:
    assert run_dvc(["repro", "--single-item", "reader"], repo, ENV, wait_s=0).returncode == 0
    assert order(repo) == ["quick"]
    # A failure that is not about a lock is returned, not retried.
    started = time.monotonic()
    assert run_dvc(["repro", "no-such-stage"], repo, ENV, wait_s=60).returncode != 0
    assert time.monotonic() - started < 30
