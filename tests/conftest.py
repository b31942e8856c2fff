"""Shared fixtures: a tiny tuneloop project in a temp dir, and one Prefect test server."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]

# Small enough for a test, big enough that every stage does real work.
TINY_OVERRIDES: dict[str, dict[str, Any]] = {
    # A few steps of the base's general-skill pre-training: the code path, not the skill.
    "model": {"tiny": {"pretrain_steps": 10}},
    "demo": {"n_support": 500, "n_badcases": 40},
    "pack": {"seq_len": 128},
    "train": {"max_steps": 30, "logging_steps": 5},
    "evaluate": {"limit": 12, "batch_size": 12},
    "gate": {"min_gain": 0.0},
}


def write_params(folder: Path, overrides: dict[str, dict[str, Any]] | None = None) -> Path:
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    for source in (TINY_OVERRIDES, overrides or {}):
        for group, values in source.items():
            for key, value in values.items():
                # One level deeper for sub-groups (model.tiny): override keys, keep the rest.
                if isinstance(value, dict) and isinstance(params[group].get(key), dict):
                    params[group][key].update(value)
                else:
                    params[group][key] = value
    path = folder / "params.yaml"
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    return path


def copy_project(target: Path) -> Path:
    """A git + DVC checkout of this project's code in ``target``, with tiny params."""
    for name in ("dvc.yaml", ".dvcignore", "pyproject.toml"):
        shutil.copy(ROOT / name, target / name)
    for name in ("stages", "tuneloop", "flows", "eval"):
        shutil.copytree(ROOT / name, target / name, ignore=shutil.ignore_patterns("__pycache__"))
    (target / ".dvc").mkdir()
    shutil.copy(ROOT / ".dvc" / "config", target / ".dvc" / "config")
    shutil.copy(ROOT / ".dvc" / ".gitignore", target / ".dvc" / ".gitignore")
    shutil.copy(ROOT / ".gitignore", target / ".gitignore")
    write_params(target)
    git = ["git", "-c", "user.name=test", "-c", "user.email=test@example.com"]
    subprocess.run([*git, "init", "-q"], cwd=target, check=True)
    subprocess.run([*git, "add", "-A"], cwd=target, check=True)
    subprocess.run([*git, "commit", "-qm", "tiny project"], cwd=target, check=True)
    return target


@pytest.fixture(autouse=True)
def _no_inherited_tracking(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test writes MLflow runs to its own project folder, never a user's server."""
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "TUNELOOP_FLOW_RUN_ID"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """One torch thread for a module's tiny models.

    On a shared 2-core machine, torch's second thread spin-waits for a busy core:
    a tiny forward pass took 1.5 s with two threads and 16 ms with one.
    """
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def prefect_harness() -> Iterator[None]:
    from prefect.testing.utilities import prefect_test_harness

    # 30 s (the default) is tight for the server start on two cores.
    with prefect_test_harness(server_startup_timeout=90):
        yield


@pytest.fixture
def in_folder(tmp_path: Path) -> Iterator[Path]:
    previous = Path.cwd()
    os.chdir(tmp_path)
    try:
        yield tmp_path
    finally:
        os.chdir(previous)
