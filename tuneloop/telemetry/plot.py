"""The run's timeline as a PNG: per GPU, power over time on a band per state.

Power is drawn from the raw samples when given (the minutes before an alarm),
else from each window's median (a whole run).

Drawn with matplotlib's Agg canvas directly (no pyplot), so it works headless and
leaves the process's matplotlib backend alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tuneloop.telemetry.trace import STATES, Sample, State
from tuneloop.telemetry.watchdog import Alarm, JobWindow

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


def plot_timeline(
    samples: Sequence[Sample],
    windows: Sequence[JobWindow],
    out: Path,
    title: str = "GPU timeline",
    alarms: Sequence[Alarm] = (),
) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    gpus = sorted({s.gpu for s in samples} | {f.gpu for w in windows for f in w.gpus})
    if not gpus:
        gpus = [0]
    t_zero = min([s.t for s in samples] + [w.t0 for w in windows] or [0.0])
    figure = Figure(figsize=(12, 1.9 * len(gpus) + 1.0), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(len(gpus), 1, sharex=True, squeeze=False)[:, 0]
    for ax, gpu in zip(axes, gpus, strict=True):
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
        for alarm in alarms:
            ax.axvline(alarm.t - t_zero, color=COLOURS["checkpoint-or-deadlock"], lw=1.5, ls="--")
        ax.set_ylabel(f"GPU {gpu} W")
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("seconds since start")
    axes[0].set_title(title)
    figure.legend(
        handles=[Patch(color=COLOURS[s], alpha=0.4, label=s) for s in STATES],
        loc="outside lower center",
        ncols=len(STATES),
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=90)
    return out
