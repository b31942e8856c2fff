"""Where a result came from: git state, DVC data versions, params, code, base model.

dvc.yaml is the one record of which param groups and files a stage uses; this module reads
it rather than keeping a second list. The md5 of a stage's deps and outs is computed here
with DVC's own hashing, after the stage wrote its outs, so it is the version DVC records
for that run whichever way the stage was started (``dvc repro``, ``dvc exp run``, ``python
-m stages.<name>``, the Prefect flow). ``tuneloop.tracking.runs`` puts it on the MLflow run.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
import os
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from tuneloop import __version__
from tuneloop.io import read_yaml
from tuneloop.params import Params

log = logging.getLogger(__name__)


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
    data = read_yaml(path)
    return data if isinstance(data, dict) else {}


# dvc.yaml ships with the code: the stage definitions are the ones beside these modules.
CODE_ROOT = Path(__file__).resolve().parents[2]


def dvc_stage(stage: str, params: Params) -> str:
    """The DVC name of ``stage`` run for the task of ``params`` (``Params.for_task``):
    ``clean`` -> ``clean@support``; the name itself for the project's own params (the shared
    stages) or a name that is already a DVC one."""
    if params.task is None or "@" in stage:
        return stage
    return f"{stage}@{params.task}"


def project_stage(dvc_name: str) -> str:
    """The stage a DVC stage name runs: ``clean@support`` -> ``clean``."""
    return dvc_name.partition("@")[0]


def stage_param_groups(stage: str, repo: Path = CODE_ROOT) -> list[str]:
    """The param groups (or keys) a stage declares in dvc.yaml (``clean@orders``: those of
    the ``clean`` group, ``${key}`` read as ``orders``)."""
    name, _, key = stage.partition("@")
    spec = _load_yaml(repo / "dvc.yaml").get("stages", {}).get(name, {})
    spec = spec.get("do", spec)
    groups: list[str] = []
    for entry in spec.get("params", []):
        if isinstance(entry, str):
            groups.append(entry)
        elif isinstance(entry, dict):  # {file: [keys]} form
            for keys in entry.values():
                groups.extend(keys)
    # A task's stage by its group's name alone (``train``): its own keys, not a task's.
    return [g.replace("${key}", key) for g in groups if key or "${key}" not in g]


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


def dvc_lock_md5s(repo: Path = Path()) -> dict[str, dict[str, dict[str, str]]]:
    """``{stage: {"deps": {path: md5}, "outs": {path: md5}}}`` as dvc.lock records them, one
    read of the file for every stage (none before the first ``dvc repro``).

    What the last ``dvc repro``/``dvc commit`` recorded, not necessarily what is in the
    workspace now: a stage's own run uses ``stage_md5s``.
    """
    stages = _load_yaml(repo / "dvc.lock").get("stages") or {}
    return {
        stage: {
            # normpath: a task whose folder is the root writes ./models/adapter, which
            # readers name models/adapter.
            kind: {
                os.path.normpath(item["path"]): item.get("md5", "") for item in entry.get(kind, [])
            }
            for kind in ("deps", "outs")
        }
        for stage, entry in stages.items()
    }


@dataclass(frozen=True)
class StageMd5s:
    """The md5 of each dep and out of a stage, keyed by path as dvc.lock writes them."""

    deps: dict[str, str]
    outs: dict[str, str]
    # The project's default DVC remote (credentials removed), where these versions are pushed.
    remote: str | None = None

    def data_deps(self) -> dict[str, str]:
        """The deps that are data or models rather than code (which the git commit pins)."""
        return {path: md5 for path, md5 in self.deps.items() if not path.endswith(".py")}


def stage_md5s(stage: str, root: Path = Path(), *, outs: bool = True) -> StageMd5s | None:
    """Hash a stage's deps (and outs) now, as DVC does when it records the stage in dvc.lock.

    The stage definition comes from the DVC project at ``root`` (the working directory, which
    is the project root under ``dvc repro`` and the temporary copy under a queued ``dvc exp
    run``), with its params interpolated; directories hash to DVC's ``<md5>.dir`` with the
    project's .dvcignore applied. Params deps are skipped (MLflow holds the params). Nothing
    here takes DVC's repo lock, so it runs inside a stage that ``dvc repro`` started; hashes
    already in DVC's state database are reused. None outside a DVC project, or when its
    dvc.yaml has no such stage.
    """
    # Imported here: dvc takes about a second to import, and most users of this module
    # (every stage's start-up) never hash.
    from dvc.dependency.param import ParamsDependency
    from dvc.exceptions import NotDvcRepoError
    from dvc.repo import Repo
    from dvc.stage.exceptions import StageFileDoesNotExistError, StageNotFound

    try:
        repo = Repo(os.fspath(root))
    except NotDvcRepoError:
        log.info("%s is not in a DVC project: no DVC md5s recorded", root.resolve())
        return None
    with repo:
        try:
            found = repo.stage.load_one(name=stage)
        except (StageFileDoesNotExistError, StageNotFound):
            log.warning(
                "the DVC project at %s has no stage %r in dvc.yaml: no DVC md5s recorded",
                repo.root_dir,
                stage,
            )
            return None
        hashed: dict[str, dict[str, str]] = {"deps": {}, "outs": {}}
        items = [("deps", dep) for dep in found.deps if not isinstance(dep, ParamsDependency)]
        if outs:
            items += [("outs", out) for out in found.outs]
        for kind, item in items:
            try:
                # What Output.save() does before recording a hash: a legacy (DVC 2) entry
                # whose data changed is hashed as plain md5 from then on.
                item.update_legacy_hash_name()
                hashed[kind][os.path.normpath(item.def_path)] = item.get_hash().value
            except FileNotFoundError:
                log.warning("%s %r does not exist: no md5 recorded for it", kind[:-1], item)
        return StageMd5s(hashed["deps"], hashed["outs"], _default_remote(repo))


def _default_remote(repo: Any) -> str | None:
    """The URL of the project's default DVC remote, without any user or password in it."""
    name = repo.config["core"].get("remote")
    url = repo.config["remote"].get(name, {}).get("url") if name else None
    if not url:
        return None
    parts = urlsplit(str(url))
    if parts.username is None and parts.password is None:
        return str(url)
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit(parts._replace(netloc=netloc))


