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
from pydantic import ValidationError

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

__all__ = [
    "BUILTIN_BASES",
    "PARAMS_FILE",
    "TRAIN_PHASE_ORDER",
    "VLLM_LORA_RANKS",
    "BatchParams",
    "BlindReviewParams",
    "CleanParams",
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
    "TinyModel",
    "TrackingParams",
    "TrainParams",
    "WatchdogParams",
    "load_params",
    "parse_params",
    "with_overrides",
]


class Params(_Group):
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
    schedule: ScheduleParams


def _describe(error: ValidationError, source: Path) -> str:
    lines = [f"{source}: {error.error_count()} invalid value(s):"]
    for item in error.errors():
        key = ".".join(str(part) for part in item["loc"])
        if item["type"] == "extra_forbidden":
            lines.append(f"  {key}: unknown key (a typo? remove it or fix its spelling)")
        elif item["type"] == "missing":
            lines.append(f"  {key}: required key is missing")
        else:
            lines.append(f"  {key}: {item['msg']} (got {item.get('input')!r})")
    return "\n".join(lines)


def parse_params(data: object, source: Path = PARAMS_FILE) -> Params:
    try:
        return Params.model_validate(data)
    except ValidationError as error:
        raise ParamsError(_describe(error, source)) from None


def load_params(path: Path | None = None) -> Params:
    """Read and validate params.yaml (the project's own unless ``path`` is given)."""
    source = path or PARAMS_FILE
    try:
        data = read_yaml(source)
    except FileNotFoundError:
        raise ParamsError(f"{source} not found") from None
    except yaml.YAMLError as error:
        raise ParamsError(f"{source} is not valid YAML: {error}") from None
    return parse_params(data, source)


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
