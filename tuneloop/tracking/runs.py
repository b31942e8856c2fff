"""MLflow wiring: one parent run per pipeline run, one child run per stage.

A stage resumes the child run its flow task created (``MLFLOW_RUN_ID``) or,
under a plain ``dvc repro``, starts its own. Either way the run carries the
lineage tags: git commit and dirty flag, params hash, the Prefect flow-run id
when there is one, and, once the stage has written its outs, the md5 of every
DVC dep and out (``dvc.dep.<path>``, ``dvc.out.<path>``, as ``tuneloop.tracking.lineage``
hashes them), the base model's revision, and its data deps as MLflow dataset
inputs (the Dataset column of the MLflow runs page).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tuneloop.params import Params
from tuneloop.tracking import lineage, rest

if TYPE_CHECKING:
    from mlflow.entities import DatasetInput, Run

# MLflow is imported where it is used, not here: importing it costs seconds, and the data
# stages log to a server without it (``log_stage_over_rest``).

log = logging.getLogger(__name__)

# Tag names, shared by every writer and reader of lineage.
TAG_STAGE = "tuneloop.stage"
TAG_COMMIT = "git.commit"
TAG_DIRTY = "git.dirty"
TAG_PARAMS_HASH = "params.hash"
TAG_FLOW_RUN = "prefect.flow_run_id"
TAG_CACHED = "dvc.cached"
TAG_PARENT = "mlflow.parentRunId"
TAG_PIPELINE = "tuneloop.pipeline"  # on a flow's own run: retrain, experiment
# Why the train stage stopped early: the stop-loss rule and its message.
TAG_STOP_RULE = "tuneloop.train.stop_rule"
TAG_STOP_REASON = "tuneloop.train.stop_reason"
# The base model's resolved version: hub commit, builtin model's md5, or "local".
TAG_BASE_REVISION = "base_model.revision"
TAG_EXP_NAME = "dvc.exp.name"
TAG_EXP_BASELINE = "dvc.exp.baseline"
# A run a killed flow left RUNNING, closed as KILLED at the pipeline's next start: why.
TAG_KILLED = "tuneloop.killed_reason"
# A stage run that continues another's work (train resuming a killed run's checkpoint).
TAG_RESUMES = "tuneloop.resumes_run"

# DVC sets these for the stages of a queued experiment (`dvc exp run --queue`), which run
# in a temporary copy of the repo; DVC_ROOT then names the repo the experiment came from.
EXP_NAME_ENV = "DVC_EXP_NAME"
EXP_BASELINE_ENV = "DVC_EXP_BASELINE_REV"
DVC_ROOT_ENV = "DVC_ROOT"
# {experiment name: MLflow run id}, from flows/experiment.py: each experiment's stage runs
# become children of its run, so a sweep reads as one tree in the MLflow UI.
EXPERIMENT_RUNS_ENV = "TUNELOOP_EXPERIMENT_RUNS"


# Read once: mlflow.set_tracking_uri() writes MLFLOW_TRACKING_URI into this
# process's environment, so reading it later would return our own last choice,
# not the user's.
_USER_TRACKING_URI = os.environ.get("MLFLOW_TRACKING_URI")


def project_root() -> Path:
    """The project whose MLflow store a run belongs in.

    DVC's repo root when DVC started this process (for a queued experiment, the repo it
    was queued from, not its temporary copy), else the working directory.
    """
    return Path(os.environ.get(DVC_ROOT_ENV) or Path.cwd())


def tracking_uri() -> str:
    """``MLFLOW_TRACKING_URI`` as the user set it (or ``use_tracking_uri`` did), else the
    project's own SQLite store."""
    return _USER_TRACKING_URI or f"sqlite:///{project_root() / 'mlflow.db'}"


@contextlib.contextmanager
def use_tracking_uri(uri: str) -> Iterator[str]:
    """This process (``tracking_uri()``, MLflow if imported) and the processes it starts
    (``MLFLOW_TRACKING_URI``) track to ``uri`` until the block ends."""
    global _USER_TRACKING_URI
    previous, previous_env = _USER_TRACKING_URI, os.environ.get("MLFLOW_TRACKING_URI")
    _USER_TRACKING_URI = uri
    os.environ["MLFLOW_TRACKING_URI"] = uri
    mlflow = sys.modules.get("mlflow")
    if mlflow is not None:
        mlflow.set_tracking_uri(uri)
    try:
        yield uri
    finally:
        _USER_TRACKING_URI = previous
        if previous_env is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = previous_env
        if (mlflow := sys.modules.get("mlflow")) is not None:
            mlflow.set_tracking_uri(tracking_uri())


def setup(experiment: str) -> str:
    """Point MLflow at the project's store and return the experiment id (created if needed)."""
    import mlflow
    from mlflow.tracking import MlflowClient

    mlflow.set_tracking_uri(tracking_uri())
    client = MlflowClient()
    found = client.get_experiment_by_name(experiment)
    if found is not None:
        experiment_id = found.experiment_id
    else:
        # Artifacts beside the database, not in whatever folder a process happened to start in.
        location = None
        if tracking_uri().startswith("sqlite:"):
            location = (project_root() / "mlartifacts").resolve().as_uri()
        experiment_id = client.create_experiment(experiment, artifact_location=location)
    mlflow.set_experiment(experiment_id=experiment_id)
    return experiment_id


