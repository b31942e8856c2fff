"""What every stage's ``main()`` shares: logging set-up, writing its metrics, its MLflow run.

The data stages (ingest, clean, pack) log their MLflow run after the work, through
``logged_after``: importing MLflow takes seconds, longer than a small month's work, so
it is loaded only once there is something to log.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tuneloop.io import write_json
from tuneloop.params import Params

# Metrics written while ``logged_after`` holds the run back; it logs them into the run.
_pending: list[dict[str, Any]] | None = None


def setup_logging() -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


def metrics_path(params: Params, stage: str) -> Path:
    return params.paths.metrics / f"{stage}.json"


def write_metrics(params: Params, stage: str, metrics: dict[str, Any]) -> Path:
    """Write ``metrics/<stage>.json`` and log its numbers to the stage's MLflow run."""
    path = metrics_path(params, stage)
    write_json(path, metrics)
    if _pending is not None:
        _pending.append(metrics)
        return path
    # No MLflow imported means no active run: do not import it just to find that out.
    mlflow = sys.modules.get("mlflow")
    if mlflow is not None and mlflow.active_run() is not None:
        from tuneloop import tracking

        tracking.log_metrics(metrics)
    return path


@contextlib.contextmanager
def logged_after(stage: str, params: Params) -> Iterator[None]:
    """Do a stage's work, then log it as the stage's MLflow run (``tracking.stage_run``).

    The run gets the lineage tags and params as any stage run, the metrics written during the
    work and the work's wall time (``stage_seconds``); a stage that fails leaves a failed run,
    as it would inside ``stage_run``.
    """
    global _pending
    pending: list[dict[str, Any]] = []
    _pending = pending
    start = time.monotonic()
    try:
        yield
    except BaseException:
        _pending = None
        with _run(stage, params, pending, time.monotonic() - start):
            raise
    _pending = None
    with _run(stage, params, pending, time.monotonic() - start):
        pass


@contextlib.contextmanager
def _run(
    stage: str, params: Params, metrics: list[dict[str, Any]], seconds: float
) -> Iterator[None]:
    from tuneloop import tracking

    with tracking.stage_run(stage, params):
        for entry in metrics:
            tracking.log_metrics(entry)
        tracking.log_metrics({"stage_seconds": round(seconds, 3)})
        yield
