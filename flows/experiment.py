"""The experiment flow: a pilot, or a few hyperparameter sets, as DVC experiments side by side.

    experiment(pilot_fraction=0.05)                      # one quick run on 5 % of the data
    experiment(sets=[{"train.learning_rate": 1e-4},      # a sweep: one experiment per set
                     {"train.learning_rate": 2e-4, "train.lora_r": 32}])

Each set becomes a queued DVC experiment (``dvc exp run --queue -S key=value ...``), then
``dvc exp run --run-all`` runs the queue (``jobs`` at a time). A queued experiment runs in a
temporary copy of the repo, so the workspace and the monthly run's outputs are never touched.
The copy gets ``dvc.lock``, the incoming badcases and the metrics (``--copy-paths``: git does
not track them), so the stages a set does not change are restored from DVC's cache and only
the rest reruns. The results stay DVC experiments: ``dvc exp show``, ``dvc exp apply NAME``.

``pilot_fraction`` sets ``clean.pilot_fraction`` in every set: the pilot is the same pipeline
on a slice of the data, to find a broken config in minutes rather than hours.

MLflow: one run for the flow; one child per experiment with its set as params, its metrics
from ``dvc exp show`` and tags ``dvc.exp.name`` / ``dvc.exp.rev``; each experiment's stage
runs are children of that (``tuneloop.tracking.runs.experiment_parent``). Select the experiment
runs in the MLflow UI and compare; the flow's run also carries ``experiment/comparison.md``
and a bar chart of the gate's primary metric and the validation loss.

Every set is checked against params.yaml's types before anything is queued: an unknown key
or a bad value fails the flow naming the set and the key. A failed experiment fails the flow
after every other experiment has been run and logged.
"""

from __future__ import annotations

import contextlib
import copy
import datetime as dt
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlflow
import yaml
from mlflow.tracking import MlflowClient
from prefect import flow, get_run_logger, task
from prefect.runtime import flow_run

from tuneloop.orchestration import forkserver
from tuneloop.orchestration.flow_results import ExperimentOutcome, ExperimentRun
from tuneloop.params import Params, ParamsError, load_params, parse_params
from tuneloop.tracking import lineage, recovery, runs, server

TAG_EXP_REV = "dvc.exp.rev"


class ExperimentFailed(RuntimeError):
    pass


@dataclass
class Outcome:
    """One DVC experiment after the queue ran."""

    name: str
    settings: dict[str, Any]
    run_id: str
    rev: str | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    @property
    def succeeded(self) -> bool:
        return self.rev is not None and self.error is None


def experiment_sets(
    sets: list[dict[str, Any]] | None, pilot_fraction: float | None
) -> list[dict[str, Any]]:
    """The param overrides of each experiment: ``sets`` (or one empty set), plus the pilot."""
    chosen = [dict(s) for s in sets] if sets else [{}]
    if pilot_fraction is not None:
        for settings in chosen:
            settings["clean.pilot_fraction"] = pilot_fraction
    return chosen


def check_sets(params_file: Path, sets: list[dict[str, Any]]) -> None:
    """Refuse, before anything is queued, a set that names no param or gives a bad value."""
    base = yaml.safe_load(params_file.read_text(encoding="utf-8"))
    for number, settings in enumerate(sets, 1):
        if not settings:
            continue
        data = copy.deepcopy(base)
        for key, value in settings.items():
            node = data
            *groups, leaf = key.split(".")
            for part in groups:
                if not isinstance(node, dict) or not isinstance(node.get(part), dict):
                    raise ParamsError(f"set {number}: {key!r}: {part!r} is not a params.yaml group")
                node = node[part]
            if leaf not in node:
                raise ParamsError(f"set {number}: {key!r} is not in params.yaml (a typo?)")
            node[leaf] = value
        try:
            parse_params(data, Path(f"params.yaml + set {number}"))
        except ParamsError as error:
            raise ParamsError(f"set {number} {settings}: {error}") from None


def override_text(value: Any) -> str:
    """A value as ``dvc exp run -S`` (Hydra's override grammar) reads it back unchanged."""
    if isinstance(value, str) and re.fullmatch(r"[A-Za-z_][\w./:-]*", value):
        return value
    return json.dumps(value)  # numbers, true/false/null, quoted strings, [lists]


def copy_paths(repo: Path, params: Params) -> list[str]:
    """What a queued experiment's temporary copy needs that git does not carry.

    The lock, the incoming data and the metrics: the only outs DVC does not cache
    (``cache: false``) are metrics and evaluate's reports (tests/test_experiment.py). A copy
    missing such an out reruns its stage, so preflight's reports are cached outs: missing,
    they made an experiment that changed only evaluate's params train again.
    """
    wanted = [Path("dvc.lock"), params.paths.incoming, params.paths.metrics]
    return [str(path) for path in wanted if (repo / path).exists()]


def dvc(repo: Path, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "dvc", *args], cwd=repo, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise ExperimentFailed(f"dvc {' '.join(args)} failed:\n{done.stdout}{done.stderr}")
    return done.stdout


