"""Running a DVC command from a flow: wait for another DVC command's locks, for a bounded time.

Two DVC commands in one workspace (the flow's, and a ``dvc repro`` someone runs
by hand) meet on two locks:

* the repo lock, ``.dvc/tmp/lock``, which DVC holds while it reads the
  pipeline, hashes deps and outs and records results (minutes for a large
  model), and lets go while a stage's command runs. A second command gives up
  on it after about 3 s; with ``dvc --wait-for-lock`` it waits, without a limit;
* the path locks, ``.dvc/tmp/rwlock``, which a stage holds on its deps and
  outs for as long as its command runs (hours, for training). A second command
  that needs one of those paths fails at once ("... is busy"), with or
  without ``--wait-for-lock``.

So the command runs with ``--wait-for-lock`` and is watched. The first wait is
bounded: once DVC has the repo lock (DVC's default lock, ``zc.lockfile``, writes
the holder's pid into the lock file) or has started the stage, it runs as long
as it needs, and waits as long as it needs to record the results of a stage
that ran; until then, past the deadline it is stopped, before it started
anything. A run that failed on a busy path before starting the stage is
retried until the deadline. Either way, giving up raises ``DvcLockTimeout``
saying who holds the lock. Output is copied to this process's as it comes, and
read back only for DVC's own lines.

With ``core.hardlink_lock`` (NFS) the lock file holds no pid: the first wait
cannot tell whether DVC has the lock then, so it stops bounding it (and says
so) rather than risk stopping a stage that is running.
"""

from __future__ import annotations

import fcntl
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

log = logging.getLogger(__name__)

POLL_S = 0.2
RETRY_S = 2.0
# DVC's own lines: a stage started, and the two ways it fails on another command's lock.
STARTED = b"Running stage '"
LOCK_FAILURES = (b"Unable to acquire lock", b"is busy, it is being blocked by")
_TAIL_BYTES = 1 << 16


class DvcLockTimeout(RuntimeError):
    """Another DVC command held a lock this one needs for longer than we wait."""


def lock_file(repo: Path) -> Path:
    return repo / ".dvc" / "tmp" / "lock"


def _lock_text(repo: Path) -> str:
    try:
        return lock_file(repo).read_text(encoding="utf-8", errors="replace").strip()
    except FileNotFoundError:
        return ""


def lock_is_held(repo: Path) -> bool:
    """Whether a process holds DVC's repo lock now: an flock probe that never creates the file."""
    try:
        fd = os.open(lock_file(repo), os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def lock_holder(repo: Path) -> int | None:
    """The pid DVC's lock file names (its holder, or its last one), or None if it names none."""
    text = _lock_text(repo)
    return int(text) if text.isdecimal() else None


class _Copy(threading.Thread):
    """Copy a child's output to one of our file descriptors as it comes, keeping its tail."""

    def __init__(self, source: IO[bytes], fd: int) -> None:
        super().__init__(daemon=True)
        self.source, self.fd = source, fd
        self.tail = b""
        self.started = False
        self.forward = True

    def run(self) -> None:
        while chunk := os.read(self.source.fileno(), 65536):
            view = memoryview(chunk)
            while view and self.forward:
                try:
                    view = view[os.write(self.fd, view) :]
                except OSError:
                    # Our output is gone (a closed terminal): keep draining, or DVC would block.
                    self.forward = False
            self.tail = (self.tail + chunk)[-_TAIL_BYTES:]
            self.started = self.started or STARTED in self.tail
        self.source.close()


class _Attempt:
    """One run of the DVC command, its output copied through."""

    def __init__(self, command: list[str], repo: Path, env: Mapping[str, str] | None) -> None:
        self.process = subprocess.Popen(
            command, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        assert self.process.stdout is not None and self.process.stderr is not None
        self.copies = [_Copy(self.process.stdout, 1), _Copy(self.process.stderr, 2)]
        for copy in self.copies:
            copy.start()

    @property
    def started(self) -> bool:
        return any(copy.started for copy in self.copies)

    def wait(self, timeout: float | None = None) -> int:
        code = self.process.wait(timeout)
        for copy in self.copies:
            copy.join()
        return code

    def lock_failure(self) -> str | None:
        """DVC's error when this attempt failed on another command's lock, else None."""
        err = self.copies[1].tail
        if self.started or not any(failure in err for failure in LOCK_FAILURES):
            return None
        return err.decode("utf-8", errors="replace").strip()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.wait()


def _give_up(args: Sequence[str], repo: Path, wait_s: float, why: str) -> DvcLockTimeout:
    return DvcLockTimeout(
        f"`dvc {' '.join(args)}` waited {wait_s:g} s for another dvc command in {repo} "
        f"(a `dvc repro` by hand?) to let go of {why}. Nothing was run. Let that command "
        "finish and run again, or raise schedule.dvc_lock_wait_s."
    )


def _until_locked(attempt: _Attempt, repo: Path, deadline: float) -> bool:
    """Wait until the attempt has the repo lock, started its stage or ended: False on timeout."""
    no_pid = 0  # polls in a row that found a lock file naming no pid
    while no_pid < 3:  # not 1: a read can land between zc.lockfile's write and truncate
        try:
            attempt.process.wait(timeout=POLL_S)
            return True
        except subprocess.TimeoutExpired:
            pass
        text = _lock_text(repo)
        if attempt.started or text == str(attempt.process.pid):
            return True
        no_pid = no_pid + 1 if text and not text.isdecimal() else 0
        # Past the deadline only while another process has the lock: not while DVC starts up.
        if time.monotonic() > deadline and lock_is_held(repo):
            return False
    log.warning("%s names no pid (core.hardlink_lock?): waiting for DVC without a limit", repo)
    return True


def run_dvc(
    args: Sequence[str], repo: Path, env: Mapping[str, str] | None = None, wait_s: float = 0
) -> subprocess.CompletedProcess[bytes]:
    """Run ``dvc <args>`` in ``repo`` as ``subprocess.run`` would, waiting up to ``wait_s``
    for other DVC commands' locks; DvcLockTimeout when they hold on longer."""
    command = [sys.executable, "-m", "dvc", "--wait-for-lock", *args]
    deadline = time.monotonic() + wait_s
    while True:
        attempt = _Attempt(command, repo, env)
        try:
            if not _until_locked(attempt, repo, deadline):
                holder = lock_holder(repo)
                attempt.stop()
                raise _give_up(
                    args, repo, wait_s, f"the repo lock ({lock_file(repo)}, pid {holder})"
                )
            code = attempt.wait()
        except BaseException:
            # Interrupted or cancelled: do not leave DVC running on its own (subprocess.run's rule).
            attempt.stop()
            raise
        failure = attempt.lock_failure() if code != 0 else None
        if failure is None:
            return subprocess.CompletedProcess(command, code)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _give_up(args, repo, wait_s, f"a path this stage needs:\n{failure}")
        log.info("dvc %s: a path is busy in another dvc command; trying again", " ".join(args))
        time.sleep(min(RETRY_S, remaining))
