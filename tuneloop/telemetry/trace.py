"""Telemetry samples, the CSV trace format, and the ``TraceSource`` protocol.

A trace is what the watchdog saw, tick by tick: one row per GPU per tick with
its NVML readings and the job's heartbeat (step, open section) at that moment.
Synthetic traces add ground truth (``label``: the state the GPU was really in;
``deadlock``: inside a planted deadlock). The file is plain CSV after a few
``#`` header lines that describe the devices::

    # tuneloop-trace 1
    # device {"index": 0, "name": "NVIDIA H100 80GB HBM3", "power_cap_w": 700.0, ...}
    t,gpu,power_w,energy_j,gpu_util,...

Everything downstream of sampling reads samples through ``TraceSource``:
``NvmlSource`` (``sampler.py``) reads a live GPU, ``ReplaySource`` here replays
a recorded or generated trace, so the classifier and the deadlock detector run
the same code on a laptop as on a GPU node.
"""

from __future__ import annotations

import csv
import io
import json
import logging
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Literal, Protocol, TextIO, cast, get_args

from tuneloop.io import write_text

log = logging.getLogger(__name__)

State = Literal["compute", "communication", "data-starvation", "checkpoint-or-deadlock", "idle"]
STATES: tuple[State, ...] = get_args(State)
PowerField = Literal["instant", "average", "none"]

TRACE_MAGIC = "# tuneloop-trace 1"
COLUMNS = (
    "t",
    "gpu",
    "power_w",
    "energy_j",
    "gpu_util",
    "mem_util",
    "mem_used_mib",
    "sm_clock_mhz",
    "mem_clock_mhz",
    "step",
    "section",
    "label",
    "deadlock",
)


class TraceError(ValueError):
    """A trace file is malformed; the message names the file, the line and what is wrong."""


@dataclass(frozen=True, slots=True)
class DeviceInfo:
    """One GPU as the sampler found it."""

    index: int
    name: str
    power_cap_w: float | None
    memory_total_mib: float | None
    # Which NVML reading ``power_w`` holds: "average" (nvmlDeviceGetPowerUsage) lags
    # about a second behind the board, which is why windows are at least 5 s long.
    power_field: PowerField = "average"


@dataclass(frozen=True, slots=True)
class Sample:
    """One GPU's readings at one tick. ``None`` where NVML could not say."""

    t: float
    gpu: int
    power_w: float | None
    energy_j: float | None
    gpu_util: float | None  # NVML "gpu" rate: % of time a kernel was running (not SM occupancy)
    mem_util: float | None  # % of time device memory was read or written
    mem_used_mib: float | None
    sm_clock_mhz: float | None = None
    mem_clock_mhz: float | None = None
    label: State | None = None  # ground truth; synthetic traces only


@dataclass(frozen=True, slots=True)
class HeartbeatView:
    """The job's heartbeat as one observer sees it: highest step, and the open section.

    ``section`` is set only while every reporting rank is inside a section, so a
    rank that wandered into its checkpoint while another waits in a collective
    does not shield the hang (see ``heartbeat.merge``).
    """

    step: int | None
    section: str | None


@dataclass(frozen=True, slots=True)
class Tick:
    t: float
    samples: tuple[Sample, ...]
    heartbeat: HeartbeatView | None
    deadlock: bool = False  # ground truth: inside a planted deadlock


@dataclass(frozen=True)
class Trace:
    devices: tuple[DeviceInfo, ...]
    ticks: tuple[Tick, ...]

    @property
    def duration_s(self) -> float:
        return self.ticks[-1].t - self.ticks[0].t if self.ticks else 0.0

    def deadlock_onsets(self) -> list[float]:
        """Start times of planted deadlocks (ground truth)."""
        onsets: list[float] = []
        before = False
        for tick in self.ticks:
            if tick.deadlock and not before:
                onsets.append(tick.t)
            before = tick.deadlock
        return onsets


class TraceSource(Protocol):
    """Where samples come from: a live GPU (``NvmlSource``) or a trace (``ReplaySource``)."""

    def devices(self) -> Sequence[DeviceInfo]: ...

    def read(self, now: float) -> list[Sample]:
        """One sample per device, stamped ``now``; empty when there is nothing to read."""
        ...

    def close(self) -> None: ...


def _fmt(value: float | None, digits: int) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def _row(tick: Tick, sample: Sample) -> list[str]:
    hb = tick.heartbeat
    return [
        f"{tick.t:.3f}",
        str(sample.gpu),
        _fmt(sample.power_w, 1),
        _fmt(sample.energy_j, 1),
        _fmt(sample.gpu_util, 1),
        _fmt(sample.mem_util, 1),
        _fmt(sample.mem_used_mib, 0),
        _fmt(sample.sm_clock_mhz, 0),
        _fmt(sample.mem_clock_mhz, 0),
        "" if hb is None or hb.step is None else str(hb.step),
        "" if hb is None or hb.section is None else hb.section,
        sample.label or "",
        "1" if tick.deadlock else "",
    ]


def _header(devices: Iterable[DeviceInfo]) -> str:
    lines = [TRACE_MAGIC]
    lines += [f"# device {json.dumps(asdict(d), sort_keys=True)}" for d in devices]
    return "\n".join(lines) + "\n"


