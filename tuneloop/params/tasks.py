"""Several tasks on one base: the ``tasks:`` group, and each task's view of the params.

A team that serves a support desk and product copy from one base gives each task its own
LoRA adapter, trained on that task's data, judged on that task's suites and released on its
own. In ``params.yaml``::

    tasks:
      support:
        registered_model: tuneloop-support
        suites: [support_demo]
      copy:
        registered_model: tuneloop-copy
        suites: [copy_demo]
        public_model: product-copy        # what clients ask the router for (default: copy)
        gate: {min_gain: 0.1}             # this task's gate, over the shared one
        train: {lora_r: 8}                # this task's training (its LoRA), over the shared one

Everything not listed under a task is shared: the base (``model``), ingest, the general
suites (forgetting is judged the same for every task), the release's routers.

``Params.for_task(name)`` is the whole params as that task's stages see them: its registered
model and suites, the shared groups with its overrides, and its own folders for everything a
task produces (``data/clean/<task>``, ``models/adapter/<task>``, ``metrics/<task>``, ...).
A project without ``tasks:`` is the one-task case: its one task, ``DEFAULT_TASK``, sees the
params exactly as written, so today's ``params.yaml`` loads and runs unchanged.

Incoming data reaches a task by folder (``<paths.incoming>/<task>/``, where the router of
several tasks writes each task's flags) or by a ``task`` field on the record; ingest
quarantines a record for a task that is not listed (``tuneloop.data.ingest``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, field_validator

from tuneloop.params.groups import GateParams, PathsParams, TrainParams, _Group

TASK_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,39}$")
# The one task of a project that lists none.
DEFAULT_TASK = "default"
# What each task produces in folders of its own; every other path is shared.
PER_TASK_PATHS = (
    "clean",
    "clean_cache",
    "packed",
    "pack_cache",
    "init",
    "adapter",
    "merged",
    "fp8",
    "metrics",
    "reports",
    "checkpoints",
    "watch",
)


class TaskParams(_Group):
    """One task on the shared base."""

    registered_model: str = Field(
        min_length=1, description="the task's model in the registry: its champion and challenger"
    )
    suites: tuple[str, ...] = Field(
        min_length=1, description="the task's business eval suites (eval/<name>/)"
    )
    public_model: str | None = Field(
        default=None, min_length=1, description="what clients ask the router for; null: the name"
    )
    gate: Mapping[str, Any] = Field(
        default_factory=dict, description="keys of `gate` this task sets otherwise"
    )
    train: Mapping[str, Any] = Field(
        default_factory=dict, description="keys of `train` (its LoRA) this task sets otherwise"
    )

    @field_validator("gate", "train")
    @classmethod
    def _plain(cls, value: Mapping[str, Any]) -> Mapping[str, Any]:
        return dict(value)


def check_tasks(tasks: Mapping[str, TaskParams], gate: GateParams, train: TrainParams) -> None:
    """Names usable in URLs and folders, no model or public name twice, overrides valid."""
    for name, task in tasks.items():
        if not TASK_NAME.match(name):
            raise ValueError(
                f"tasks: name {name!r} must match {TASK_NAME.pattern} (it names folders, DVC "
                "stages and the router's /tasks/<name>)"
            )
        for group, base, own in (("gate", gate, task.gate), ("train", train, task.train)):
            try:
                base.model_validate({**base.model_dump(), **own})
            except ValidationError as error:
                wrong = "; ".join(
                    f"{'.'.join(str(p) for p in item['loc'])}: {item['msg']}"
                    for item in error.errors()
                )
                raise ValueError(f"tasks.{name}.{group}: {wrong}") from None
    for what in ("registered_model", "public_model"):
        seen: dict[str, str] = {}
        for name, task in tasks.items():
            value = getattr(task, what) or (name if what == "public_model" else None)
            if value in seen:
                raise ValueError(
                    f"tasks {seen[value]} and {name} share {what} {value!r}: each task needs "
                    "its own"
                )
            if value is not None:
                seen[value] = name


def task_paths(paths: PathsParams, name: str) -> PathsParams:
    """``paths`` with each task's own folder, ``<path>/<task>``, where a task writes."""
    return paths.model_copy(update={key: getattr(paths, key) / name for key in PER_TASK_PATHS})


def fixed_badcases_path(paths: PathsParams, name: str) -> Path:
    """The task's fixed-badcase suite: a suite folder of its own, beside the others."""
    folder = paths.fixed_badcases
    return folder.with_name(f"{folder.name}_{name}")
