"""Typed, frozen view of ``params.yaml``: the one source of every knob.

``load_params()`` reads the file once and validates it into the models of ``groups`` (the
pipeline's) and ``operations`` (the release's, serving's, the watchdog's, the schedule's).
Unknown keys are an error (a typo must not silently fall back to a default),
and a wrong value fails here, naming its key, before any stage does work.
Values derived from others (LoRA alpha, gradient accumulation) are computed
here and nowhere else.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import PrivateAttr, ValidationError, field_validator, model_validator

from tuneloop.io import read_yaml
from tuneloop.params.groups import (
    BUILTIN_BASES,
    PARAMS_FILE,
    TRAIN_PHASE_ORDER,
    BatchParams,
    BlindReviewParams,
    CleanParams,
    DemoParams,
    EvaluateParams,
    ExportParams,
    GateParams,
    IngestParams,
    MergeParams,
    ModelParams,
    PackParams,
    ParamsError,
    PathsParams,
    PinnedGguf,
    PreflightParams,
    TinyModel,
    TrackingParams,
    TrainParams,
    _Group,
)
from tuneloop.params.operations import (
    VLLM_LORA_RANKS,
    ClusterParams,
    FastFailParams,
    LoadTestParams,
    PoolParams,
    QueueParams,
    ReleaseParams,
    ScheduleParams,
    ServeParams,
    ShadowParams,
    WatchdogParams,
)
from tuneloop.params.tasks import (
    PER_TASK_PATHS,
    REPLACED_KEYS,
    TASKS_SHAPE,
    TaskParams,
    check_tasks,
    task_paths,
)

__all__ = [
    "BUILTIN_BASES",
    "PARAMS_FILE",
    "PER_TASK_PATHS",
    "TRAIN_PHASE_ORDER",
    "VLLM_LORA_RANKS",
    "BatchParams",
    "BlindReviewParams",
    "CleanParams",
    "ClusterParams",
    "DemoParams",
    "EvaluateParams",
    "ExportParams",
    "FastFailParams",
    "GateParams",
    "IngestParams",
    "LoadTestParams",
    "MergeParams",
    "ModelParams",
    "PackParams",
    "Params",
    "ParamsError",
    "PathsParams",
    "PinnedGguf",
    "PoolParams",
    "PreflightParams",
    "QueueParams",
    "ReleaseParams",
    "ScheduleParams",
    "ServeParams",
    "ShadowParams",
    "TaskParams",
    "TinyModel",
    "TrackingParams",
    "TrainParams",
    "WatchdogParams",
    "load_params",
    "parse_params",
    "with_overrides",
]


class Params(_Group):
    """Every group of ``params.yaml``: the project's own view, which the shared stages (base,
    task_names, ingest), the flows and the CLI read. Each task's stages see
    ``for_task(name)``."""

    model: ModelParams
    paths: PathsParams
    demo: DemoParams
    ingest: IngestParams
    clean: CleanParams
    batch: BatchParams
    pack: PackParams
    preflight: PreflightParams
    train: TrainParams
    merge: MergeParams
    export: ExportParams
    evaluate: EvaluateParams
    gate: GateParams
    tracking: TrackingParams
    release: ReleaseParams
    serve: ServeParams
    watchdog: WatchdogParams
    cluster: ClusterParams
    schedule: ScheduleParams
    # Required, at least one: dvc.yaml declares each stage once, for each task listed
    # (``_describe`` shows how to write it).
    tasks: dict[str, TaskParams]
    # The task whose view this is (``for_task``); None: the project's own params.
    _task: str | None = PrivateAttr(default=None)
    # The project's own paths, for a task's view (``project_path``).
    _project_paths: PathsParams | None = PrivateAttr(default=None)

    @field_validator("tasks", mode="before")
    @classmethod
    def _tasks_shape(cls, value: Any) -> Any:
        if not value:
            raise ValueError(f"no tasks: {TASKS_SHAPE}")
        return value

    @model_validator(mode="after")
    def _tasks_apart(self) -> Params:
        check_tasks(
            self.tasks,
            self.gate,
            self.train,
            self.tracking.registered_model,
            self.evaluate.suites,
        )
        return self

    @model_validator(mode="after")
    def _cluster_holds_the_ranks(self) -> Params:
        if self.train.launcher == "local":
            return self
        cluster, world_size = self.cluster, self.batch.world_size
        if cluster.nodes * cluster.gpus_per_node != world_size:
            raise ValueError(
                f"cluster.nodes x cluster.gpus_per_node is {cluster.nodes} x "
                f"{cluster.gpus_per_node} = {cluster.nodes * cluster.gpus_per_node}, but "
                f"batch.world_size (the shards pack wrote) is {world_size}: make them agree"
            )
        if self.train.distributed == "none":
            raise ValueError(
                f"train.launcher {self.train.launcher!r} starts ranks under torchrun: set "
                "train.distributed (ddp, zero2, zero3, fsdp), or train.launcher: local"
            )
        if self.train.launcher == "kubernetes" and cluster.image is None:
            raise ValueError(
                "train.launcher 'kubernetes' runs the ranks in a container: set cluster.image to "
                "the image built from the project's Dockerfile"
            )
        return self

    @model_validator(mode="after")
    def _fp8_rules_have_their_export(self) -> Params:
        """A rule on the FP8 export, the project's or a task's own, needs that export."""
        if "fp8" in self.export.formats:
            return self
        rules = {"gate.fp8_max_drop": self.gate.fp8_max_drop} | {
            f"tasks.{name}.gate.fp8_max_drop": task.gate["fp8_max_drop"]
            for name, task in self.tasks.items()
            if "fp8_max_drop" in task.gate
        }
        for key, drop in rules.items():
            if drop is not None:
                raise ValueError(
                    f"{key} is {drop}, a rule on the FP8 export, but export.formats "
                    f"{list(self.export.formats)} makes none: add fp8 to export.formats, or "
                    f"set {key}: null"
                )
        return self

    @property
    def task(self) -> str | None:
        """The task this view is of (``for_task``), None for the project's own params."""
        return self._task

    @property
    def several_tasks(self) -> bool:
        """More than one task: the router serves each at /tasks/<task>, the CLI and the
        release must be told which."""
        return len(self.tasks) > 1

    def project_path(self, key: str) -> Path:
        """``paths.<key>`` of the project, not of this task's view: where a shared stage
        (ingest, base) writes, e.g. ``metrics`` (ingest.json), not ``tasks/<task>/metrics``."""
        paths = self._project_paths or self.paths
        result: Path = getattr(paths, key)
        return result

    def task_names(self) -> tuple[str, ...]:
        """The tasks on the base, in the file's order."""
        return tuple(self.tasks)

    def the_task(self, name: str | None = None, said: str = "give --task") -> Params:
        """Task ``name``'s view; without a name, the one task of a project of one task (a
        project of several must name it: ``said`` says how)."""
        if name is None:
            if self.several_tasks:
                raise ParamsError(f"params.yaml lists tasks {list(self.tasks)}: {said}")
            name = next(iter(self.tasks))
        return self.for_task(name)

    def for_task(self, name: str) -> Params:
        """The params as task ``name``'s stages see them: its model, suites, overrides and
        folder."""
        if name not in self.tasks:
            raise ParamsError(
                f"no task {name!r} in params.yaml; its tasks: {list(self.task_names())}"
            )
        if self._task == name:
            return self
        if self._task is not None:
            raise ParamsError(f"already the view of task {self._task}, not of the project")
        task = self.tasks[name]
        paths = task_paths(self.paths, task.folder, name, self.several_tasks)
        routers = self.release.routers
        if self.several_tasks:
            # The router of several tasks serves each one's own router at /tasks/<task>
            # (serving.tasks): a release, a rollback, a status reach that task alone.
            routers = tuple(f"{u.rstrip('/')}/tasks/{name}" for u in routers)
        view = self.model_copy(
            update={
                "paths": paths,
                "tracking": self.tracking.model_copy(
                    update={
                        "registered_model": task.registered_model or self.tracking.registered_model
                    }
                ),
                "evaluate": self.evaluate.model_copy(
                    update={"suites": task.suites or self.evaluate.suites}
                ),
                "gate": GateParams.model_validate({**self.gate.model_dump(), **task.gate}),
                "train": TrainParams.model_validate({**self.train.model_dump(), **task.train}),
                "release": self.release.model_copy(update={"routers": routers}),
            }
        )
        view._task = name
        view._project_paths = self.paths
        return view

    def public_model(self, name: str) -> str:
        """What clients ask the router for to reach task ``name``."""
        task = self.tasks.get(name)
        return (task.public_model if task else None) or name