class TraceWriter:
    """Appends ticks to a CSV trace as they happen.

    Flushed every tick: a live trace is a log, and the point of it is to survive
    the job (and the watcher) dying at an awkward moment.
    """

    def __init__(self, path: Path, devices: Sequence[DeviceInfo]) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file: TextIO = path.open("w", encoding="utf-8", newline="")
        self._file.write(_header(devices))
        self._csv = csv.writer(self._file, lineterminator="\n")
        self._csv.writerow(COLUMNS)
        self._file.flush()

    def write(self, tick: Tick) -> None:
        if not tick.samples and tick.heartbeat is None:
            return
        if tick.samples:
            self._csv.writerows(_row(tick, s) for s in tick.samples)
        else:
            # Heartbeat-only: a row with gpu -1 keeps the step/section timeline.
            empty = Sample(tick.t, -1, None, None, None, None, None)
            self._csv.writerow(_row(tick, empty))
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def format_trace(trace: Trace) -> str:
    out = io.StringIO()
    out.write(_header(trace.devices))
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(COLUMNS)
    for tick in trace.ticks:
        writer.writerows(_row(tick, s) for s in tick.samples)
    return out.getvalue()


def write_trace(path: Path, trace: Trace) -> None:
    """Write a whole trace at once (atomically)."""
    write_text(path, format_trace(trace))


def _num(text: str) -> float | None:
    return float(text) if text else None


def read_trace(path: Path) -> Trace:
    """Read a trace written by ``TraceWriter`` or ``write_trace``.

    A truncated last line (the writer died mid-row) is dropped with a warning;
    anything else malformed raises ``TraceError`` naming the line.
    """
    lines = path.read_text(encoding="utf-8").splitlines()
    if not lines or lines[0].strip() != TRACE_MAGIC:
        raise TraceError(f"{path}: not a tuneloop trace (first line must be {TRACE_MAGIC!r})")
    devices: list[DeviceInfo] = []
    body_start = 1
    for number, line in enumerate(lines[1:], start=2):
        if not line.startswith("#"):
            body_start = number - 1
            break
        if line.startswith("# device "):
            try:
                devices.append(DeviceInfo(**json.loads(line[len("# device ") :])))
            except (json.JSONDecodeError, TypeError) as err:
                raise TraceError(f"{path}:{number}: bad device line: {err}") from err
    else:
        body_start = len(lines)
    rows = list(csv.reader(lines[body_start:]))
    if not rows or tuple(rows[0]) != COLUMNS:
        raise TraceError(f"{path}:{body_start + 1}: expected the column header {','.join(COLUMNS)}")
    ticks: list[Tick] = []
    current_t: str | None = None
    samples: list[Sample] = []
    heartbeat: HeartbeatView | None = None
    deadlock = False

    def flush() -> None:
        if current_t is not None:
            ticks.append(Tick(float(current_t), tuple(samples), heartbeat, deadlock))

    for offset, row in enumerate(rows[1:], start=body_start + 2):
        if len(row) != len(COLUMNS):
            if offset == body_start + len(rows):
                log.warning("%s:%d: dropping a truncated last row", path, offset)
                break
            raise TraceError(f"{path}:{offset}: {len(row)} fields, expected {len(COLUMNS)}")
        t, gpu, power, energy, util, mutil, mused, sclk, mclk, step, section, label, dead = row
        if label and label not in STATES:
            raise TraceError(f"{path}:{offset}: unknown label {label!r}; one of {STATES}")
        try:
            if t != current_t:
                flush()
                current_t, samples = t, []
                heartbeat = HeartbeatView(int(step) if step else None, section or None)
                deadlock = dead == "1"
            if int(gpu) >= 0:
                samples.append(
                    Sample(
                        t=float(t),
                        gpu=int(gpu),
                        power_w=_num(power),
                        energy_j=_num(energy),
                        gpu_util=_num(util),
                        mem_util=_num(mutil),
                        mem_used_mib=_num(mused),
                        sm_clock_mhz=_num(sclk),
                        mem_clock_mhz=_num(mclk),
                        label=cast(State | None, label or None),  # checked above
                    )
                )
        except ValueError as err:
            raise TraceError(f"{path}:{offset}: {err}") from err
    flush()
    return Trace(tuple(devices), tuple(ticks))


class ReplaySource:
    """Replays a trace through the ``TraceSource`` interface.

    The first ``read(now)`` anchors the trace's first tick at ``now``; later reads
    return the latest recorded tick at or before the matching trace time,
    re-stamped ``now``. Fed the trace's own tick times it replays every tick
    exactly (offline analysis); fed wall-clock times it paces the trace in real
    time (``tuneloop watch --replay``). Past the end it returns nothing.
    """

    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        self._offset: float | None = None
        self._next = 0
        self._current: Tick | None = None

    def devices(self) -> Sequence[DeviceInfo]:
        return self.trace.devices

    @property
    def exhausted(self) -> bool:
        return self._next >= len(self.trace.ticks) and self._current is None

    def _advance(self, now: float) -> Tick | None:
        ticks = self.trace.ticks
        if not ticks:
            return None
        if self._offset is None:
            self._offset = now - ticks[0].t
        trace_t = now - self._offset
        # The recording covers its last tick for one more tick period, then it is over.
        period = ticks[1].t - ticks[0].t if len(ticks) > 1 else 0.0
        if trace_t > ticks[-1].t + period:
            self._next, self._current = len(ticks), None
            return None
        while self._next < len(ticks) and ticks[self._next].t <= trace_t + 1e-9:
            self._current = ticks[self._next]
            self._next += 1
        return self._current

    def read(self, now: float) -> list[Sample]:
        tick = self._advance(now)
        if tick is None:
            return []
        return [replace(s, t=now) for s in tick.samples]

    def read_tick(self, now: float) -> Tick | None:
        """Like ``read``, with the recorded heartbeat and ground truth of that tick."""
        tick = self._advance(now)
        if tick is None:
            return None
        return Tick(
            now, tuple(replace(s, t=now) for s in tick.samples), tick.heartbeat, tick.deadlock
        )

    def close(self) -> None:
        self._current = None
