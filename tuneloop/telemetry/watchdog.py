"""The deadlock detector and the watchdog that feeds it windows and heartbeats.

A deadlock is declared when, outside any checkpoint/eval section, no training
step has arrived for ``deadlock_after_s`` and, with power data, at least half
the GPUs have sat at checkpoint-or-deadlock (or idle) power for that long.
Without power data the step silence alone decides. Three guards keep
checkpoints and slow jobs safe:

- a section ("checkpoint", "eval", ...) open on every rank shields the job,
  up to ``section_max_factor`` x ``deadlock_after_s`` (a save that never ends is
  still a hang);
- the threshold stretches to ``slow_step_factor`` x the job's median step
  interval, so a job at 40 s a step is not killed for a 25 s pause; on the
  heartbeat alone, until two steps have shown the step time, it is the
  section maximum;
- the detector arms at the first step (or, without a heartbeat, the first busy
  window): model loading and compilation never trigger it.

Power vouches for a silent job only up to the section maximum: no step for that
long outside a section is a hang even if the GPUs still draw power.

Without a heartbeat the detector runs on power alone and cannot tell a long
checkpoint from a hang: install ``HeartbeatCallback`` or raise
``deadlock_after_s`` above the longest save.

Everything here is pure: times come in with the samples, so a replayed trace
and a live GPU go through the same code (``replay`` below; ``watch.py`` live).
"""

from __future__ import annotations

import itertools
import logging
import math
import statistics
from collections import defaultdict, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from tuneloop.telemetry.accounting import Accounting
from tuneloop.telemetry.calibration import Calibration, calibration_for
from tuneloop.telemetry.classify import (
    BUSY,
    GpuClassifier,
    WindowFeatures,
    job_stalled,
    job_state,
    window_features,
)
from tuneloop.telemetry.trace import (
    STATES,
    DeviceInfo,
    HeartbeatView,
    ReplaySource,
    Sample,
    State,
    Trace,
)

log = logging.getLogger(__name__)

# Windows kept for the timeline: about three days at 5 s windows. GPU-hours are
# accumulated separately and cover the whole run.
WINDOW_HISTORY = 50_000

STARVATION_HINT = (
    "sustained data-starvation: the GPUs idle between short bursts, waiting for batches. "
    "Likely causes: too few DataLoader workers, or tokenisation/collation too heavy for them; "
    "storage contention (a shared or NFS volume competing with other CPU and I/O load on the "
    "node); a corpus not in the page cache yet (first epoch reading from disk). Pre-tokenised "
    "data on local disk, persistent workers and pinned memory usually cure it."
)


@dataclass(frozen=True)
class WatchConfig:
    """Knobs of the watchdog; each default is chosen here and nowhere else."""

    deadlock_after_s: float = 20.0  # silence (and low power) that makes a deadlock
    window_s: float = 5.0  # classification window; NVML power is itself an average
    hz: float = 2.0  # samples per second, 1..10
    section_max_factor: float = 20.0  # a section longer than this x deadlock_after_s is a hang
    slow_step_factor: float = 3.0  # threshold >= this x the median step interval
    starvation_warn_s: float = 120.0  # sustained data-starvation before a warning
    kill_grace_s: float = 10.0  # SIGTERM, then SIGKILL after this long
    timeline_tail_s: float = 600.0  # the timeline excerpt sent to MLflow on a deadlock

    def __post_init__(self) -> None:
        checks = {
            "deadlock_after_s": self.deadlock_after_s > 0,
            "window_s": self.window_s >= 5.0,
            "hz": 1.0 <= self.hz <= 10.0,
            "section_max_factor": self.section_max_factor >= 1.0,
            "slow_step_factor": self.slow_step_factor >= 0.0,
            "starvation_warn_s": self.starvation_warn_s > 0,
            "kill_grace_s": self.kill_grace_s >= 0,
            "timeline_tail_s": self.timeline_tail_s > 0,
        }
        wants = {
            "window_s": "at least 5 s (NVML power is a moving average)",
            "hz": "between 1 and 10",
            "section_max_factor": "at least 1",
        }
        for name, ok in checks.items():
            if not ok:
                want = wants.get(name, "positive")
                raise ValueError(f"watchdog {name}={getattr(self, name)!r}: must be {want}")

    @property
    def section_max_s(self) -> float:
        return self.section_max_factor * self.deadlock_after_s


