"""The Slurm launcher's overhead against local torchrun, on the same two ranks.

    python benchmarks/cluster_launch.py [--steps 20]

Builds the tiny project once (base, ingest, clean, pack for two ranks), then trains the same
LoRA twice through ``python -m stages.train``: with ``train.launcher: local`` (the stage
re-execs under torchrun, two gloo ranks, beside its watchdog) and with ``train.launcher:
slurm`` on the two-node test cluster of tests/slurm_helpers.py (one rank per node, each under
its node's watchdog). From the stage's start and end and the watchdogs' traces (the time of
the first tick that saw step 1, and of the first that saw the last step) it prints, for each:
start -> first step, the training steps, last step -> stage exit. Needs slurm-wlm and munge
(as the tests do); prints the load average before and after, since the machine is shared.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.helpers import free_port, write_params  # noqa: E402
from tests.slurm_helpers import require_slurm, running_cluster  # noqa: E402
from tuneloop.telemetry.trace import read_trace  # noqa: E402


def params_for(folder: Path, steps: int, launcher: str) -> None:
    write_params(
        folder,
        {
            "batch": {"world_size": 2, "micro_batch_size": 1, "effective_batch": 2},
            "train": {
                "method": "lora",
                "distributed": "ddp",
                "launcher": launcher,
                "max_steps": steps,
                "save_steps": 1000,
                "logging_steps": 1,
            },
            "watchdog": {"enabled": True},
            "cluster": {
                "nodes": 2,
                "gpus_per_node": 1,
                "rendezvous_port": free_port(),
                "poll_s": 0.5,
                "time_limit": "30:00",
                # torchrun sets it for several ranks on a node, not for one: as local does.
                "env": {"OMP_NUM_THREADS": "1"},
            },
        },
    )


def build(folder: Path) -> None:
    from stages import base, clean, ingest, pack, task_names
    from tuneloop.demo import domain
    from tuneloop.params import load_params

    shutil.copytree(ROOT / "eval", folder / "eval")
    os.chdir(folder)
    params_for(folder, 1, "local")
    domain.seed_month(load_params().paths.incoming, load_params().demo)
    for stage in (base, task_names, ingest, clean, pack):
        stage.main()


def steps_seen(traces: list[Path], last: int) -> tuple[float, float]:
    """Earliest tick that saw step 1 and latest first tick that saw step ``last``, over nodes."""
    first, final = [], []
    for path in traces:
        ticks = [t for t in read_trace(path).ticks if t.heartbeat and t.heartbeat.step]
        first.append(min(t.t for t in ticks if (t.heartbeat.step or 0) >= 1))  # type: ignore[union-attr]
        final.append(min(t.t for t in ticks if (t.heartbeat.step or 0) >= last))  # type: ignore[union-attr]
    return min(first), max(final)


def run(folder: Path, env: dict[str, str], steps: int) -> tuple[float, float, float]:
    """(start -> first step, steps, last step -> exit) in seconds for one stage run."""
    shutil.rmtree(folder / "checkpoints", ignore_errors=True)
    shutil.rmtree(folder / "models/adapter", ignore_errors=True)
    before = (
        set((folder / "reports/watch").glob("*")) if (folder / "reports/watch").exists() else set()
    )
    started = time.time()
    done = subprocess.run(
        [sys.executable, "-m", "stages.train"], cwd=folder, env=env, capture_output=True, text=True
    )
    ended = time.time()
    if done.returncode != 0:
        raise SystemExit(f"the stage failed:\n{done.stderr[-3000:]}")
    (new,) = set((folder / "reports/watch").glob("*")) - before
    traces = sorted(new.glob("*/trace.csv")) or [new / "trace.csv"]
    first, last = steps_seen(traces, steps)
    return first - started, last - first, ended - last


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="training steps of each run")
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()}", flush=True)
    folder = Path(tempfile.mkdtemp(prefix="cluster-launch-"))
    env = os.environ | {"PYTHONPATH": str(ROOT), "MLFLOW_DISABLE_TELEMETRY": "true"}
    try:
        build(folder)
        params_for(folder, args.steps, "local")
        local = run(folder, env, args.steps)
        os.environ.pop("CI", None)
        require_slurm()
        with running_cluster(folder / "slurm") as cluster:
            params_for(folder, args.steps, "slurm")
            slurm = run(folder, env | {"SLURM_CONF": cluster.env["SLURM_CONF"]}, args.steps)
    finally:
        os.chdir(ROOT)
        shutil.rmtree(folder, ignore_errors=True)
    print(
        f"| launcher | start -> first step (s) | {args.steps} steps (s) | last step -> exit (s) |"
    )
    print("|---|---|---|---|")
    for name, (up, steps, down) in (
        ("local torchrun, 2 ranks", local),
        ("slurm, 2 nodes x 1", slurm),
    ):
        print(f"| {name} | {up:.1f} | {steps:.1f} | {down:.1f} |")
    print(f"load average after: {os.getloadavg()}", flush=True)


if __name__ == "__main__":
    main()
