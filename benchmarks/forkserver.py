"""A retrain with its stages forked from the warm interpreter, against every stage cold.

The demo's month 1 in a git + DVC project of this checkout's code and params (the base's
general-skill pre-training cut to 10 steps: the same work in both arms, and not what is
measured), retrained as a user runs it: ``tuneloop retrain`` as a process, its temporary
Prefect server, MLflow server and imports included. Two arms on fresh copies of the same
project, alternated (served, cold, served, cold) so that a drift in the machine's load
falls on both:

- **served**: the default, each stage a fork of ``tuneloop/orchestration/forkserver.py``;
- **cold**: ``TUNELOOP_FORKSERVER=off``, each stage a fresh ``python -m stages.<name>``.

Printed: each run's wall time, each stage's time from its MLflow run, the ratio of the
arms' means, and the load average before and after (a busy machine stretches all of it).

    python benchmarks/forkserver.py [--pairs 2]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import stage_overhead  # noqa: E402

from tuneloop.demo import domain  # noqa: E402
from tuneloop.orchestration import forkserver  # noqa: E402
from tuneloop.params import load_params  # noqa: E402

VENV_BIN = Path(sys.executable).parent


def env(served: bool) -> dict[str, str]:
    """An activated shell's environment (stage_overhead's); no Prefect, MLflow or fork server
    of ours, and ``TUNELOOP_FORKSERVER=off`` for the cold arm."""
    found = stage_overhead.env()
    for name in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI", forkserver.ENV):
        found.pop(name, None)
    return found if served else found | {forkserver.ENV: forkserver.OFF}


def make_project(folder: Path) -> Path:
    stage_overhead.checkout(folder, pretrain_steps=10)
    loaded = load_params(folder / "params.yaml")
    domain.seed_month(folder / loaded.paths.incoming, loaded.demo)
    return folder


def stage_seconds(project: Path) -> dict[str, float]:
    """Each stage's time from its MLflow run (start to end, inside the stage's process)."""
    db = f"file:{project / 'mlflow.db'}?mode=ro"
    with sqlite3.connect(db, uri=True) as connection:
        rows = connection.execute(
            "SELECT name, (end_time - start_time) / 1000.0 FROM runs ORDER BY start_time"
        ).fetchall()
    return {name: seconds for name, seconds in rows if not name.startswith("retrain")}


def retrain(project: Path, served: bool) -> tuple[float, dict[str, float]]:
    command = [str(VENV_BIN / "tuneloop"), "retrain", "--repo", str(project)]
    started = time.perf_counter()
    done = subprocess.run(command, env=env(served), capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if done.returncode:
        raise SystemExit(
            f"retrain failed in {project}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
        )
    return seconds, stage_seconds(project)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=2, help="served/cold pairs to run")
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()}", flush=True)
    walls: dict[bool, list[float]] = {True: [], False: []}
    stages: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    with tempfile.TemporaryDirectory(prefix="forkserver-bench-") as tmp:
        template = make_project(Path(tmp) / "template")
        for pair in range(args.pairs):
            for served in (True, False):
                project = Path(tmp) / f"{'served' if served else 'cold'}-{pair}"
                shutil.copytree(template, project, symlinks=True)
                seconds, per_stage = retrain(project, served)
                walls[served].append(seconds)
                stages[served].append(per_stage)
                arm = "served" if served else "cold"
                print(f"{arm} #{pair + 1}: tuneloop retrain {seconds:.1f} s", flush=True)
                shutil.rmtree(project)
    print(f"load average after: {os.getloadavg()}")
    print("\n| stage | served | cold |\n|---|---|---|")
    for name in stages[False][0]:
        served_s = sum(run.get(name, float("nan")) for run in stages[True]) / args.pairs
        cold_s = sum(run[name] for run in stages[False]) / args.pairs
        print(f"| {name} | {served_s:.1f} s | {cold_s:.1f} s |")
    served_mean = sum(walls[True]) / len(walls[True])
    cold_mean = sum(walls[False]) / len(walls[False])
    print(
        f"| `tuneloop retrain` | {served_mean:.1f} s | {cold_mean:.1f} s |\n\n"
        f"served / cold: {served_mean / cold_mean:.2f}"
    )


if __name__ == "__main__":
    main()