def uses_base_model(stage: str) -> bool:
    """Whether a stage declares the base model among its params in dvc.yaml."""
    groups = stage_param_groups(stage)
    return any(group in {"model", "model.base", "model.revision"} for group in groups)


def base_model_revision(params: Params, md5s: Mapping[str, str]) -> str | None:
    """The version of the base model a stage loaded.

    A hub id: its pinned commit (an unpinned one is refused). A builtin GGUF base: the sha256
    of its GGUF file, which the base stage checked before converting it. builtin:tiny: the DVC
    md5 of ``paths.base_model`` among ``md5s`` (None in the base stage's own manifest, written
    inside that folder). A local folder: ``local``; it is not hashed here, as it can hold tens
    of GB and DVC does not track it.
    """
    revision = params.model.pinned_revision()
    if revision is not None:
        return revision
    if (pinned := params.model.pinned_gguf) is not None:
        return pinned.gguf_sha256
    if params.model.is_builtin:
        return md5s.get(params.paths.base_model.as_posix())
    return "local"


def manifest(stage: str, params: Params, inputs: dict[str, Path], **extra: Any) -> dict[str, Any]:
    """What made an artifact folder: code version, params, input data and base model versions.

    The inputs' md5s are hashed now (``stage_md5s``): the versions this run read.
    """
    stage = dvc_stage(stage, params)
    groups = stage_param_groups(stage)
    git = git_state()
    md5s = stage_md5s(stage, outs=False)
    deps = md5s.deps if md5s else {}
    record: dict[str, Any] = {
        "stage": stage,
        "created_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "tuneloop_version": __version__,
        "git_commit": git.commit,
        "git_dirty": git.dirty,
        "params_hash": params_hash(params, groups),
        "params": params_subset(params, groups),
        "inputs": {
            name: {"path": str(p), "md5": deps.get(p.as_posix())} for name, p in inputs.items()
        },
    }
    # Not in the base stage's own manifest for builtin:tiny: that folder is the model. A builtin
    # GGUF base's is there: the sha256 of the file it was converted from.
    if uses_base_model(stage) and (revision := base_model_revision(params, deps)) is not None:
        record["base_model"] = {"base": params.model.base, "revision": revision}
    return record | extra
