"""What a data stage process costs beyond its work, as a user runs it, and the ``dvc repro`` no-op.

The 4x demo month (``benchmarks/data_path.py``'s generator: 66,404 lines) in a git + DVC
project with tracking on, run three ways, each on a fresh copy of the same project:

- **processes, SQLite store**: ``python -m stages.ingest``, then ``clean``, then ``pack``, as a
  user runs them with the default tracking store (each process imports MLflow and opens
  ``mlflow.db``), lineage hashed as in any run;
- **processes, MLflow server**: the same three with ``tuneloop.tracking.server``'s local server
  running (what the flows and the demo start), the stages logging over its REST API;
- **in-process**: the three stages' ``main()`` one after the other in one Python process that
  has already imported them, MLflow and DVC and opened the store: the work, with the
  lineage hashing and the MLflow run, without a process's start-up.

A stage's fixed overhead is its process time minus its in-process time. Then the ``dvc
repro`` no-op: ``dvc repro`` twice in a project where the pipeline has run (``--noop-project``:
after ``make demo``, or any project whose ``dvc repro`` completed), the second timed, and the
MLflow runs it added counted. Without ``--noop-project`` the no-op is ``dvc repro pack`` (base,
init, ingest, clean, pack) in the benchmark's own project. The load average is printed before
and after: the figures are wall times, which a busy machine stretches.

    python benchmarks/stage_overhead.py
    python benchmarks/stage_overhead.py --noop-project /path/to/project/after/make-demo
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import data_path  # noqa: E402

STAGES = data_path.STAGES
SCALE = 4
VENV_BIN = Path(sys.executable).parent
# As `make` sets them: nothing phones home; caches stay in the project.
QUIET = {
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DVC_NO_ANALYTICS": "1",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "HF_HUB_DISABLE_TELEMETRY": "1",
}


def env() -> dict[str, str]:
    """The environment a user's activated shell has: the venv first on PATH, no tracking URI
    of ours (a server block sets its own)."""
    found = os.environ | QUIET | {"PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    found.pop("PYTHONPATH", None)
    return found


def git(folder: Path, *args: str) -> None:
    command = ["git", "-c", "user.name=bench", "-c", "user.email=bench@example.com", *args]
    subprocess.run(command, cwd=folder, check=True, capture_output=True)


def checkout(folder: Path, pretrain_steps: int) -> Path:
    """A git + DVC checkout of this project's code and params in ``folder``, the base's
    general-skill pre-training cut to ``pretrain_steps``."""
    folder.mkdir(parents=True)
    for name in ("dvc.yaml", ".dvcignore", "pyproject.toml", ".gitignore"):
        shutil.copy(ROOT / name, folder / name)
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["model"]["tiny"]["pretrain_steps"] = pretrain_steps
    (folder / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    ignore = shutil.ignore_patterns("__pycache__")
    for name in ("stages", "tuneloop", "flows", "eval"):
        shutil.copytree(ROOT / name, folder / name, ignore=ignore)
    shutil.copytree(ROOT / ".dvc", folder / ".dvc", ignore=shutil.ignore_patterns("cache", "tmp"))
    git(folder, "init", "-q")
    git(folder, "add", "-A")
    git(folder, "commit", "-qm", "benchmark project")
    return folder


def make_project(folder: Path) -> Path:
    """A checkout with its base model built.

    The base is built without its general-skill pre-training (``model.tiny.pretrain_steps:
    0``, minutes on a busy machine): the data stages read only its tokenizer, which is the same.
    """
    checkout(folder, pretrain_steps=0)
    run(folder, ["dvc", "repro", "--single-item", "base"], env())
    # The task names ingest reads (stage task_names): written once, untimed, as base.
    run(folder, ["dvc", "repro", "--single-item", "task_names"], env())
    return folder


def run(folder: Path, command: list[str], environment: dict[str, str]) -> float:
    start = time.perf_counter()
    done = subprocess.run(command, cwd=folder, env=environment, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed in {folder}:\n{done.stdout}{done.stderr}")
    return seconds


def processes(project: Path, environment: dict[str, str]) -> dict[str, float]:
    python = str(VENV_BIN / "python")
    return {s: run(project, [python, "-m", f"stages.{s}"], environment) for s in STAGES}


# One process: imports, MLflow's store and DVC first (untimed), then each stage's main().
IN_PROCESS = """
import json, sys, time
sys.path.insert(0, ".")
import mlflow, dvc.repo
from tuneloop.params import load_params
from tuneloop.tracking import runs
import stages.ingest, stages.clean, stages.pack
runs.setup(load_params().tracking.experiment)
seconds = {}
for name in %r:
    start = time.perf_counter()
    getattr(stages, name).main()
    seconds[name] = time.perf_counter() - start
