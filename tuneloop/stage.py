"""What every stage's ``main()`` shares: logging set-up and writing its metrics."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import mlflow

from tuneloop import tracking
from tuneloop.io import write_json
from tuneloop.params import Params


def setup_logging() -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


def metrics_path(params: Params, stage: str) -> Path:
    return params.paths.metrics / f"{stage}.json"


def write_metrics(params: Params, stage: str, metrics: dict[str, Any]) -> Path:
    """Write ``metrics/<stage>.json`` and log its numbers to the active MLflow run."""
    path = metrics_path(params, stage)
    write_json(path, metrics)
    if mlflow.active_run() is not None:
        tracking.log_metrics(metrics)
    return path
