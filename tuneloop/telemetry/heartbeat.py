"""The training side of the watchdog: a step heartbeat and checkpoint/eval sections.

Each rank writes a small JSON file, atomically (write, then rename), after each
step and whenever it enters or leaves a section::

    {"rank": 0, "pid": 4242, "step": 1200, "time": 1718000000.5,
     "section": "checkpoint", "stack_signal": null, "run_id": "3f2a..."}

Rank 0 (or a single process) writes the path it is given; rank ``r`` writes
``<stem>.rank<r><suffix>`` beside it, so ranks never race on one file. The path
comes from the argument or from ``TUNELOOP_HEARTBEAT``, which ``tuneloop watch``
sets for the command it runs; with neither, the heartbeat does nothing, so the
callback is harmless outside the watchdog.

Sections tell the watchdog that a pause without steps is expected: "checkpoint",
"eval", "epoch-start", "after-train". Hugging Face's Trainer has no hook before a
save, so ``HeartbeatCallback`` (``callback.py``) opens the section at the end of
the step that will save; code outside the Trainer wraps its own save::

    from tuneloop.telemetry.heartbeat import beat, section

    for step, batch in enumerate(loader):
        ...
        beat(step)
    with section("checkpoint"):
        save(model)

Writes are throttled to one per ``min_interval_s`` unless the section changes:
a heartbeat is for stalls of tens of seconds, not for every 30 ms step.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from tuneloop.io import write_text
from tuneloop.telemetry.trace import HeartbeatView

log = logging.getLogger(__name__)

HEARTBEAT_ENV = "TUNELOOP_HEARTBEAT"


@dataclass(frozen=True, slots=True)
class HeartbeatRecord:
    rank: int
    pid: int
    step: int | None
    time: float
    section: str | None
    # The signal this process registered with faulthandler to print its stacks, if any;
    # the watchdog sends it when py-spy is not installed.
    stack_signal: int | None = None
    # The MLflow run the job logs into, so a watcher started without one can mark it failed.
    run_id: str | None = None


def rank_path(path: Path, rank: int) -> Path:
    """Where rank ``rank`` writes its heartbeat, given the job's heartbeat path."""
    if rank == 0:
        return path
    return path.with_name(f"{path.stem}.rank{rank}{path.suffix}")


def _env_rank() -> int:
    # torchrun, accelerate and deepspeed all export RANK.
    return int(os.environ.get("RANK", "0"))


class Heartbeat:
    """Writes this rank's heartbeat file; a no-op without a path."""

    def __init__(
        self,
        path: Path | str | None = None,
        rank: int | None = None,
        min_interval_s: float = 0.5,
    ) -> None:
        if path is None:
            path = os.environ.get(HEARTBEAT_ENV) or None
        self.rank = _env_rank() if rank is None else rank
        self.path = rank_path(Path(path), self.rank) if path is not None else None
        self.min_interval_s = min_interval_s
        self.step: int | None = None
        self.section_name: str | None = None
        self.stack_signal: int | None = None
        self.run_id: str | None = None
        self._last_write = 0.0

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def _write(self, force: bool) -> None:
        if self.path is None:
            return
        now = time.time()
        if not force and now - self._last_write < self.min_interval_s:
            return
        record = HeartbeatRecord(
            self.rank,
            os.getpid(),
            self.step,
            now,
            self.section_name,
            self.stack_signal,
            self.run_id,
        )
        # Not durable: worthless after a crash, and an fsync could hold a training
        # step behind a checkpoint's writeback.
        write_text(self.path, json.dumps(asdict(record)) + "\n", durable=False)
        self._last_write = now

    def beat(self, step: int) -> None:
        """Record a finished training step."""
        self.step = step
        self._write(force=False)

    def set_run_id(self, run_id: str) -> None:
        """Name the MLflow run this job logs into (for the watcher's verdict)."""
        if run_id != self.run_id:
            self.run_id = run_id
            self._write(force=True)

    def enter_section(self, name: str) -> None:
        if name != self.section_name:
            self.section_name = name
            self._write(force=True)

    def exit_section(self) -> None:
        if self.section_name is not None:
            self.section_name = None
            self._write(force=True)

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        """Mark a pause without steps that is expected (a checkpoint save, an evaluation)."""
        self.enter_section(name)
        try:
            yield
        finally:
            self.exit_section()

    def register_faulthandler(self, signum: int = signal.SIGUSR1) -> None:
        """Print every thread's Python stack to stderr on ``signum``, and tell the watchdog.

        Only for jobs without py-spy: the watchdog sends ``signum`` only to processes
        whose heartbeat says they registered it, since SIGUSR1's default action kills.
        """
        faulthandler.register(signum, file=sys.stderr, all_threads=True)
        self.stack_signal = int(signum)
        self._write(force=True)


_default: Heartbeat | None = None


def default_heartbeat() -> Heartbeat:
    """This process's heartbeat, configured from the environment on first use."""
    global _default
    if _default is None:
        _default = Heartbeat()
    return _default


def beat(step: int) -> None:
    default_heartbeat().beat(step)


def section(name: str) -> contextlib.AbstractContextManager[None]:
    return default_heartbeat().section(name)


def read_heartbeats(path: Path) -> list[HeartbeatRecord]:
    """Every rank's latest record for the job whose heartbeat path is ``path``."""
    candidates = [path, *path.parent.glob(f"{path.stem}.rank*{path.suffix}")]
    records: list[HeartbeatRecord] = []
    for candidate in candidates:
        try:
            text = candidate.read_text(encoding="utf-8")
        except FileNotFoundError:
            continue
        # Writes are atomic renames, so a file is whole or absent; a parse error means
        # someone else wrote there, and that is worth saying.
        try:
            records.append(HeartbeatRecord(**json.loads(text)))
        except (json.JSONDecodeError, TypeError) as err:
            log.warning("ignoring %s: not a heartbeat record (%s)", candidate, err)
    return sorted(records, key=lambda r: r.rank)


def merge(records: Sequence[HeartbeatRecord]) -> HeartbeatView | None:
    """One view of all ranks: the highest step; a section only when every rank is in one.

    The field report's epoch-end hang had one rank (fewer batches) go on to its
    epoch-end save while the others waited in a collective: requiring every rank
    keeps that rank's "checkpoint" from shielding the hang.
    """
    if not records:
        return None
    steps = [r.step for r in records if r.step is not None]
    sections = {r.section for r in records}
    section_name = None if None in sections else "+".join(sorted(s for s in sections if s))
    return HeartbeatView(max(steps) if steps else None, section_name)


def job_run_id(records: Sequence[HeartbeatRecord]) -> str | None:
    """The MLflow run a rank named (rank 0 first), if any did."""
    return next((r.run_id for r in records if r.run_id), None)


def clear_heartbeats(path: Path) -> None:
    """Remove a previous job's heartbeat files, so they are not read as this job's."""
    for candidate in [path, *path.parent.glob(f"{path.stem}.rank*{path.suffix}")]:
        candidate.unlink(missing_ok=True)
