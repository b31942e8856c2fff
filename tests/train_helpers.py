"""The tiny project's data for training tests, built once per module, and a project per test.

Shared by tests/test_train_stage.py and tests/test_cluster_slurm.py (the same data, trained
locally or through a cluster); a test module imports the fixture ``data`` from here.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stages import base, clean, ingest, pack, task_names
from tests.helpers import ROOT, wait_until, write_params
from tuneloop.demo import domain
from tuneloop.orchestration import forkserver
from tuneloop.params import load_params

# A few steps each; checkpoints (and validation) every 3 so resume and best-model paths run.
FAST = {"max_steps": 6, "save_steps": 3, "logging_steps": 1}


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The tiny project's data and base model, packed for one rank and (data/packed-2) for two."""
    folder = tmp_path_factory.mktemp("train-data")
    shutil.copytree(ROOT / "eval", folder / "eval")
    previous = Path.cwd()
    os.chdir(folder)
    try:
        write_params(folder)
        params = load_params()
        domain.seed_month(params.paths.incoming, params.demo)
        for stage in (base, task_names, ingest, clean, pack):
            stage.main()
        write_params(folder, {"batch": {"world_size": 2, "effective_batch": 2}})
        shutil.move(folder / "data/packed", folder / "packed-1")
        pack.main()
        shutil.move(folder / "data/packed", folder / "data/packed-2")
        shutil.move(folder / "packed-1", folder / "data/packed")
        yield folder
    finally:
        os.chdir(previous)


def make_project(
    data: Path,
    folder: Path,
    world_size: int = 1,
    watchdog: dict[str, Any] | None = None,
    **train_overrides: Any,
) -> Path:
    """A project folder with the shared data and params for this test.

    ``watchdog`` None: off, so ``train.main()`` trains in the test's own process; runs
    through ``python -m stages.train`` turn it on, as the shipped params do.
    """
    (folder / "data").mkdir(parents=True)
    shutil.copytree(data / "data/clean", folder / "data/clean")
    packed = "packed" if world_size == 1 else f"packed-{world_size}"
    shutil.copytree(data / "data" / packed, folder / "data/packed")
    shutil.copytree(data / "models/base", folder / "models/base")
    # The data stages' MLflow store, tables made: creating them costs seconds per run here.
    shutil.copy(data / "mlflow.db", folder / "mlflow.db")
    batch = {"world_size": world_size, "micro_batch_size": 1, "effective_batch": world_size}
    watch = {"enabled": False} if watchdog is None else {"enabled": True, **watchdog}
    write_params(folder, {"batch": batch, "train": {**FAST, **train_overrides}, "watchdog": watch})
    return folder


def stage_env() -> dict[str, str]:
    others = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    path = os.pathsep.join([str(ROOT), *(p for p in others if p and p != str(ROOT))])
    return os.environ | {
        "PYTHONPATH": path,
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "HF_HUB_OFFLINE": "1",
    }


@pytest.fixture
def served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The test's stage commands served by a forkserver, as under the retrain flow: its log.
    The server has the stages' environment (``stage_env``), or it would run them cold."""
    for key, value in stage_env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv(forkserver.ENV, raising=False)  # `off` outside: this test serves
    logs = tmp_path / "forkserver"
    with forkserver.serving(ROOT, logs) as path:
        assert path is not None
        wait_until(path.exists, 180, "the forkserver's socket", step=0.2)
        yield logs / "forkserver.log"


def run_stage(folder: Path) -> subprocess.CompletedProcess[str]:
    """``python -m stages.train`` as dvc repro starts it: no launcher around it."""
    return subprocess.run(
        [sys.executable, "-m", "stages.train"],
        cwd=folder,
        env=stage_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
