"""The watched job's processes: every one it ever showed, and ending them all.

A job is more than its command's process group. torchrun starts its workers in sessions of
their own, and a rank or a helper may call ``setsid()`` and, once its parent exits, belong to
no tree the watcher could walk from the command. So the watcher remembers every process it
has seen belong to the job (``JobProcesses.refresh``, every tick), from these signs:

- the command's process and its descendants;
- the command's process group (its id is the command's pid) while it is certainly this job's:
  the command not yet reaped, or a remembered process still in it;
- the pid in each rank's heartbeat file, when that process started after the command and
  before it wrote the record (a later start means the pid now belongs to someone else);
- every descendant of a process seen before, whatever session it moved to.

Ending the job (``end``) adds one more sign: any process whose environment carries the job's
token (``JOB_TOKENS_ENV``, set by the watcher and inherited by whatever the job starts), which
finds a helper that double-forked between two ticks. Then SIGTERM to all of them (torchrun
forwards it and ranks can flush logs), SIGKILL to what is left after the grace period. The
watcher calls it when the watchdog ends a hung job and again when the command has exited, so
nothing of the job outlives either.

A cgroup would make membership exact, but making one needs a delegated cgroup v2 subtree
(``systemd-run --scope`` or a writable ``/sys/fs/cgroup``), which containers and shared
training hosts rarely give; the signs above need nothing. A process that both scrubs its
environment and double-forks between two ticks without ever writing a heartbeat escapes them.

psutil identifies a process by pid and start time, so a remembered process whose pid was
reused is never signalled.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import psutil

from tuneloop.telemetry.heartbeat import HeartbeatRecord

log = logging.getLogger(__name__)

JOB_TOKENS_ENV = "TUNELOOP_WATCH_JOBS"
"""Space-separated tokens of every watcher around a process (watchers can nest)."""
KILL_WAIT_S = 5.0
POLL_S = 0.05
# psutil derives start times from the boot time, which /proc/stat gives in whole seconds;
# a heartbeat's time comes from the wall clock.
CLOCK_SLACK_S = 2.0


def job_tokens(token: str, env: Mapping[str, str]) -> str:
    """The value of ``JOB_TOKENS_ENV`` for a job: any outer watcher's tokens, then its own."""
    return " ".join([*env.get(JOB_TOKENS_ENV, "").split(), token])


@dataclass(frozen=True)
class Ended:
    terminated: list[int]
    """Pids sent SIGTERM."""
    killed: list[int]
    """Pids still running after the grace period, sent SIGKILL."""


class JobProcesses:
    """Every process seen to belong to the job started as ``root_pid``, with ``token``."""

    def __init__(self, root_pid: int, token: str) -> None:
        # The command is the watcher's child, unreaped until the watcher waits for it:
        # it is there to be looked at even when it has already exited.
        self.root = psutil.Process(root_pid)
        self.token = token
        self._root_started = self.root.create_time()
        self._seen: dict[int, psutil.Process] = {root_pid: self.root}

    def alive(self) -> list[psutil.Process]:
        """The remembered processes still running (zombies have finished), the watcher aside."""
        found = []
        for proc in self._seen.values():
            if proc.pid == os.getpid() or not proc.is_running():
                continue
            try:
                if proc.status() != psutil.STATUS_ZOMBIE:
                    found.append(proc)
            except psutil.NoSuchProcess:
                continue
        return found

    def refresh(self, heartbeats: Sequence[HeartbeatRecord] = ()) -> None:
        """Remember every process that belongs to the job now."""
        alive = self.alive()
        group_is_ours = self.root.is_running() or any(_pgid(p.pid) == self.root.pid for p in alive)
        children: dict[int, list[psutil.Process]] = defaultdict(list)
        todo = [*alive, *self._from_heartbeats(heartbeats)]
        for proc in psutil.process_iter(["ppid"]):
            ppid = proc.info["ppid"]
            if ppid is not None:
                children[ppid].append(proc)
            if group_is_ours and _pgid(proc.pid) == self.root.pid:
                todo.append(proc)
        visited: set[int] = set()
        while todo:
            proc = todo.pop()
            if proc.pid in visited or proc.pid == os.getpid():
                continue
            visited.add(proc.pid)
            self._remember(proc)
            todo.extend(children.get(proc.pid, ()))

    def end(self, grace_s: float, heartbeats: Sequence[HeartbeatRecord] = ()) -> Ended:
        """SIGTERM every process of the job, SIGKILL what is left after ``grace_s``."""
        self.refresh(heartbeats)
        self._sweep_environments()
        terminated = self.alive()
        _signal_all(terminated, signal.SIGTERM)
        self._wait(grace_s)
        # Processes started during the grace period (torchrun restarting a worker) too.
        self.refresh()
        self._sweep_environments()
        left = self.alive()
        _signal_all(left, signal.SIGKILL)
        self._wait(KILL_WAIT_S)
        if still := self.alive():
            log.error("job processes survived SIGKILL: %s", [p.pid for p in still])
        return Ended([p.pid for p in terminated], [p.pid for p in left])

    def _remember(self, proc: psutil.Process) -> None:
        known = self._seen.get(proc.pid)
        if known is None or known != proc:  # new, or the pid of one that has gone
            self._seen[proc.pid] = proc

    def _from_heartbeats(self, records: Iterable[HeartbeatRecord]) -> list[psutil.Process]:
        found = []
        for record in records:
            # The file is the job's to write; take nothing in it on trust.
            pid, written = record.pid, record.time
            if not isinstance(pid, int) or pid <= 0 or not isinstance(written, int | float):
                continue
            try:
                proc = psutil.Process(pid)
                started = proc.create_time()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            if self._root_started <= started <= written + CLOCK_SLACK_S:
                found.append(proc)
        return found

    def _sweep_environments(self) -> None:
        for proc in psutil.process_iter():
            if proc.pid == os.getpid():
                continue
            try:
                tokens = proc.environ().get(JOB_TOKENS_ENV, "")
            except (psutil.Error, OSError):  # gone, a zombie, or another user's process
                continue
            if self.token in tokens.split():
                self._remember(proc)

    def _wait(self, timeout_s: float) -> None:
        # psutil.wait_procs waits on a zombie that is not our child until the timeout (the pid
        # still exists), and an orphan's reaper may be slow or absent in a container.
        deadline = time.monotonic() + timeout_s
        while self.alive() and time.monotonic() < deadline:
            time.sleep(POLL_S)


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def _signal_all(processes: Iterable[psutil.Process], signum: int) -> None:
    for proc in processes:
        try:
            proc.send_signal(signum)
        except psutil.NoSuchProcess:
            continue
