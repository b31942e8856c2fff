"""The demo on another model: a project checkout of its own, whose params.yaml is the project's
with a config file of overrides merged in.

``tuneloop demo --model tiny`` (the default) runs in the project itself, on ``params.yaml``.
Any other model has a config file of its own (``MODELS``), e.g. ``configs/demo-smollm2.yaml``:
overrides of ``params.yaml``, group by group, nothing special-cased in code. Its demo runs in
``demos/<model>/``, a git checkout of the project's committed code (``HEAD``), because every DVC
stage reads ``params.yaml`` from the project it runs in; there:

- ``params.yaml`` is the checkout's own with the config file merged in (key by key), committed
  in the checkout, so every run's lineage names a clean commit that holds exactly those params;
- the environment's folders (``paths.downloads``, ``serve.venv``) are the project's, as
  absolute paths: the pinned wheel is downloaded once and vLLM's environment built once;
- data, models, the MLflow store and DVC's cache are the checkout's own, apart from the
  tiny demo's.

A second run reuses the checkout: the project's ``HEAD`` is checked out again and the params
written again, so DVC reruns exactly the stages whose code or params changed, and the registry
and pool continue from the first run. ``rm -rf demos/<model>`` starts afresh.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tuneloop.io import read_yaml, write_text

log = logging.getLogger(__name__)

WORKSPACES = Path("demos")  # under the project; git-ignored


@dataclass(frozen=True)
class DemoModel:
    """A model the demo runs on: its overrides of ``params.yaml`` (None: the project's own
    params, in the project itself) and how many months it runs unless told."""

    config: Path | None
    months: int
    about: str


MODELS: dict[str, DemoModel] = {
    "tiny": DemoModel(None, 2, "the embedded tiny model, trained here in full (minutes a month)"),
    "tasks": DemoModel(
        Path("configs/demo-tasks.yaml"),
        2,
        "two tasks on the embedded model's one base, a LoRA adapter each: the support desk and "
        "an order intake answering in JSON",
    ),
    "smollm2": DemoModel(
        Path("configs/demo-smollm2.yaml"),
        1,
        "SmolLM2-135M-Instruct: LoRA, vLLM judging and serving it (about 26 min for the month "
        "on 2 quiet CPU cores)",
    ),
}
# Folders of the environment, not of the pipeline: shared with the project, as absolute paths.
SHARED_FOLDERS = (("paths", "downloads"), ("serve", "venv"))
# Groups whose keys are the project's own names (params.yaml's `tasks:`): a config's replaces
# params.yaml's whole, the tasks it lists are the project's.
OPEN_GROUPS = frozenset({"tasks"})
GIT = ["git", "-c", "user.name=tuneloop demo", "-c", "user.email=demo@tuneloop.invalid"]


class BadConfig(ValueError):
    """A demo config file that is not an override of params.yaml; the message names it."""


def merged(params: dict[str, Any], overrides: dict[str, Any], source: Path) -> dict[str, Any]:
    """``params`` with ``overrides`` merged in key by key (nested groups too); an override of a
    group or key ``params`` does not have is refused, naming it; a group of ``OPEN_GROUPS``
    is replaced whole."""

    def merge(base: dict[str, Any], extra: dict[str, Any], where: str) -> dict[str, Any]:
        out = dict(base)
        for key, value in extra.items():
            if not where and key in OPEN_GROUPS:
                out[key] = value
                continue
            if key not in base:
                raise BadConfig(
                    f"{source}: {where}{key} is not in params.yaml; the config file overrides "
                    "params.yaml's keys, it cannot add any"
                )
            if isinstance(value, dict) and isinstance(base.get(key), dict):
                out[key] = merge(base[key], value, f"{where}{key}.")
            else:
                out[key] = value
        return out

    return merge(params, overrides, "")


def _git(*args: str, cwd: Path) -> str:
    done = subprocess.run(
        [*GIT, *args], cwd=cwd, check=True, capture_output=True, text=True, encoding="utf-8"
    )
    return done.stdout.strip()


def prepare(repo: Path, name: str) -> Path:
    """``demos/<name>/``: the project's committed code with ``name``'s params; its path."""
    model = MODELS[name]
    if model.config is None:
        raise ValueError(f"the {name} demo runs in the project itself, on its params.yaml")
    repo = repo.resolve()
    config = repo / model.config
    overrides = read_yaml(config)
    if not isinstance(overrides, dict):
        raise BadConfig(f"{config}: not a mapping of params.yaml's groups")
    target = repo / WORKSPACES / name
    if not (target / ".git").is_dir():
        target.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            ["git", "clone", "--quiet", "--no-checkout", str(repo), str(target)], check=True
        )
    _git("fetch", "--quiet", str(repo), "HEAD", cwd=target)
    _git("checkout", "--quiet", "--force", "--detach", "FETCH_HEAD", cwd=target)
    commit = _git("rev-parse", "--short", "HEAD", cwd=target)
    if _git("status", "--porcelain", "--untracked-files=no", cwd=repo):
        log.warning(
            "%s has uncommitted changes; the %s demo runs its committed code (%s)",
            repo,
            name,
            commit,
        )
    params = merged(read_yaml(target / "params.yaml"), overrides, config)
    for group, key in SHARED_FOLDERS:
        folder = Path(params[group][key])
        params[group][key] = str(folder if folder.is_absolute() else repo / folder)
    header = (
        f"# params.yaml of {repo} ({commit}) with {model.config} merged in by "
        f"`tuneloop demo --model {name}`: edit that file, not this one.\n"
    )
    write_text(target / "params.yaml", header + yaml.safe_dump(params, sort_keys=False))
    # The release's overrides are read from the checkout, as the tiny demo's are.
    write_text(target / model.config, config.read_text(encoding="utf-8"))
    # Refused here, naming the key, rather than at the first stage.
    check = "from tuneloop.params import load_params; load_params()"
    found = subprocess.run(
        [sys.executable, "-c", check], cwd=target, capture_output=True, text=True, check=False
    )
    if found.returncode != 0:
        raise BadConfig(f"{config} merged into params.yaml is refused:\n{found.stderr.strip()}")
    _git("add", "params.yaml", str(model.config), cwd=target)
    if _git("status", "--porcelain", "--untracked-files=no", cwd=target):
        _git("commit", "--quiet", "-m", f"demo: params for {name} ({model.config})", cwd=target)
    log.info("%s demo in %s (%s)", name, target, _git("rev-parse", "--short", "HEAD", cwd=target))
    return target
