"""Where a result came from: git state, DVC data versions, params, code.

dvc.yaml is the one record of which param groups and files a stage uses, and
dvc.lock of the md5 of every dep and out; this module reads them rather than
keeping a second list.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tuneloop import __version__
from tuneloop.params import Params


@dataclass(frozen=True)
class GitState:
    commit: str
    dirty: bool


def git_state(repo: Path = Path()) -> GitState:
    """The checked-out commit and whether tracked files differ from it ('unknown' outside git)."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=repo, capture_output=True, text=True, check=True
        ).stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (subprocess.CalledProcessError, FileNotFoundError):
        return GitState("unknown", dirty=True)
    return GitState(commit, dirty)


def _load_yaml(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


# dvc.yaml ships with the code: the stage definitions are the ones beside these modules.
CODE_ROOT = Path(__file__).resolve().parents[1]


def stage_param_groups(stage: str, repo: Path = CODE_ROOT) -> list[str]:
    """The param groups (or keys) a stage declares in dvc.yaml."""
    spec = _load_yaml(repo / "dvc.yaml").get("stages", {}).get(stage, {})
    groups: list[str] = []
    for entry in spec.get("params", []):
        if isinstance(entry, str):
            groups.append(entry)
        elif isinstance(entry, dict):  # {file: [keys]} form
            for keys in entry.values():
                groups.extend(keys)
    return groups


def params_subset(params: Params, groups: list[str]) -> dict[str, Any]:
    full = params.model_dump(mode="json")
    subset: dict[str, Any] = {}
    for group in groups:
        node: Any = full
        for part in group.split("."):
            node = node[part]
        subset[group] = node
    return subset


def params_hash(params: Params, groups: list[str]) -> str:
    canonical = json.dumps(params_subset(params, groups), sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def dvc_lock_md5s(stage: str, repo: Path = Path()) -> dict[str, dict[str, str]]:
    """``{"deps": {path: md5}, "outs": {path: md5}}`` of a stage as dvc.lock records them."""
    entry = _load_yaml(repo / "dvc.lock").get("stages", {}).get(stage, {})
    return {
        kind: {item["path"]: item.get("md5", "") for item in entry.get(kind, [])}
        for kind in ("deps", "outs")
    }


def out_md5(path: Path, repo: Path = Path()) -> str | None:
    """The md5 dvc.lock holds for a stage out at ``path`` (relative to the repo), if any."""
    wanted = path.as_posix().rstrip("/")
    for entry in _load_yaml(repo / "dvc.lock").get("stages", {}).values():
        for out in entry.get("outs", []):
            if out["path"].rstrip("/") == wanted:
                return str(out.get("md5"))
    return None


def manifest(stage: str, params: Params, inputs: dict[str, Path], **extra: Any) -> dict[str, Any]:
    """What made an artifact folder: code version, params, input data versions."""
    groups = stage_param_groups(stage)
    git = git_state()
    return {
        "stage": stage,
        "created_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "tuneloop_version": __version__,
        "git_commit": git.commit,
        "git_dirty": git.dirty,
        "params_hash": params_hash(params, groups),
        "params": params_subset(params, groups),
        "inputs": {name: {"path": str(p), "md5": out_md5(p)} for name, p in inputs.items()},
        **extra,
    }