@dataclass(frozen=True)
class Alarm:
    t: float
    # "peer": another node's watchdog found the hang (tuneloop.telemetry.peers)
    kind: Literal["deadlock", "section-overrun", "peer"]
    reason: str
    last_step: int | None
    quiet_s: float  # since the last sign of life (step, section change, busy window)
    stalled_s: float | None  # how long power has been low; None without power data
    section: str | None


class DeadlockDetector:
    """Decides, from heartbeats and per-window stall verdicts, when the job is hung."""

    def __init__(self, config: WatchConfig) -> None:
        self.config = config
        self.armed = False
        self.heartbeat_seen = False
        self.last_life: float | None = None
        self.last_step: int | None = None
        self.section: str | None = None
        self.section_since: float | None = None
        self.stall_since: float | None = None
        self.power_known = False
        self.last_window_end: float | None = None
        self.fired = False
        self._last_view: HeartbeatView | None = None
        self._step_times: deque[float] = deque(maxlen=17)

    def _life(self, t: float) -> None:
        self.last_life = t
        self.fired = False

    def on_heartbeat(self, t: float, view: HeartbeatView | None) -> None:
        if view is None:
            return
        self.heartbeat_seen = True
        previous, self._last_view = self._last_view, view
        if view == previous:
            return
        self._life(t)
        if view.step is not None and (previous is None or view.step != previous.step):
            self.armed = True
            self.last_step = view.step
            self._step_times.append(t)
        if previous is None or view.section != previous.section:
            self.section = view.section
            self.section_since = t if view.section is not None else None

    def on_window(self, t0: float, t1: float, stalled: bool | None, busy: bool) -> None:
        if stalled is None:
            self.power_known = False
            return
        self.power_known = True
        self.last_window_end = t1
        if stalled:
            if self.stall_since is None:
                self.stall_since = t0
            return
        self.stall_since = None
        if busy and not self.heartbeat_seen:
            # No heartbeat: a busy window is the only sign of life there is.
            self.armed = True
            self._life(t1)

    def threshold_s(self) -> float:
        """``deadlock_after_s``, stretched for jobs whose steps are slow."""
        times = list(self._step_times)
        if len(times) < 2:
            # Step time unknown. With power, low power must confirm the silence; without,
            # a first step longer than deadlock_after_s would look like a hang, so wait as
            # long as for a section.
            return self.config.deadlock_after_s if self.power_known else self.config.section_max_s
        median_step = statistics.median(b - a for a, b in itertools.pairwise(times))
        return max(self.config.deadlock_after_s, self.config.slow_step_factor * median_step)

    def check(self, t: float) -> Alarm | None:
        if self.fired or not self.armed or self.last_life is None:
            return None
        threshold = self.threshold_s()
        quiet = t - self.last_life
        overrun = False
        if self.section is not None and self.section_since is not None:
            if t - self.section_since < self.config.section_max_s:
                return None
            overrun = True
        stalled_s: float | None = None
        if self.power_known:
            if self.stall_since is not None and self.last_window_end is not None:
                stalled_s = self.last_window_end - max(self.stall_since, self.last_life)
            low_power = stalled_s is not None and stalled_s >= threshold
            # Power vouches for a silent job only so long: a hang that leaves the GPUs
            # drawing power (a kernel spinning hot) is still a hang.
            backstop = max(self.config.section_max_s, threshold)
            if not (low_power or (self.heartbeat_seen and quiet >= backstop)):
                return None
            power = (
                f"GPUs at checkpoint-or-deadlock power for {stalled_s:.0f} s"
                if low_power and stalled_s is not None
                else f"GPUs not at low power, but silent past the {backstop:.0f} s backstop"
            )
        elif quiet < threshold:
            return None
        else:
            power = "no power data (heartbeat only)"
        self.fired = True
        step = "no step yet" if self.last_step is None else f"last step {self.last_step}"
        if overrun and self.section_since is not None:
            reason = (
                f"section {self.section!r} open for {t - self.section_since:.0f} s, over its "
                f"maximum of {self.config.section_max_s:.0f} s; {power}; {step}"
            )
        else:
            reason = (
                f"deadlock: no training step for {quiet:.0f} s outside any checkpoint/eval "
                f"section (threshold {threshold:.0f} s); {power}; {step}"
            )
        return Alarm(
            t=t,
            kind="section-overrun" if overrun else "deadlock",
            reason=reason,
            last_step=self.last_step,
            quiet_s=quiet,
            stalled_s=stalled_s,
            section=self.section,
        )