print(json.dumps(seconds))
"""


def in_process(project: Path, environment: dict[str, str]) -> dict[str, float]:
    code = IN_PROCESS % (STAGES,)
    done = subprocess.run(
        [str(VENV_BIN / "python"), "-c", code],
        cwd=project,
        env=environment,
        capture_output=True,
        text=True,
    )
    if done.returncode:
        raise SystemExit(f"in-process run failed:\n{done.stderr[-4000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def mlflow_runs(project: Path) -> int:
    db = project / "mlflow.db"
    if not db.exists():
        return 0
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as connection:
        return int(connection.execute("SELECT count(*) FROM runs").fetchone()[0])


def noop(project: Path, targets: list[str]) -> str:
    """``dvc repro`` once (to settle), then timed; its time and the MLflow runs it added."""
    command = [str(VENV_BIN / "dvc"), "repro", *targets]
    try:
        run(project, command, env())
        before = mlflow_runs(project)
        seconds = run(project, command, env())
    except SystemExit as error:  # the other figures stand without it
        return f"failed: {str(error)[-2000:]}"
    return f"{seconds:.1f} s, {mlflow_runs(project) - before} MLflow run(s) added"


def fresh(template: Path, parent: Path, name: str) -> Path:
    project = parent / name
    shutil.copytree(template, project, symlinks=True)
    return project


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--noop-project", type=Path, help="a project whose whole `dvc repro` has run"
    )
    args = parser.parse_args()
    from tuneloop.tracking import server

    load_before = os.getloadavg()
    print(f"load average before: {load_before}", flush=True)
    lines = SCALE * (data_path.SUPPORT_1X + data_path.BADCASES_1X)
    with tempfile.TemporaryDirectory(prefix="stage-overhead-") as tmp:
        parent = Path(tmp)
        template = make_project(parent / "template")
        data_path.seed_month(template, 0, lines)
        data_path.warm_code()

        sqlite_runs = processes(fresh(template, parent, "sqlite"), env())
        print(f"processes, SQLite store: {sqlite_runs}", flush=True)

        project = fresh(template, parent, "server")
        started = time.perf_counter()
        with server.local_server(project, project / "logs"):
            server_start = time.perf_counter() - started
            server_runs = processes(project, env())  # env() holds the server's URI now
        print(f"processes, MLflow server (ready in {server_start:.1f} s): {server_runs}")

        inside = in_process(fresh(template, parent, "in-process"), env())
        print(f"in-process: {inside}", flush=True)

        if args.noop_project:
            noop_what = f"`dvc repro` in {args.noop_project}"
            found = noop(args.noop_project.resolve(), [])
        else:
            noop_what = "`dvc repro pack` (base, init, ingest, clean, pack)"
            found = noop(parent / "sqlite", ["pack"])
    load_after = os.getloadavg()

    print()
    print(f"4x demo month: {lines:,} lines; {os.cpu_count()} CPU cores")
    print(
        "| stage | process, SQLite store | process, MLflow server | in-process | "
        "overhead, SQLite | overhead, server |"
    )
    print("|---|---|---|---|---|---|")
    for stage in STAGES:
        print(
            f"| {stage} | {sqlite_runs[stage]:.1f} s | {server_runs[stage]:.1f} s | "
            f"{inside[stage]:.1f} s | {sqlite_runs[stage] - inside[stage]:.1f} s | "
            f"{server_runs[stage] - inside[stage]:.1f} s |"
        )
    total = {
        k: sum(v.values())
        for k, v in (("sqlite", sqlite_runs), ("server", server_runs), ("inside", inside))
    }
    print(
        f"| total | {total['sqlite']:.1f} s | {total['server']:.1f} s | {total['inside']:.1f} s "
        f"| {total['sqlite'] - total['inside']:.1f} s | {total['server'] - total['inside']:.1f} s |"
    )
    print(f"\nMLflow server ready in {server_start:.1f} s (once per flow or demo, not per stage)")
    print(f"no-op: {noop_what}: {found}")
    print(
        f"load average before: {load_before[0]:.2f} / {load_before[1]:.2f} / "
        f"{load_before[2]:.2f}; after: {load_after[0]:.2f} / {load_after[1]:.2f} / "
        f"{load_after[2]:.2f}"
    )


if __name__ == "__main__":
    main()
