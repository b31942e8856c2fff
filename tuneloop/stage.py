"""What every stage's ``main()`` shares: logging set-up, writing its metrics, its MLflow run.

The data stages (ingest, clean, pack, preflight, fixed_badcases) log their MLflow run after
the work, through ``logged_after``: importing MLflow takes seconds, longer than a small
month's work (and preflight's whole budget). Against an MLflow server (the one the flows and
the demo start, ``tuneloop.tracking.server``) they log over its REST API and never import
MLflow; with the SQLite store they load MLflow once there is something to log.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tuneloop.io import write_json
from tuneloop.params import Params, load_params

# Metrics written while ``logged_after`` holds the run back; it logs them into the run.
_pending: list[dict[str, Any]] | None = None


# The task a stage runs for, passed on to the processes it starts (the watchdog's job,
# torchrun's ranks) so they read the same view of the params.
TASK_ENV = "TUNELOOP_TASK"


def stage_params(argv: list[str] | None = None) -> Params:
    """params.yaml as a stage of one task sees it (``Params.for_task``).

    dvc.yaml runs each task's stages as ``python -m stages.<stage> --task <name>``; by hand,
    a project of one task may leave ``--task`` out. The task is exported in
    ``TUNELOOP_TASK`` for the processes the stage starts, which read it from there.
    """
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--task", default=os.environ.get(TASK_ENV) or None)
    task = parser.parse_known_args(sys.argv[1:] if argv is None else argv)[0].task
    params = load_params().the_task(task, "run the stage with --task <task>")
    if task is not None:  # a project of one task: its processes find it as this one did
        os.environ[TASK_ENV] = task
    return params


def setup_logging() -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


def metrics_path(params: Params, stage: str) -> Path:
    return params.paths.metrics / f"{stage}.json"


def write_metrics(params: Params, stage: str, metrics: dict[str, Any]) -> Path:
    """Write ``metrics/<stage>.json`` and log its numbers to the stage's MLflow run.

    ``metrics`` is the dump of the stage's metrics model (``BaseModel.model_dump()``), which
    its readers read the file back through (``tuneloop.io.read_model``).
    """
    path = metrics_path(params, stage)
    write_json(path, metrics)
    if _pending is not None:
        _pending.append(metrics)
        return path
    # No MLflow imported means no active run: do not import it just to find that out.
    mlflow = sys.modules.get("mlflow")
    if mlflow is not None and mlflow.active_run() is not None:
        from tuneloop.tracking import runs

        runs.log_metrics(metrics)
    return path


@dataclass
class Deferred:
    """What a stage under ``logged_after`` logs into its MLflow run once the work is done."""

    metrics: list[dict[str, Any]] = field(default_factory=list)
    dicts: dict[str, Any] = field(default_factory=dict)  # artifact file -> JSON data
    texts: dict[str, str] = field(default_factory=dict)  # artifact file -> text
    tags: dict[str, str] = field(default_factory=dict)

    def log_dict(self, data: Any, artifact_file: str) -> None:
        self.dicts[artifact_file] = data

    def log_text(self, text: str, artifact_file: str) -> None:
        self.texts[artifact_file] = text

    def set_tags(self, tags: dict[str, str]) -> None:
        self.tags.update(tags)


@contextlib.contextmanager
def logged_after(stage: str, params: Params) -> Iterator[Deferred]:
    """Do a stage's work, then log it as the stage's MLflow run (``tracking.stage_run``).

    The run gets the lineage tags and params as any stage run, the metrics written during the
    work, what the work gave the yielded ``Deferred`` (artifacts, tags) and the work's wall
    time (``stage_seconds``); a stage that fails leaves a failed run with all of that, as it
    would inside ``stage_run``.
    """
    global _pending
    from tuneloop.tracking.lineage import dvc_stage

    stage = dvc_stage(stage, params)
    deferred = Deferred()
    _pending = deferred.metrics
    start = time.monotonic()
    try:
        yield deferred
    except BaseException:
        _pending = None
        if _over_rest():
            _log_over_rest(stage, params, deferred, time.monotonic() - start, failed=True)
            raise
        with _run(stage, params, deferred, time.monotonic() - start):
            raise
    _pending = None
    if _over_rest():
        _log_over_rest(stage, params, deferred, time.monotonic() - start, failed=False)
        return
    with _run(stage, params, deferred, time.monotonic() - start):
        pass


def _over_rest() -> bool:
    """Log through the server's REST API: there is a server, and no MLflow run in this process
    (a notebook's or an in-process flow's) that the stage's run would be the child of."""
    from tuneloop.tracking import rest, runs

    mlflow = sys.modules.get("mlflow")
    in_run = mlflow is not None and mlflow.active_run() is not None
    return rest.is_server(runs.tracking_uri()) and not in_run


def _log_over_rest(
    stage: str, params: Params, deferred: Deferred, seconds: float, *, failed: bool
) -> None:
    from tuneloop.tracking import runs

    runs.log_stage_over_rest(
        stage,
        params,
        metrics=[*deferred.metrics, {"stage_seconds": round(seconds, 3)}],
        dicts=deferred.dicts,
        texts=deferred.texts,
        tags=deferred.tags,
        failed=failed,
    )


@contextlib.contextmanager
def _run(stage: str, params: Params, deferred: Deferred, seconds: float) -> Iterator[None]:
    import mlflow

    from tuneloop.tracking import runs

    with runs.stage_run(stage, params):
        for entry in deferred.metrics:
            runs.log_metrics(entry)
        runs.log_metrics({"stage_seconds": round(seconds, 3)})
        for name, data in deferred.dicts.items():
            mlflow.log_dict(data, name)
        for name, text in deferred.texts.items():
            mlflow.log_text(text, name)
        if deferred.tags:
            mlflow.set_tags(deferred.tags)
        yield