@task(task_run_name="queue {name}")
def queue(repo: Path, name: str, settings: dict[str, Any], copies: list[str]) -> None:
    args = ["exp", "run", "--queue", "--name", name]
    for path in copies:
        args += ["--copy-paths", path]
    for key, value in settings.items():
        args += ["--set-param", f"{key}={override_text(value)}"]
    get_run_logger().info("dvc %s", " ".join(args))
    dvc(repo, *args)


@task(task_run_name="run the queue")
def run_queue(repo: Path, jobs: int, env: dict[str, str]) -> int:
    """``dvc exp run --run-all``; its log goes to this terminal, experiment by experiment."""
    command = [sys.executable, "-m", "dvc", "exp", "run", "--run-all", "--jobs", str(jobs)]
    return subprocess.run(command, cwd=repo, env=env).returncode


def shown(repo: Path) -> dict[str, dict[str, Any]]:
    """``dvc exp show --json`` as {experiment name: its newest rev's entry}."""
    found: dict[str, dict[str, Any]] = {}
    for baseline in json.loads(dvc(repo, "exp", "show", "--json", "--no-fetch")):
        for exp in baseline.get("experiments") or []:
            revs = exp.get("revs") or []
            if exp.get("name") and revs:
                found[exp["name"]] = revs[0]
    return found


def read_outcome(outcome: Outcome, entry: dict[str, Any] | None) -> Outcome:
    if entry is None:
        outcome.error = "DVC kept no result (see `dvc queue status` and `dvc queue logs NAME`)"
        return outcome
    data = entry.get("data") or {}
    if entry.get("error"):
        outcome.error = str(entry["error"].get("msg", entry["error"]))
        return outcome
    outcome.rev = data.get("rev") or entry.get("rev")
    for path, content in (data.get("metrics") or {}).items():
        if "data" in content:
            outcome.metrics[Path(path).stem] = content["data"]
    applied = (data.get("params") or {}).get("params.yaml", {}).get("data", {})
    for key, wanted in outcome.settings.items():
        node: Any = applied
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        # DVC parses -S values itself; a value it read differently would make the sweep lie.
        if node != wanted and not (isinstance(wanted, list | tuple) and list(wanted) == node):
            outcome.error = f"{key}: asked for {wanted!r}, the experiment ran with {node!r}"
    return outcome


def primary_scores(outcome: Outcome, params: Params) -> dict[str, float | None]:
    evaluation = outcome.metrics.get("evaluate", {})
    candidate = evaluation.get("candidate", {})
    scores: dict[str, float | None] = {
        f"{suite}/{params.gate.primary_metric}": candidate.get(suite, {}).get(
            params.gate.primary_metric
        )
        for suite in params.evaluate.suites
    }
    scores["eval_loss"] = outcome.metrics.get("train", {}).get("eval_loss")
    return scores


def comparison_table(outcomes: list[Outcome], params: Params) -> str:
    columns = list(primary_scores(outcomes[0], params)) if outcomes else []
    lines = [
        "| experiment | set | result | " + " | ".join(columns) + " | gate |",
        "|---|---|---|" + "---|" * len(columns) + "---|",
    ]
    for o in outcomes:
        scores = primary_scores(o, params)
        cells = ["-" if scores[c] is None else f"{scores[c]:.4f}" for c in columns]
        passed = o.metrics.get("decision", {}).get("passed")
        gate = "-" if passed is None else ("pass" if passed else "fail")
        result = "ok" if o.succeeded else f"FAILED: {o.error}"
        settings = ", ".join(f"{k}={v}" for k, v in o.settings.items()) or "(baseline)"
        lines.append(f"| {o.name} | {settings} | {result} | " + " | ".join(cells) + f" | {gate} |")
    return "\n".join(lines) + "\n"