@dataclass(frozen=True, slots=True)
class JobWindow:
    """One window: every GPU's features and state, and the job's verdict."""

    t0: float
    t1: float
    gpus: tuple[WindowFeatures, ...]
    states: tuple[State | None, ...]
    state: State | None
    stalled: bool | None
    step: int | None
    section: str | None


class Watchdog:
    """Windows samples, classifies them, and asks the detector at every tick."""

    def __init__(
        self,
        devices: Sequence[DeviceInfo],
        config: WatchConfig,
        calibrations: Mapping[int, Calibration] | None = None,
    ) -> None:
        self.config = config
        chosen = dict(calibrations or {})
        for device in devices:
            chosen.setdefault(device.index, calibration_for(device.name))
        self.calibrations = chosen
        self.classifiers = {
            d.index: GpuClassifier(chosen[d.index], d.power_cap_w, d.memory_total_mib)
            for d in devices
        }
        self.detector = DeadlockDetector(config)
        self.accounting = Accounting()
        self.windows: deque[JobWindow] = deque(maxlen=WINDOW_HISTORY)
        # Each change of the job's step or section: the timeline of a job without GPU data.
        self.heartbeats: deque[tuple[float, HeartbeatView]] = deque(maxlen=WINDOW_HISTORY)
        self.alarms: list[Alarm] = []
        self.events: list[tuple[float, str]] = []
        self._window_start: float | None = None
        self._pending: dict[int, list[Sample]] = defaultdict(list)
        self._view: HeartbeatView | None = None
        self._starved_since: float | None = None
        self._starvation_warned = False

    def observe(
        self, t: float, samples: Sequence[Sample], heartbeat: HeartbeatView | None
    ) -> Alarm | None:
        """Feed one tick; returns an alarm the first time the job is judged hung."""
        # The heartbeat first: a step that arrived with this tick is life before the window
        # that ends here is judged.
        self.detector.on_heartbeat(t, heartbeat)
        if heartbeat is not None and heartbeat != self._view:
            self.heartbeats.append((t, heartbeat))
        self._view = heartbeat
        if self._window_start is None:
            self._window_start = t
        w = self.config.window_s
        if t >= self._window_start + w:
            self._close(self._window_start, self._window_start + w)
            # Skip whole empty windows at once (a paused replay, a stalled watcher).
            self._window_start += w * math.floor((t - self._window_start) / w)
        for sample in samples:
            self._pending[sample.gpu].append(sample)
        alarm = self.detector.check(t)
        if alarm is not None:
            self.alarms.append(alarm)
            log.error("watchdog: %s", alarm.reason)
        return alarm

    def finish(self, t: float) -> None:
        """Close the last, partial window (for accounting at the end of a run)."""
        if self._window_start is not None and t > self._window_start:
            self._close(self._window_start, t)
            self._window_start = t

    def _close(self, t0: float, t1: float) -> None:
        pending, self._pending = self._pending, defaultdict(list)
        if not any(pending.values()):
            return
        features: list[WindowFeatures] = []
        states: list[State | None] = []
        for gpu in sorted(pending):
            classifier = self.classifiers.get(gpu)
            if classifier is None:
                continue
            f = window_features(gpu, t0, t1, pending[gpu])
            state = classifier.classify(f)
            features.append(f)
            states.append(state)
            self.accounting.add(state, t1 - t0, f.energy_j, f.power_w)
        if not features:
            return
        state = job_state(states)
        stalled = job_stalled(states)
        self.detector.on_window(t0, t1, stalled, state in BUSY)
        self._track_starvation(t1, state)
        view = self._view
        self.windows.append(
            JobWindow(
                t0,
                t1,
                tuple(features),
                tuple(states),
                state,
                stalled,
                view.step if view else None,
                view.section if view else None,
            )
        )

    def _track_starvation(self, t1: float, state: State | None) -> None:
        if state != "data-starvation":
            self._starved_since = None
            self._starvation_warned = False
            return
        if self._starved_since is None:
            self._starved_since = t1 - self.config.window_s
        lasted = t1 - self._starved_since
        if not self._starvation_warned and lasted >= self.config.starvation_warn_s:
            self._starvation_warned = True
            message = f"{STARVATION_HINT} (for {lasted:.0f} s so far)"
            self.events.append((t1, message))
            log.warning(message)

    def timeline_text(self, last_s: float | None = None) -> str:
        """The last ``last_s`` seconds of windows, one line each, for a post-mortem."""
        windows = list(self.windows)
        if last_s is not None and windows:
            windows = [w for w in windows if w.t1 >= windows[-1].t1 - last_s]
        lines = (
            ["t0\tt1\tjob\tstep\tsection\t" + "\t".join(f"gpu{f.gpu}" for f in windows[0].gpus)]
            if windows
            else []
        )
        for w in windows:
            gpus = "\t".join(
                f"{s or '?'}({f.power_w:.0f}W,{f.gpu_util or 0:.0f}%)"
                if f.power_w is not None
                else f"{s or '?'}"
                for f, s in zip(w.gpus, w.states, strict=True)
            )
            lines.append(
                f"{w.t0:.1f}\t{w.t1:.1f}\t{w.state or '?'}\t{w.step if w.step is not None else '-'}"
                f"\t{w.section or '-'}\t{gpus}"
            )
        return "\n".join(lines) + "\n"


