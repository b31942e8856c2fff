"""What the tests share that is not a fixture: the tiny project and its params.

Test modules import from here (never from each other); ``conftest.py`` holds the fixtures.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any, cast

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


def chat_messages(record: dict[str, object]) -> list[dict[str, str]]:
    """A demo support record as chat messages (what clean makes of it)."""
    if "messages" in record:
        return cast(list[dict[str, str]], record["messages"])
    return [
        {"role": "user", "content": str(record["prompt"])},
        {"role": "assistant", "content": str(record["response"])},
    ]
