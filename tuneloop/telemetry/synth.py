"""Synthetic GPU traces with ground truth, built from the calibration bands.

A scenario is a list of segments (state, duration, heartbeat section, planted
deadlock or not). ``generate`` turns it into a trace the way a real job would
look through NVML:

- the board's true power is simulated at 10 Hz per GPU: a steady level drawn
  from the state's band (compute near the job's own level), Gaussian noise,
  and for data-starvation bursts of compute separated by waits (duty cycle
  chosen so the mean lands in the band);
- the reading is the 1 s trailing average of that (``nvmlDeviceGetPowerUsage``
  on recent cards), or the true value for ``power_field="instant"``, sampled at
  ``hz``; utilisation is averaged the same way; the energy counter integrates
  the true power;
- the heartbeat advances one step per ``step_s`` in compute (slower while
  communicating or starved) and stands still in sections, idle periods and
  deadlocks;
- every sample carries its true state as ``label`` and every tick inside a
  planted deadlock ``deadlock=1``.

Segment variants: checkpoint-or-deadlock is "host" (kernels idle, the job's
memory resident: a save, a CPU-side wait) or "nccl-spin" (a collective kernel
spinning at 100 % utilisation without drawing power); idle is "no-context" or
"context".

``fixture_scenarios`` are the small traces the tests replay;
``python tests/fixtures/make_traces.py`` writes them again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from tuneloop.telemetry.calibration import Calibration, builtin_calibration
from tuneloop.telemetry.trace import (
    DeviceInfo,
    HeartbeatView,
    PowerField,
    Sample,
    State,
    Tick,
    Trace,
)

log = logging.getLogger(__name__)

FINE_HZ = 10  # resolution of the simulated board
AVERAGE_S = 1.0  # NVML's power averaging window
GENERIC_CAP_W = 400.0  # the generic calibration has no TDP; a 400 W card stands in
MEMORY_TOTAL_MIB = {"h100": 81559.0, "h200": 143771.0, "b200": 183359.0, "b300": 275040.0}

Variant = Literal["", "host", "nccl-spin", "no-context", "context"]
# Step interval relative to step_s: communication-bound and starved steps are slower.
STEP_SLOWDOWN: dict[State, float] = {"compute": 1.0, "communication": 1.5, "data-starvation": 2.5}


@dataclass(frozen=True)
class Segment:
    state: State
    duration_s: float
    section: str | None = None  # the heartbeat's open section during the segment
    variant: Variant = ""
    deadlock: bool = False  # ground truth: a planted hang

    @property
    def steps(self) -> bool:
        """Whether training steps arrive during this segment."""
        return self.section is None and not self.deadlock and self.state in STEP_SLOWDOWN


@dataclass(frozen=True)
class Scenario:
    name: str
    gpu_model: str  # a shipped calibration: h100, h200, b200, b300, generic
    segments: tuple[Segment, ...]
    n_gpus: int = 2
    hz: float = 2.0
    step_s: float = 1.0
    seed: int = 0
    power_field: PowerField = "average"
    notes: str = field(default="", compare=False)

    def onsets(self) -> list[float]:
        t, out, before = 0.0, [], False
        for segment in self.segments:
            if segment.deadlock and not before:
                out.append(t)
            before = segment.deadlock
            t += segment.duration_s
        return out


def _segment_power(
    segment: Segment,
    n: int,
    t0: float,
    cap: float,
    cal: Calibration,
    job_frac: float,
    rng: np.random.Generator,
) -> tuple[np.ndarray, np.ndarray, float]:
    """True power (W) and kernel-busy fraction (0..1) at FINE_HZ, and mean memory bandwidth use."""
    idle_ctx = cal.idle_w(cap, context=True)
    times = t0 + np.arange(n) / FINE_HZ
    low, high = cal.bands[segment.state]
    state = segment.state
    if state == "compute":
        level = min(job_frac * rng.uniform(0.97, 1.03), high) * cap
        power = level + rng.normal(0, 0.02 * cap, n)
        busy = np.clip(rng.normal(0.98, 0.02, n), 0, 1)
        return power, busy, 55.0
    if state == "communication":
        power = rng.uniform(low, high) * cap + rng.normal(0, 0.015 * cap, n)
        busy = np.clip(rng.normal(0.97, 0.03, n), 0, 1)
        return power, busy, 15.0
    if state == "data-starvation":
        compute_w = job_frac * cap
        target = rng.uniform(low, high) * cap
        duty = float(np.clip((target - idle_ctx) / (compute_w - idle_ctx), 0.15, 0.8))
        period = rng.uniform(0.8, 3.0)
        phase = rng.uniform(0, period)
        burst = ((times + phase) % period) < duty * period
        power = np.where(burst, compute_w, idle_ctx + 0.02 * cap) + rng.normal(0, 0.01 * cap, n)
        return power, burst.astype(float), 20.0 * duty
    if state == "checkpoint-or-deadlock":
        power = rng.uniform(low, high) * cap + rng.normal(0, 0.008 * cap, n)
        if segment.variant == "nccl-spin":
            busy = np.ones(n)
        else:
            # A save: occasional device-to-host copies, kernels otherwise idle.
            busy = (rng.random(n) < 0.03).astype(float)
        return power, busy, 2.0
    context = segment.variant != "no-context"
    power = cal.idle_w(cap, context=context) + rng.normal(0, 0.006 * cap, n)
    return power, np.zeros(n), 0.0


def _trailing_mean(values: np.ndarray, width: int) -> np.ndarray:
    kernel = np.ones(width) / width
    padded = np.concatenate([np.full(width - 1, values[0]), values])
    return np.convolve(padded, kernel, mode="valid")


def generate(scenario: Scenario) -> Trace:
    """The trace of a scenario: deterministic in ``scenario.seed``."""
    rng = np.random.default_rng(scenario.seed)
    cal = builtin_calibration(scenario.gpu_model)
    cap = cal.tdp_w or GENERIC_CAP_W
    memory_total = MEMORY_TOTAL_MIB.get(scenario.gpu_model, 49152.0)
    durations = [round(s.duration_s * FINE_HZ) for s in scenario.segments]
    n_fine = sum(durations)
    starts = np.cumsum([0, *durations])
    fine_t = np.arange(n_fine) / FINE_HZ
    job_frac = rng.uniform(*cal.bands["compute"])
    name = {"generic": "Synthetic GPU"}.get(
        scenario.gpu_model, f"NVIDIA {scenario.gpu_model.upper()}"
    )
    devices = tuple(
        DeviceInfo(i, f"{name} (synthetic)", cap, memory_total, scenario.power_field)
        for i in range(scenario.n_gpus)
    )

    # Job-level truth and heartbeat, per fine step.
    seg_index = np.repeat(np.arange(len(scenario.segments)), durations)
    step_at = np.full(n_fine, -1, dtype=np.int64)
    step, progress = -1, 0.0
    for i, segment in enumerate(scenario.segments):
        for j in range(starts[i], starts[i + 1]):
            if segment.steps:
                progress += 1.0 / FINE_HZ
                interval = scenario.step_s * STEP_SLOWDOWN[segment.state]
                if progress >= interval:
                    progress -= interval
                    step += 1
            step_at[j] = step

    per_gpu = []
    for _gpu in range(scenario.n_gpus):
        gpu_frac = job_frac * rng.uniform(0.98, 1.02)
        job_memory = rng.uniform(0.55, 0.85) * memory_total
        power = np.empty(n_fine)
        busy = np.empty(n_fine)
        mem_util = np.empty(n_fine)
        memory = np.empty(n_fine)
        for i, segment in enumerate(scenario.segments):
            a, b = starts[i], starts[i + 1]
            p, u, m = _segment_power(segment, b - a, a / FINE_HZ, cap, cal, gpu_frac, rng)
            power[a:b], busy[a:b], mem_util[a:b] = p, u, m
            holds = segment.state != "idle"
            memory[a:b] = job_memory if holds else rng.uniform(0.002, 0.01) * memory_total
        power = np.clip(power, 0.05 * cap, 1.05 * cap)
        width = int(AVERAGE_S * FINE_HZ)
        reading = power if scenario.power_field == "instant" else _trailing_mean(power, width)
        util = np.clip(100 * _trailing_mean(busy, width) + rng.normal(0, 1.0, n_fine), 0, 100)
        energy = rng.uniform(1e6, 1e8) + np.cumsum(power) / FINE_HZ
        per_gpu.append((reading, util, mem_util, memory, energy, busy))

    stride = round(FINE_HZ / scenario.hz)
    ticks = []
    # Start one averaging window in, so every reading is a full average.
    for j in range(int(AVERAGE_S * FINE_HZ), n_fine, stride):
        segment = scenario.segments[seg_index[j]]
        t = float(fine_t[j])
        samples = tuple(
            Sample(
                t=t,
                gpu=g,
                power_w=float(reading[j]),
                energy_j=float(energy[j]),
                gpu_util=float(util[j]),
                mem_util=float(np.clip(mem_util[j] + rng.normal(0, 2), 0, 100)),
                mem_used_mib=float(memory[j]),
                sm_clock_mhz=1980.0 if busy[j] > 0.5 else 1410.0,
                mem_clock_mhz=2619.0,
                label=segment.state,
            )
            for g, (reading, util, mem_util, memory, energy, busy) in enumerate(per_gpu)
        )
        view = HeartbeatView(int(step_at[j]) if step_at[j] >= 0 else None, segment.section)
        ticks.append(Tick(t, samples, view, segment.deadlock))
    return Trace(devices, tuple(ticks))


# --- scenarios -------------------------------------------------------------------------


def _training(rng: np.random.Generator, seconds: float) -> list[Segment]:
    """Ordinary training: compute with communication phases and the odd starved stretch."""
    out: list[Segment] = []
    left = seconds
    while left > 0:
        roll = rng.random()
        if roll < 0.6:
            segment = Segment("compute", float(rng.uniform(20, 60)))
        elif roll < 0.85:
            segment = Segment("communication", float(rng.uniform(10, 30)))
        else:
            segment = Segment("data-starvation", float(rng.uniform(15, 40)))
        segment = Segment(segment.state, min(segment.duration_s, max(left, 5.0)))
        out.append(segment)
        left -= segment.duration_s
    return out


def random_scenario(
    seed: int,
    deadlock: bool,
    deadlock_after_s: float = 20.0,
    gpu_model: str | None = None,
    minutes: float = 8.0,
    step_s: float | None = None,
) -> Scenario:
    """A random run: startup idle, training with checkpoints and evals, maybe a planted hang.

    Clean runs end while training. Checkpoints last up to 8x ``deadlock_after_s`` (well
    past the deadlock threshold, well inside the section maximum). ``step_s`` fixes the
    compute step time (default: 0.5 to 3 s).
    """
    rng = np.random.default_rng(seed)
    model = gpu_model or str(rng.choice(["h100", "h200", "b200", "b300", "generic"]))
    segments = [Segment("idle", float(rng.uniform(10, 30)), variant="no-context")]
    segments.append(Segment("idle", float(rng.uniform(5, 15)), variant="context"))
    total = minutes * 60
    spent = sum(s.duration_s for s in segments)
    while spent < total:
        chunk = _training(rng, float(rng.uniform(60, 120)))
        segments += chunk
        spent += sum(s.duration_s for s in chunk)
        roll = rng.random()
        if roll < 0.4:
            long = float(rng.uniform(1.5, 8.0) * deadlock_after_s)
            variant: Variant = "nccl-spin" if rng.random() < 0.3 else "host"
            segments.append(Segment("checkpoint-or-deadlock", long, "checkpoint", variant))
        elif roll < 0.65:
            segments.append(Segment("compute", float(rng.uniform(20, 60)), "eval"))
            if rng.random() < 0.5:
                # Generation-heavy eval scored on the CPU: the GPUs sit low in an eval section.
                pause = float(rng.uniform(2, 5) * deadlock_after_s)
                segments.append(Segment("checkpoint-or-deadlock", pause, "eval", "host"))
        spent = sum(s.duration_s for s in segments)
    if deadlock:
        # Training right before the hang, so the job is armed and its level known.
        segments.append(Segment("compute", float(rng.uniform(20, 40))))
        variant = "nccl-spin" if rng.random() < 0.6 else "host"
        hang = deadlock_after_s + float(rng.uniform(30, 60))
        segments.append(Segment("checkpoint-or-deadlock", hang, None, variant, deadlock=True))
    else:
        segments.append(Segment("compute", float(rng.uniform(20, 40))))
    return Scenario(
        name=f"{'deadlock' if deadlock else 'clean'}-{model}-{seed}",
        gpu_model=model,
        segments=tuple(segments),
        n_gpus=int(rng.integers(1, 5)),
        hz=float(rng.choice([1.0, 2.0, 4.0])),
        step_s=step_s if step_s is not None else float(rng.uniform(0.5, 3.0)),
        seed=seed,
        power_field="instant" if rng.random() < 0.3 else "average",
    )


def fixture_scenarios() -> list[Scenario]:
    """The small traces saved under tests/fixtures/traces (1 Hz, 2 GPUs, a few minutes)."""
    warmup = [Segment("idle", 15, variant="no-context"), Segment("idle", 10, variant="context")]
    return [
        Scenario(
            "clean-long-checkpoint-h100",
            "h100",
            (
                *warmup,
                Segment("compute", 60),
                Segment("communication", 20),
                Segment("compute", 40),
                Segment("checkpoint-or-deadlock", 90, "checkpoint", "host"),
                Segment("compute", 40),
                Segment("compute", 30, "eval"),
                Segment("checkpoint-or-deadlock", 45, "eval", "host"),
                Segment("compute", 30),
            ),
            hz=1.0,
            seed=11,
            notes="a 90 s checkpoint and a 45 s low-power eval pause; no alarm allowed",
        ),
        Scenario(
            "starvation-b300",
            "b300",
            (
                *warmup,
                Segment("compute", 40),
                Segment("data-starvation", 150),
                Segment("compute", 40),
            ),
            hz=1.0,
            seed=12,
            notes="150 s of data starvation: a warning, no alarm",
        ),
        Scenario(
            "deadlock-nccl-h200",
            "h200",
            (
                *warmup,
                Segment("compute", 60),
                Segment("communication", 20),
                Segment("compute", 30),
                Segment("checkpoint-or-deadlock", 60, "checkpoint", "host"),
                Segment("compute", 30),
                Segment("checkpoint-or-deadlock", 60, None, "nccl-spin", deadlock=True),
            ),
            hz=1.0,
            seed=13,
            notes="a checkpoint, then an NCCL hang at 100 % utilisation",
        ),
        Scenario(
            "deadlock-host-b200-instant",
            "b200",
            (
                *warmup,
                Segment("compute", 50),
                Segment("data-starvation", 40),
                Segment("compute", 40),
                Segment("checkpoint-or-deadlock", 60, None, "host", deadlock=True),
            ),
            hz=1.0,
            seed=14,
            power_field="instant",
            notes="a host-side hang after a starved stretch; instantaneous power readings",
        ),
    ]