@dataclass
class ReplayResult:
    alarms: list[Alarm]
    windows: list[JobWindow]
    accounting: Accounting
    onsets: list[float]  # ground truth: planted deadlock starts
    events: list[tuple[float, str]] = field(default_factory=list)

    def accuracy(self) -> dict[State, tuple[int, int]]:
        """Per state: (correct, total) over GPU windows whose samples all share one label."""
        return accuracy_by_state(self.windows)


def accuracy_by_state(windows: Iterable[JobWindow]) -> dict[State, tuple[int, int]]:
    # Windows that straddle a state change have no single right answer; they are left out.
    tally = {s: [0, 0] for s in STATES}
    for window in windows:
        for features, state in zip(window.gpus, window.states, strict=True):
            if features.pure and features.label is not None:
                tally[features.label][1] += 1
                tally[features.label][0] += int(state == features.label)
    return {s: (c, n) for s, (c, n) in tally.items()}


def replay(
    trace: Trace,
    config: WatchConfig,
    calibrations: Mapping[int, Calibration] | None = None,
) -> ReplayResult:
    """Run the watchdog over a whole trace, tick by tick, as fast as it goes."""
    source = ReplaySource(trace)
    watchdog = Watchdog(source.devices(), config, calibrations)
    last = None
    for recorded in trace.ticks:
        tick = source.read_tick(recorded.t)
        if tick is None:
            break
        watchdog.observe(tick.t, tick.samples, tick.heartbeat)
        last = tick.t
    if last is not None:
        watchdog.finish(last)
    return ReplayResult(
        watchdog.alarms,
        list(watchdog.windows),
        watchdog.accounting,
        trace.deadlock_onsets(),
        watchdog.events,
    )