def lineage_tags(stage: str, params: Params) -> dict[str, str]:
    git = lineage.git_state()
    tags = {
        TAG_STAGE: stage,
        TAG_COMMIT: git.commit,
        TAG_DIRTY: str(git.dirty).lower(),
        TAG_PARAMS_HASH: lineage.params_hash(params, lineage.stage_param_groups(stage)),
    }
    if flow_run := os.environ.get("TUNELOOP_FLOW_RUN_ID"):
        tags[TAG_FLOW_RUN] = flow_run
    if exp_name := os.environ.get(EXP_NAME_ENV):
        tags[TAG_EXP_NAME] = exp_name
        tags[TAG_EXP_BASELINE] = os.environ.get(EXP_BASELINE_ENV, "")
    return tags


def experiment_parent() -> dict[str, str]:
    """The parent-run tag for a stage of a DVC experiment that flows/experiment.py started."""
    runs = json.loads(os.environ.get(EXPERIMENT_RUNS_ENV) or "{}")
    parent = runs.get(os.environ.get(EXP_NAME_ENV, ""))
    return {TAG_PARENT: parent} if parent else {}


def dvc_tags(md5s: lineage.StageMd5s) -> dict[str, str]:
    """``dvc.dep.<path>`` / ``dvc.out.<path>`` md5 tags."""
    return {f"dvc.dep.{path}": md5 for path, md5 in md5s.deps.items()} | {
        f"dvc.out.{path}": md5 for path, md5 in md5s.outs.items()
    }


# The source type of a DVC-tracked dataset input; MLflow has no source for DVC paths.
DVC_SOURCE_TYPE = "dvc"


# MLflow's tag naming a dataset input's role (mlflow.utils.mlflow_tags.MLFLOW_DATASET_CONTEXT).
DATASET_CONTEXT = "mlflow.data.context"


def dataset_records(stage: str, md5s: lineage.StageMd5s) -> list[dict[str, Any]]:
    """The stage's data deps as MLflow dataset inputs (REST form): name = DVC path, digest =
    DVC md5.

    The source names the DVC path and the DVC remote that holds that version, so a reader
    can fetch it (``dvc get``/``dvc pull`` at the run's git commit); the data is not read.
    """
    found = []
    for path, md5 in md5s.data_deps().items():
        source = {"path": path} | ({"remote": md5s.remote} if md5s.remote else {})
        dataset = {
            "name": path,
            "digest": md5,
            "source_type": DVC_SOURCE_TYPE,
            "source": json.dumps(source),
        }
        found.append({"dataset": dataset, "tags": [{"key": DATASET_CONTEXT, "value": stage}]})
    return found


def dataset_inputs(stage: str, md5s: lineage.StageMd5s) -> list[DatasetInput]:
    """``dataset_records`` as MLflow's entities."""
    from mlflow.entities import Dataset, DatasetInput, InputTag

    return [
        DatasetInput(
            Dataset(**record["dataset"]),
            tags=[InputTag(t["key"], t["value"]) for t in record["tags"]],
        )
        for record in dataset_records(stage, md5s)
    ]


def lineage_record(
    stage: str, params: Params, root: Path = Path()
) -> tuple[dict[str, str], lineage.StageMd5s | None]:
    """A stage's data versions, hashed now: DVC md5 tags and base model revision; the md5s."""
    md5s = lineage.stage_md5s(stage, root)
    tags = dvc_tags(md5s) if md5s else {}
    if lineage.uses_base_model(stage):
        revision = lineage.base_model_revision(params, {**md5s.deps, **md5s.outs} if md5s else {})
        if revision is not None:
            tags[TAG_BASE_REVISION] = revision
    return tags, md5s


def record_lineage(stage: str, params: Params, run_id: str, root: Path = Path()) -> None:
    """Put a stage's data versions on its run: DVC md5 tags, base model revision, datasets.

    Called once the stage's outs are written (the end of ``stage_run``, or by the flow for a
    stage DVC found up to date), so the md5s are the ones DVC records for this run.
    """
    from mlflow.entities import RunTag
    from mlflow.tracking import MlflowClient

    tags, md5s = lineage_record(stage, params, root)
    client = MlflowClient()
    batch = [RunTag(key, value) for key, value in tags.items()]
    for start in range(0, len(batch), 100):  # MLflow's limit of tags per batch
        client.log_batch(run_id, tags=batch[start : start + 100])
    if md5s and (inputs := dataset_inputs(stage, md5s)):
        client.log_inputs(run_id, datasets=inputs)


