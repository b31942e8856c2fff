"""The run's timeline as a PNG: the training step, and per GPU, power over time on a band per state.

Power is drawn from the raw samples when given (the minutes before an alarm),
else from each window's median (a whole run). The step panel comes from the
heartbeat (sections shaded): without a GPU it is the whole timeline, and it is
what a heartbeat-only watchdog decided on.

Drawn with matplotlib's Agg canvas directly (no pyplot), so it works headless and
leaves the process's matplotlib backend alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tuneloop.telemetry.trace import STATES, HeartbeatView, Sample, State
from tuneloop.telemetry.watchdog import Alarm, JobWindow

SECTION_COLOUR = "#6a1b9a"
COLOURS: dict[str, str] = {
    "compute": "#2e7d32",
    "communication": "#1565c0",
    "data-starvation": "#ef6c00",
    "checkpoint-or-deadlock": "#c62828",
    "idle": "#9e9e9e",
}


def _spans(windows: Sequence[JobWindow], gpu: int) -> list[tuple[float, float, State]]:
    """One GPU's consecutive windows in one state merged, so a day-long run draws quickly."""
    spans: list[tuple[float, float, State]] = []
    for window in windows:
        state = next(
            (s for f, s in zip(window.gpus, window.states, strict=True) if f.gpu == gpu), None
        )
        if state is None:
            continue
        if spans and spans[-1][2] == state and abs(spans[-1][1] - window.t0) < 1e-6:
            spans[-1] = (spans[-1][0], window.t1, state)
        else:
            spans.append((window.t0, window.t1, state))
    return spans


def _draw_steps(
    ax: Any, heartbeats: Sequence[tuple[float, HeartbeatView]], t_zero: float, t_end: float
) -> None:
    """The highest step over time, held flat between changes; sections shaded."""
    points = [(t - t_zero, view.step) for t, view in heartbeats if view.step is not None]
    if points:
        xs, ys = zip(*points, strict=True)
        ax.step([*xs, t_end - t_zero], [*ys, ys[-1]], where="post", color="black", lw=0.9)
    ends = [t for t, _ in heartbeats[1:]] + [t_end]
    for (t0, view), t1 in zip(heartbeats, ends, strict=True):
        if view.section is not None:
            ax.axvspan(t0 - t_zero, t1 - t_zero, color=SECTION_COLOUR, alpha=0.15, lw=0)
    ax.set_ylabel("step")


def plot_timeline(
    samples: Sequence[Sample],
    windows: Sequence[JobWindow],
    out: Path,
    title: str = "GPU timeline",
    alarms: Sequence[Alarm] = (),
    heartbeats: Sequence[tuple[float, HeartbeatView]] = (),
) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    gpus = sorted({s.gpu for s in samples} | {f.gpu for w in windows for f in w.gpus})
    if not gpus and not heartbeats:
        gpus = [0]
    times = [s.t for s in samples] + [w.t0 for w in windows] + [t for t, _ in heartbeats]
    t_zero = min(times or [0.0])
    t_end = max(times + [w.t1 for w in windows] + [a.t for a in alarms] or [0.0])
    panels = len(gpus) + (1 if heartbeats else 0)
    figure = Figure(figsize=(12, 1.9 * panels + 1.0), layout="constrained")
    FigureCanvasAgg(figure)
    axes = list(figure.subplots(panels, 1, sharex=True, squeeze=False)[:, 0])
    if heartbeats:
        _draw_steps(axes[0], heartbeats, t_zero, t_end)
    for ax in axes:
        for alarm in alarms:
            ax.axvline(alarm.t - t_zero, color=COLOURS["checkpoint-or-deadlock"], lw=1.5, ls="--")
        ax.grid(alpha=0.3)
    for ax, gpu in zip(axes[len(axes) - len(gpus) :], gpus, strict=True):
        for t0, t1, state in _spans(windows, gpu):
            ax.axvspan(t0 - t_zero, t1 - t_zero, color=COLOURS[state], alpha=0.25, lw=0)
        points = [
            (s.t - t_zero, s.power_w) for s in samples if s.gpu == gpu and s.power_w is not None
        ]
        if not points:
            # A whole run: each window's median power, not every reading (a week at 2 Hz
            # would not fit in memory, let alone in a figure).
            points = [
                ((w.t0 + w.t1) / 2 - t_zero, f.power_w)
                for w in windows
                for f in w.gpus
                if f.gpu == gpu and f.power_w is not None
            ]
        if points:
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, color="black", lw=0.7)
        ax.set_ylabel(f"GPU {gpu} W")
    axes[-1].set_xlabel("seconds since start")
    axes[0].set_title(title)
    handles = [Patch(color=COLOURS[s], alpha=0.4, label=s) for s in STATES] if gpus else []
    if heartbeats:
        handles.append(Patch(color=SECTION_COLOUR, alpha=0.3, label="checkpoint/eval section"))
    figure.legend(handles=handles, loc="outside lower center", ncols=len(handles))
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=90)
    return out
