"""Time the eval gate on 10k per-item scores: every check, interval and slice, as evaluate runs it.

Synthetic per-item scores with the demo suite's shape: ``--items`` items, base, champion,
candidate and its FP8 export, three metrics (two right/wrong, one a rate over the 20 % of
items that are unanswerable), two slice fields (language: 2 values, intent: 4), plus a
general suite of the same size for the forgetting budget. The models are right where a
shared item difficulty falls below their skill, so their scores are paired as real models'
are. Building the scores is not timed; ``decide`` runs once to warm up, then ``--repeats``
times timed; the best and the median wall and CPU times are reported with the load average
before and after (the machine is shared: on a busy one, wall time is mostly waiting).

    python benchmarks/gate.py                    # 10,000 items, params.yaml's gate
    python benchmarks/gate.py --items 100000 --samples 10000
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from tuneloop.judge.gate import BASE, CANDIDATE, CHAMPION, FP8, Items, SuiteItems, decide
from tuneloop.params import load_params

ROOT = Path(__file__).resolve().parents[1]
SUITE, GENERAL = "support_demo", "general_demo"
DIRECTIONS = {
    SUITE: {"accuracy": True, "format_compliance": True, "hallucination_rate": False},
    GENERAL: {"accuracy": True},
}


def synthetic(n: int, seed: int = 0) -> Items:
    rng = np.random.default_rng(seed)
    ids = [f"q{i}" for i in range(n)]
    lang = rng.choice(["en", "zh"], size=n, p=[0.6, 0.4]).tolist()
    intent = rng.choice(["return", "warranty", "shipping", "unknown"], size=n).tolist()
    unanswerable = (rng.random(n) < 0.2).astype(float)
    # Each model is right where a shared difficulty is below its skill: paired, like real models.
    difficulty = rng.random(n)
    skills = {BASE: 0.40, CHAMPION: 0.75, CANDIDATE: 0.76, FP8: 0.755}
    items: Items = {}
    for model, skill in skills.items():
        noise = rng.normal(0, 0.05, n)
        right = (difficulty + noise < skill).astype(float)
        items[model] = {
            SUITE: SuiteItems.of(
                ids,
                {
                    "accuracy": right,
                    "format_compliance": np.minimum(1.0, right + (rng.random(n) < 0.9)),
                    "hallucination_rate": (rng.random(n) < 1.2 - skill).astype(float),
                },
                weights={"hallucination_rate": unanswerable},
                slices={"lang": lang, "intent": intent},
            )
        }
        if model != FP8:
            general = difficulty + rng.normal(0, 0.05, n) < 0.8 - (model == CANDIDATE) * 0.01
            items[model][GENERAL] = SuiteItems.of(ids, {"accuracy": general.astype(float)})
    return items


def main() -> None:
    gate = load_params(ROOT / "params.yaml").gate
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=10_000, help="items per suite")
    parser.add_argument("--samples", type=int, default=gate.bootstrap_samples)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    gate = gate.model_copy(update={"bootstrap_samples": args.samples})

    items = synthetic(args.items)
    load_before = os.getloadavg()
    decision = decide(items, DIRECTIONS, gate, [SUITE], [GENERAL])  # warm-up
    times, cpu = [], []
    for _ in range(args.repeats):
        started, started_cpu = time.perf_counter(), time.process_time()
        decide(items, DIRECTIONS, gate, [SUITE], [GENERAL])
        times.append(time.perf_counter() - started)
        cpu.append(time.process_time() - started_cpu)
    load_after = os.getloadavg()

    print(
        f"gate on {args.items:,} items per suite ({SUITE}: 4 models x 3 metrics, "
        f"{len(decision.slices)} slice figures; {GENERAL}: 3 models), "
        f"{gate.bootstrap_samples} resamples, {len(decision.checks)} checks"
    )
    print(
        f"  wall: best {min(times):.3f} s, median {statistics.median(times):.3f} s; "
        f"CPU (this process, all threads): best {min(cpu):.3f} s, median "
        f"{statistics.median(cpu):.3f} s ({args.repeats} runs)"
    )
    print(f"  verdict {decision.verdict}; more items: {decision.more_items}")
    print(
        f"  load average before {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}, "
        f"after {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}; "
        f"{os.cpu_count()} CPUs, {platform.machine()}, Python {platform.python_version()}, "
        f"numpy {np.__version__}"
    )


if __name__ == "__main__":
    main()
