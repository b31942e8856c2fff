"""How fast the power watchdog catches a hang, and how often it cries wolf.

Over many synthetic runs (``tuneloop.telemetry.synth.random_scenario``: H100,
H200, B200, B300 and generic cards, 1 to 4 GPUs, 1-4 Hz, averaged or
instantaneous power, checkpoints up to 8x the deadlock threshold, low-power
eval pauses, data starvation), half of them with a planted deadlock, it replays
each trace through the watchdog three ways:

- power + heartbeat (the intended set-up),
- heartbeat only (no NVML: a CPU box, or ``--heartbeat-only``),
- power only (no heartbeat callback installed): shown to make the point that
  power alone cannot tell a long checkpoint from a hang.

and prints detection latency after deadlock onset (p50/p90/max), misses, false
alarms and per-state classification accuracy, against the 600 s NCCL timeout
and the Trainer's 1800 s ``ddp_timeout``.

The traces are drawn from the same shipped calibration bands the classifier
classifies with, and those bands are estimates: the accuracy it prints is the
classifier's consistency with its own bands, not its accuracy on a real GPU.
The section it writes says so.

    .venv/bin/python benchmarks/watchdog.py [--traces 100] [--deadlock-after 20]
        [--append-results benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import logging
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from tuneloop.telemetry import synth
from tuneloop.telemetry.trace import STATES, Trace
from tuneloop.telemetry.watchdog import ReplayResult, WatchConfig, replay

# Part of every section this script writes: what its figures do and do not measure.
SYNTHETIC_CAVEAT = (
    "What these figures measure: every trace is synthetic, drawn (`tuneloop.telemetry.synth`) "
    "from the same shipped calibration bands the classifier classifies with, and those bands "
    "are estimates from public figures, not measurements. The per-state accuracy is therefore "
    "the classifier's consistency with its own bands, not its accuracy on a real GPU's power; "
    "the power modes' latencies and false alarms hold for cards whose power behaves as the "
    "bands say. No trace recorded on a GPU is in this benchmark, and the NVML sampling path "
    "has not yet run on a GPU. Heartbeat-only detection uses no bands; real hung jobs (two "
    "gloo ranks on a CPU) are caught in `tests/test_watchdog_hang.py`, not timed here."
)
NCCL_TIMEOUT_S = 600.0
DDP_TIMEOUT_S = 1800.0
JOB_GPUS = 16  # the field report's job: two nodes of eight


def without_power(trace: Trace) -> Trace:
    ticks = tuple(
        dataclasses.replace(
            tick, samples=tuple(dataclasses.replace(s, power_w=None) for s in tick.samples)
        )
        for tick in trace.ticks
    )
    return Trace(trace.devices, ticks)


def without_heartbeat(trace: Trace) -> Trace:
    return Trace(trace.devices, tuple(dataclasses.replace(t, heartbeat=None) for t in trace.ticks))


@dataclasses.dataclass
class Tally:
    latencies: list[float] = dataclasses.field(default_factory=list)
    missed: int = 0
    false_alarms: int = 0
    clean_runs_alarmed: int = 0
    runs: int = 0

    def add(self, result: ReplayResult) -> None:
        self.runs += 1
        onset = result.onsets[0] if result.onsets else math.inf
        early = [a for a in result.alarms if a.t < onset]
        self.false_alarms += len(early)
        if not result.onsets:
            self.clean_runs_alarmed += bool(early)
            return
        late = [a.t - onset for a in result.alarms if a.t >= onset]
        if late:
            self.latencies.append(late[0])
        else:
            self.missed += 1


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--traces", type=int, default=100, help="runs of each kind (default 100)")
    parser.add_argument("--deadlock-after", type=float, default=WatchConfig().deadlock_after_s)
    parser.add_argument("--seed", type=int, default=1000, help="first scenario seed")
    parser.add_argument(
        "--append-results",
        type=Path,
        default=None,
        help="append a '## watchdog' section to this markdown file",
    )
    args = parser.parse_args(argv)
    # Each replayed alarm would log an error; here they are counted, not shown.
    logging.getLogger("tuneloop.telemetry").setLevel(logging.CRITICAL)
    config = WatchConfig(deadlock_after_s=args.deadlock_after)
    modes = {
        "power + heartbeat": lambda t: t,
        "heartbeat only": without_power,
        "power only": without_heartbeat,
    }
    tallies = {mode: Tally() for mode in modes}
    accuracy = {s: [0, 0] for s in STATES}
    hours = 0.0
    started = time.perf_counter()
    for i in range(2 * args.traces):
        scenario = synth.random_scenario(
            args.seed + i, deadlock=i % 2 == 1, deadlock_after_s=args.deadlock_after
        )
        trace = synth.generate(scenario)
        hours += trace.duration_s * scenario.n_gpus / 3600
        for mode, strip in modes.items():
            result = replay(strip(trace), config)
            tallies[mode].add(result)
            if mode == "power + heartbeat":
                for state, (correct, count) in result.accuracy().items():
                    accuracy[state][0] += correct
                    accuracy[state][1] += count
    # Slow-step jobs (30 s a step, e.g. a large model with big global batches): a step's
    # silence is longer than the threshold before the median step time is known.
    slow = {mode: Tally() for mode in modes}
    slow_runs = max(1, args.traces // 4)
    for i in range(slow_runs):
        scenario = synth.random_scenario(
            args.seed + 10_000 + i,
            deadlock=False,
            deadlock_after_s=args.deadlock_after,
            step_s=30.0,
        )
        trace = synth.generate(scenario)
        hours += trace.duration_s * scenario.n_gpus / 3600
        for mode, strip in modes.items():
            slow[mode].add(replay(strip(trace), config))
    elapsed = time.perf_counter() - started

    lines = [
        "## watchdog",
        "",
        f"`benchmarks/watchdog.py --traces {args.traces} --deadlock-after "
        f"{args.deadlock_after:g}`: {2 * args.traces + slow_runs} synthetic runs "
        f"({args.traces} with a planted deadlock, {args.traces} clean with checkpoints up to "
        f"8x the threshold and low-power eval pauses), {hours:.1f} simulated GPU-hours, "
        f"replayed in {elapsed:.0f} s. Measured {dt.date.today().isoformat()} on "
        f"{platform.machine()}, {os.cpu_count()} CPU cores, CPython {platform.python_version()}, "
        f"no GPU (replay needs none). Window {config.window_s:g} s; latency is from deadlock "
        "onset to the alarm.",
        "",
        "| mode | latency p50 | p90 | max | missed | false alarms | clean runs alarmed |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode, tally in tallies.items():
        lat = tally.latencies
        cells = (
            [
                f"{statistics.median(lat):.1f} s",
                f"{percentile(lat, 0.9):.1f} s",
                f"{max(lat):.1f} s",
            ]
            if lat
            else ["-", "-", "-"]
        )
        lines.append(
            f"| {mode} | {' | '.join(cells)} | {tally.missed}/{args.traces} | "
            f"{tally.false_alarms} | {tally.clean_runs_alarmed}/{args.traces} |"
        )
    lines += [
        "",
        f"Clean slow-step runs (30 s a step, {slow_runs} runs): false alarms "
        + ", ".join(f"{mode} {t.false_alarms}" for mode, t in slow.items())
        + ". With power, a long step that computes never looks stalled; on the heartbeat "
        "alone the threshold stretches to 3x the median step time once two steps are seen, "
        "and until then waits as long as for a section.",
    ]
    best = tallies["power + heartbeat"]
    if best.latencies:
        worst = max(best.latencies)
        lines += [
            "",
            f"Defaults for comparison: NCCL timeout {NCCL_TIMEOUT_S:.0f} s, Trainer ddp_timeout "
            f"{DDP_TIMEOUT_S:.0f} s. On a {JOB_GPUS}-GPU job a hang costs "
            f"{worst * JOB_GPUS / 3600:.2f} GPU-hours at the watchdog's worst latency, "
            f"against {NCCL_TIMEOUT_S * JOB_GPUS / 3600:.1f} and "
            f"{DDP_TIMEOUT_S * JOB_GPUS / 3600:.1f} GPU-hours at those timeouts (and hours "
            "where nothing times out, as in the field report).",
        ]
    lines += [
        "",
        "Per-state classification accuracy on traces drawn from the classifier's own bands "
        "(a consistency check, see below; power + heartbeat; GPU windows with one true "
        "state): "
        + ", ".join(f"{state} {c / n:.3f} ({n})" for state, (c, n) in accuracy.items() if n)
        + ".",
        "",
        "Power only has no way to tell a long checkpoint from a hang, hence its false alarms: "
        "install `HeartbeatCallback` (or `beat`/`section`) in the training script.",
        "",
        SYNTHETIC_CAVEAT,
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if args.append_results is not None:
        path = args.append_results
        existing = path.read_text(encoding="utf-8") if path.exists() else "# Benchmark results\n"
        if "\n## watchdog\n" in f"\n{existing}":
            print(f"{path} already has a '## watchdog' section; remove it first", file=sys.stderr)
            return 1
        # Append only: other benchmarks write their own sections in the same file.
        with path.open("a", encoding="utf-8") as out:
            if not path.exists() or path.stat().st_size == 0:
                out.write(existing)
            out.write(("\n" if not existing.endswith("\n\n") else "") + text)
        print(f"appended to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
