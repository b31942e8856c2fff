"""The ``tasks:`` group: the business tasks on the one base, and each task's view of the params.

A *task* here is a business task with its own adapter (the glossary's word; never a Prefect
task or an lm-eval task, which the code calls flow steps and suites). Every project lists
its tasks; a project of one task lists one, in the project's root::

    tasks:
      support: {folder: .}

A team that serves a support desk and order intake from one base gives each task its own
LoRA adapter, trained on that task's data, judged on that task's suites and released on its
own::

    tasks:
      support:
        folder: tasks/support             # what the task writes lies under it
        registered_model: tuneloop-support
        suites: [support_demo]
      orders:
        folder: tasks/orders
        registered_model: tuneloop-orders
        suites: [orders_demo]
        public_model: order-intake        # what clients ask the router for (default: orders)
        gate: {min_gain: 0.1}             # this task's gate, over the shared one
        train: {lora_r: 8}                # this task's training (its LoRA), over the shared one

Everything not set under a task is shared: the base (``model``), ingest, the registered
model and suites of a project of one task (``tracking.registered_model``,
``evaluate.suites``), the general suites (forgetting is judged the same for every task),
the release's routers. A task with ``records: all`` trains on every task's records, one
adapter for all of them, and is judged beside each task's own on that task's suites
(``tuneloop.judge.tasks_report``).

``Params.for_task(name)`` is the whole params as that task's stages see them: its registered
model and suites, the shared groups with its overrides, and its folder for everything a task
produces (``<folder>/data/clean``, ``<folder>/models/adapter``, ...). dvc.yaml declares each
stage once, as a ``foreach`` over this group (``clean@support``), run with ``--task``
(``tuneloop.stage.stage_params``).

Incoming data reaches a task by folder (``<paths.incoming>/<task>/``, where the router of
several tasks writes each task's flags), by a ``task`` field on the record, or, in a project
of one task, by being there; ingest quarantines a record for a task that is not listed and
pools each task's records in ``<pool>/records/<task>/`` (``tuneloop.data.ingest``), the
folder its stages depend on.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator

from tuneloop.params.groups import GateParams, PathsParams, TrainParams, _Group

TASK_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,39}$")
# What an error about the group shows: dvc.yaml generates each task's stages from it.
TASKS_SHAPE = (
    "list each task with its folder: `tasks: {support: {folder: .}}` for a project of one task "
    "(its files where they were), or e.g. `tasks: {support: {folder: tasks/support, "
    "registered_model: tuneloop-support, suites: [support_demo]}, orders: {folder: "
    "tasks/orders, registered_model: tuneloop-orders, suites: [orders_demo]}}`"
)
# Keys of older params files, and what replaced them.
REPLACED_KEYS = {
    "paths.task_folders": "each task names its own folder: tasks.<task>.folder",
    "schedule.task_models": "one adapter on every task's data is a task of its own, with "
    "`records: all` (e.g. tasks: {all: {folder: tasks/all, registered_model: tuneloop-all, "
    "records: all}})",
}
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
    "nvfp4",
    "nvfp4a16",
    "metrics",
    "reports",
    "checkpoints",
    "watch",
    "fixed_badcases",
)


class TaskParams(_Group):
    """One task on the shared base."""

    folder: Path = Field(
        description="where the task's data, models, metrics and reports lie (`.`: the "
        "project's root, for a project of one task): <folder>/data/clean, <folder>/models/..."
    )
    registered_model: str | None = Field(
        default=None,
        min_length=1,
        description="the task's model in the registry, its champion and challenger; null: "
        "tracking.registered_model (a project of one task)",
    )
    suites: tuple[str, ...] | None = Field(
        default=None,
        min_length=1,
        description="the task's business eval suites (eval/<name>/); null: evaluate.suites",
    )
    records: Literal["own", "all"] = Field(
        default="own",
        description="what the task trains on: its own records, or all: every task's (one "
        "adapter for all, judged beside each task's own on that task's suites)",
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

    @field_validator("folder")
    @classmethod
    def _inside(cls, value: Path) -> Path:
        if value.is_absolute() or ".." in value.parts:
            raise ValueError(
                f"{value} must be a folder inside the project (DVC tracks it): e.g. tasks/support"
            )
        return value


def check_tasks(
    tasks: Mapping[str, TaskParams],
    gate: GateParams,
    train: TrainParams,
    registered_model: str,
    suites: tuple[str, ...],
) -> None:
    """Names usable in URLs and folders; no folder, model or public name twice; overrides
    valid; a task on every task's records judged on their suites. (At least one task:
    ``Params._tasks_shape``.)"""
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
    for what, default in (
        ("folder", None),
        ("registered_model", registered_model),
        ("public_model", None),
    ):
        seen: dict[Any, str] = {}
        for name, task in tasks.items():
            value = getattr(task, what) or default or name
            if value in seen:
                raise ValueError(
                    f"tasks {seen[value]} and {name} share {what} {str(value)!r}: each task "
                    f"needs its own (tasks.<task>.{what})"
                )
            seen[value] = name
    for name, task in tasks.items():
        if task.records != "all":
            continue
        judged = set(task.suites or suites)
        missing = sorted({s for other in tasks.values() for s in (other.suites or suites)} - judged)
        if missing:
            raise ValueError(
                f"task {name} trains on every task's records and is judged beside each task's "
                f"adapter on that task's suites; its suites lack {missing}: add them"
            )


def task_paths(paths: PathsParams, folder: Path, name: str, several: bool) -> PathsParams:
    """``paths`` as a task writes them: each of ``PER_TASK_PATHS`` under the task's
    ``folder`` (an absolute path, with several tasks: ``<path>/<task>``)."""
    update = {}
    for key in PER_TASK_PATHS:
        path: Path = getattr(paths, key)
        if path.is_absolute():
            update[key] = path / name if several else path
        else:
            update[key] = folder / path
    return paths.model_copy(update=update)