def plot_comparison(outcomes: list[Outcome], params: Params, path: Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    columns = list(primary_scores(outcomes[0], params))
    figure = Figure(figsize=(4 * len(columns), 3.5))
    FigureCanvasAgg(figure)
    for index, column in enumerate(columns):
        axes = figure.add_subplot(1, len(columns), index + 1)
        values = [primary_scores(o, params)[column] for o in outcomes]
        axes.bar([o.name for o in outcomes], [v if v is not None else 0.0 for v in values])
        axes.set_title(column + (" (lower is better)" if column == "eval_loss" else ""))
        axes.tick_params(axis="x", labelrotation=30)
    figure.tight_layout()
    figure.savefig(path)
    return path


def default_prefix() -> str:
    return dt.datetime.now(dt.UTC).strftime("exp-%Y%m%d-%H%M%S")


def _child_run(
    client: MlflowClient, experiment_id: str, parent_id: str, name: str, settings: dict[str, Any]
) -> Outcome:
    """The experiment's MLflow run under the sweep's, its settings as params."""
    child = client.create_run(
        experiment_id,
        run_name=name,
        tags={
            runs.TAG_PARENT: parent_id,
            runs.TAG_EXP_NAME: name,
            runs.TAG_PIPELINE: "experiment",
        },
    )
    for key, value in settings.items():
        client.log_param(child.info.run_id, key, str(value))
    return Outcome(name, settings, child.info.run_id)


def _queue_all(repo: Path, params: Params, outcomes: list[Outcome], client: MlflowClient) -> None:
    """Queue every experiment, or none: a failure unqueues those queued and fails their runs."""
    copies = copy_paths(repo, params)
    try:
        for outcome in outcomes:
            queue(repo, outcome.name, outcome.settings, copies)
    except Exception:
        # Leave nothing half-queued for the next `--run-all` to pick up by surprise.
        subprocess.run(
            [sys.executable, "-m", "dvc", "queue", "remove", *(o.name for o in outcomes)],
            cwd=repo,
            capture_output=True,
        )
        for outcome in outcomes:
            client.set_terminated(outcome.run_id, status="FAILED")
        raise


@flow(name="experiment", log_prints=True)
def experiment(
    sets: list[dict[str, Any]] | None = None,
    pilot_fraction: float | None = None,
    repo: Path = Path(),
    jobs: int = 1,
    prefix: str | None = None,
) -> ExperimentRun:
    """Run each param set (and/or a pilot) as a DVC experiment and compare them in MLflow."""
    logger = get_run_logger()
    repo = repo.resolve()
    params = load_params(repo / "params.yaml")
    chosen = experiment_sets(sets, pilot_fraction)
    check_sets(repo / "params.yaml", chosen)
    prefix = prefix or default_prefix()
    names = [f"{prefix}-{number}" for number in range(1, len(chosen) + 1)]
    taken = set(dvc(repo, "exp", "list", "--name-only").split()) & set(names)
    if taken:
        raise ExperimentFailed(
            f"experiment name(s) {sorted(taken)} exist already for this commit: pass another "
            f"prefix, or `dvc exp remove {' '.join(sorted(taken))}`"
        )
    # The project's MLflow store, served for the stages, and the forkserver they start from,
    # as in the retrain flow (queued experiments run in copies of the workspace: a fork
    # imports the project's own modules from the copy it runs in).
    with (
        contextlib.chdir(repo),
        forkserver.serving(repo, repo / "logs"),
        server.local_server(repo, repo / "logs"),
    ):
        experiment_id = runs.setup(params.tracking.experiment)
        for said in recovery.close_killed_runs(experiment_id, "experiment", str(flow_run.id or "")):
            logger.warning(said)
        client = MlflowClient()
        git = lineage.git_state(repo)
        with mlflow.start_run(
            run_name=prefix,
            experiment_id=experiment_id,
            tags={
                runs.TAG_PIPELINE: "experiment",
                runs.TAG_COMMIT: git.commit,
                runs.TAG_DIRTY: str(git.dirty).lower(),
                runs.TAG_FLOW_RUN: str(flow_run.id or ""),
            },
        ) as parent:
            outcomes = [
                _child_run(client, experiment_id, parent.info.run_id, name, settings)
                for name, settings in zip(names, chosen, strict=True)
            ]
            _queue_all(repo, params, outcomes, client)
            env = os.environ | {
                # dvc.yaml's `python -m stages.x` must find this environment's python.
                "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
                "MLFLOW_TRACKING_URI": runs.tracking_uri(),
                runs.EXPERIMENT_RUNS_ENV: json.dumps({o.name: o.run_id for o in outcomes}),
                "TUNELOOP_FLOW_RUN_ID": str(flow_run.id or ""),
            }
            run_queue(repo, jobs, env)

            found = shown(repo)
            for outcome in outcomes:
                read_outcome(outcome, found.get(outcome.name))
                run_id = outcome.run_id
                tags = {TAG_EXP_REV: outcome.rev or ""}
                if outcome.error:
                    tags["tuneloop.experiment.error"] = outcome.error[:5000]
                for key, value in tags.items():
                    client.set_tag(run_id, key, value)
                for stem, values in outcome.metrics.items():
                    runs.log_metrics(values, prefix=stem, run_id=run_id)
                client.set_terminated(run_id, status="FINISHED" if outcome.succeeded else "FAILED")

            table = comparison_table(outcomes, params)
            logger.info("experiments:\n%s", table)
            mlflow.log_text(table, "experiment/comparison.md")
            reports = repo / params.paths.reports
            reports.mkdir(parents=True, exist_ok=True)
            if any(o.succeeded for o in outcomes):
                chart = plot_comparison(outcomes, params, reports / "experiment-comparison.png")
                mlflow.log_artifact(str(chart), "experiment")
            result = ExperimentRun(
                mlflow_run_id=parent.info.run_id,
                experiments={
                    o.name: ExperimentOutcome(
                        settings=o.settings,
                        rev=o.rev,
                        error=o.error,
                        scores=primary_scores(o, params),
                        gate_passed=o.metrics.get("decision", {}).get("passed"),
                    )
                    for o in outcomes
                },
            )
            failed = [o for o in outcomes if not o.succeeded]
            if failed:
                mlflow.set_tag("tuneloop.experiment.failed", ",".join(o.name for o in failed))
                reasons = "\n".join(f"- {o.name}: {o.error}" for o in failed)
                raise ExperimentFailed(f"{len(failed)} of {len(outcomes)} failed:\n{reasons}")
            return result