def _describe(error: ValidationError, source: Path) -> str:
    lines = [f"{source}: {error.error_count()} invalid value(s):"]
    for item in error.errors():
        key = ".".join(str(part) for part in item["loc"])
        if item["type"] == "extra_forbidden" and key in REPLACED_KEYS:
            lines.append(f"  {key}: no longer a key; {REPLACED_KEYS[key]}")
        elif item["type"] == "extra_forbidden":
            lines.append(f"  {key}: unknown key (a typo? remove it or fix its spelling)")
        elif item["type"] == "missing":
            hint = f" ({TASKS_SHAPE})" if key == "tasks" else ""
            lines.append(f"  {key}: required key is missing{hint}")
        elif not key:  # the whole file's rule (tasks apart, the cluster's ranks)
            lines.append(f"  {item['msg'].removeprefix('Value error, ')}")
        else:
            lines.append(f"  {key}: {item['msg']} (got {item.get('input')!r})")
    return "\n".join(lines)


def parse_params(data: object, source: Path = PARAMS_FILE) -> Params:
    try:
        return Params.model_validate(data)
    except ValidationError as error:
        raise ParamsError(_describe(error, source)) from None


def load_params(
    path: Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    task: str | None = None,
) -> Params:
    """Read and validate params.yaml (the project's own unless ``path`` is given).

    For a run that says how it differs (the release flow's parameters): ``overrides`` merged
    in (``with_overrides``), then task ``task``'s view (``Params.for_task``).
    """
    source = path or PARAMS_FILE
    try:
        data = read_yaml(source)
    except FileNotFoundError:
        raise ParamsError(f"{source} not found") from None
    except yaml.YAMLError as error:
        raise ParamsError(f"{source} is not valid YAML: {error}") from None
    params = parse_params(data, source)
    if overrides:
        params = with_overrides(params, overrides, f"overrides of {source}")
    if task is None:
        return params
    return params.for_task(task)


def with_overrides(params: Params, overrides: Mapping[str, Any], source: str) -> Params:
    """``params`` with ``overrides`` (``{group: {key: value}}``, nested) merged in, validated
    again like params.yaml (an unknown key or a wrong value names itself and ``source``).

    For a run that must differ from params.yaml in a few knobs and say so (the demo's short
    release intervals): the overrides are the flow's own parameters, shown in its run.
    """

    def merge(base: Any, extra: Any) -> Any:
        if isinstance(base, dict) and isinstance(extra, Mapping):
            return {**base, **{k: merge(base.get(k), v) for k, v in extra.items()}}
        return extra

    data = merge(params.model_dump(mode="json"), overrides)
    return parse_params(data, Path(source))