def flat_params(params: Params, stage: str) -> dict[str, str]:
    """The stage's param groups as ``group.key`` MLflow params."""

    def walk(prefix: str, node: Any) -> Iterator[tuple[str, str]]:
        if isinstance(node, Mapping):
            for key, value in node.items():
                yield from walk(f"{prefix}.{key}", value)
        else:
            yield prefix, str(node)[:500]

    subset = lineage.params_subset(params, lineage.stage_param_groups(stage))
    return dict(item for group, node in subset.items() for item in walk(group, node))


@contextlib.contextmanager
def stage_run(stage: str, params: Params) -> Iterator[Run]:
    """The MLflow run a stage logs into, with its lineage tags and params."""
    import mlflow

    stage = lineage.dvc_stage(stage, params)
    experiment_id = setup(params.tracking.experiment)
    # A flow task created this child run; resume it. Drop the variable once
    # used, or the transformers MLflow callback would try to start it again.
    run_id = os.environ.pop("MLFLOW_RUN_ID", None)
    # Inside an active run (a notebook, a flow in-process), the stage is its child.
    nested = mlflow.active_run() is not None
    tags = experiment_parent() if run_id is None and not nested else {}
    with mlflow.start_run(
        run_id=run_id, run_name=stage, experiment_id=experiment_id, nested=nested, tags=tags
    ) as run:
        mlflow.set_tags(lineage_tags(stage, params))
        mlflow.log_params(flat_params(params, stage))
        yield run
        # Only now are the outs written; a stage that failed records no data versions.
        record_lineage(stage, params, run.info.run_id)


def flat_metrics(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """Every number of a nested dict as ``a.b.c``, named as MLflow allows."""
    flat: dict[str, float] = {}

    def walk(path: str, node: Any) -> None:
        if isinstance(node, Mapping):
            for key, value in node.items():
                walk(f"{path}.{key}" if path else str(key), value)
        elif isinstance(node, bool | int | float):
            flat[path] = float(node)

    walk(prefix, metrics)
    # MLflow allows only [A-Za-z0-9_\-. :/] in names; keep the rest readable.
    return {re.sub(r"[^\w\-. :/]", "_", key): value for key, value in flat.items()}


def log_metrics(metrics: Mapping[str, Any], prefix: str = "", run_id: str | None = None) -> None:
    """Log every number of a nested dict as ``a.b.c``, to ``run_id`` or else the active run."""
    import mlflow
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    flat = flat_metrics(metrics, prefix)
    if flat and run_id is not None:
        now = int(time.time() * 1000)
        batch = [Metric(key, value, now, 0) for key, value in flat.items()]
        client = MlflowClient()
        for start in range(0, len(batch), 1000):  # MLflow's limit per batch
            client.log_batch(run_id, metrics=batch[start : start + 1000])
    elif flat:
        mlflow.log_metrics(flat)


def log_stage_over_rest(
    stage: str,
    params: Params,
    *,
    metrics: list[Mapping[str, Any]],
    dicts: Mapping[str, Any],
    texts: Mapping[str, str],
    tags: Mapping[str, str],
    failed: bool,
) -> str:
    """A finished stage's whole run, logged to the MLflow server at ``tracking_uri()`` through
    its REST API (``tuneloop.tracking.rest``), without importing MLflow; the run id.

    The same run ``stage_run`` makes: the flow task's run (``MLFLOW_RUN_ID``) resumed, or a
    new one (a child of its DVC experiment's run); lineage tags, params, metrics, artifacts
    and, when the stage did not fail, its data versions.
    """
    client = rest.Client(tracking_uri())
    experiment_id = client.experiment_id(params.tracking.experiment)
    run_id = os.environ.pop("MLFLOW_RUN_ID", None)
    system = {
        "mlflow.source.name": f"stages.{stage}",
        "mlflow.source.type": "LOCAL",
        "mlflow.user": os.environ.get("USER", ""),
    }
    if run_id is None:
        info = client.create_run(experiment_id, stage, system | experiment_parent())
        run_id = str(info["run_id"])
    else:
        info = client.get_run(run_id)["info"]
        client.set_status(run_id, "RUNNING")
    try:
        flat: dict[str, float] = {}
        for entry in metrics:
            flat |= flat_metrics(entry)
        every_tag = lineage_tags(stage, params) | dict(tags)
        md5s = None
        if not failed:  # a stage that failed records no data versions
            found, md5s = lineage_record(stage, params)
            every_tag |= found
        client.log_batch(run_id, metrics=flat, params=flat_params(params, stage), tags=every_tag)
        if md5s and (inputs := dataset_records(stage, md5s)):
            client.log_inputs(run_id, inputs)
        for name, data in dicts.items():
            text = json.dumps(data, indent=2, ensure_ascii=False, default=str)
            client.log_artifact(str(info["artifact_uri"]), name, text.encode())
        for name, text in texts.items():
            client.log_artifact(str(info["artifact_uri"]), name, text.encode())
    except BaseException:
        client.set_status(run_id, "FAILED")
        raise
    client.set_status(run_id, "FAILED" if failed else "FINISHED")
    return run_id
