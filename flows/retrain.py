"""The retrain flow: every DVC stage in order, each one logged to MLflow with its lineage.

Flows orchestrate, stages compute: a task runs ``dvc repro --single-item
<stage>`` in a subprocess with the repo as its working directory (DVC's cache
and lock stay the truth, and DVC's reproduce API breaks when the working
directory differs and is not thread-safe), then records what DVC did on the
stage's MLflow child run. The stages and their order are dvc.yaml's
(``tuneloop.pipeline``). A stage that runs records its own lineage; a stage DVC
finds up to date is not rerun: its metrics are logged from its metrics file,
its lineage is recorded here by the same function, and its run is tagged
``dvc.cached``. ``champions``, which DVC runs every time and which logs no run of
its own (a registry lookup), is recorded the same way, tagged ``dvc.cached=false``.

Runs without a Prefect server (a temporary local one starts) and against one
when ``PREFECT_API_URL`` is set.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import mlflow
from mlflow.tracking import MlflowClient
from prefect import flow, get_run_logger, task
from prefect.events import emit_event
from prefect.runtime import flow_run

from tuneloop.data.metrics import CleanMetrics, IngestMetrics
from tuneloop.data.records import pool_batches
from tuneloop.io import read_json, read_model, write_text
from tuneloop.judge import tasks_report
from tuneloop.judge.decision import Decision, read_scores
from tuneloop.judge.gate import GateError
from tuneloop.orchestration import forkserver
from tuneloop.orchestration.dvcrun import DvcLockTimeout, run_dvc
from tuneloop.orchestration.flow_results import (
    DataCounts,
    PipelineRun,
    ResultsCommit,
    TaskFailed,
    TaskOutcome,
    TasksRun,
    TaskUnchanged,
    TrainSummary,
)
from tuneloop.params import Params, ParamsError, load_params
from tuneloop.pipeline import SHARED_STAGES, always_changed, task_stages
from tuneloop.telemetry.actions import TAG_REASON as TAG_WATCHDOG_REASON
from tuneloop.tracking import lineage, recovery, registry, results, runs, server
from tuneloop.tracking.init_from import InitMetrics
from tuneloop.training.metrics import TrainMetrics

# Every other stage is safe to run again after a failure: outputs are replaced atomically,
# ingest deduplicates. Preflight and training are not retried: a refusal or a stop-loss
# needs a person, not a rerun, and a second training attempt costs as much as the first.
NOT_RETRIED = frozenset({"preflight", "train"})


# Emitted when the gate passed and a challenger was registered; starts the release deployment.
EVENT_REGISTERED = "tuneloop.challenger.registered"


# The lineage tags (key prefixes) a pipeline run collects from its stage runs.
LINEAGE_TAGS = ("dvc.dep.", "dvc.out.", runs.TAG_BASE_REVISION)


class StageFailed(RuntimeError):
    pass


class TasksFailed(RuntimeError):
    """A retrain in which a task failed: the other tasks ran, the report was written and the
    month's results committed; raised so that the flow run ends Failed. ``result``: the
    month's, every task's outcome."""

    def __init__(self, result: TasksRun) -> None:
        said = [
            f"task {task}: {outcome.error}"
            for task, outcome in result.tasks.items()
            if isinstance(outcome, TaskFailed)
        ]
        super().__init__(
            f"{len(said)} of {len(result.tasks)} task(s) failed: {'; '.join(said)} "
            f"(every task's outcome: {result.report})"
        )
        self.result = result

    def __reduce__(self) -> tuple[type[TasksFailed], tuple[TasksRun]]:
        # Prefect may pickle a failed flow run's exception: rebuilt from its result.
        return (type(self), (self.result,))


def failure_reason(tags: dict[str, str]) -> str | None:
    """What a failed stage's run says ended it: the watchdog or a stop-loss rule."""
    for key in (TAG_WATCHDOG_REASON, runs.TAG_STOP_REASON):
        if tags.get(key):
            return f"{key}: {tags[key]}"
    return None


@task(task_run_name="{stage}", retries=0)
def run_stage(
    stage: str, repo: Path, params: Params, parent_run_id: str, experiment_id: str
) -> dict[str, Any]:
    """Run one DVC stage (or find it up to date) inside its own MLflow child run."""
    logger = get_run_logger()
    client = MlflowClient()
    run = client.create_run(
        experiment_id,
        run_name=stage,
        tags={runs.TAG_PARENT: parent_run_id, runs.TAG_STAGE: stage},
    )
    env = os.environ | {
        # dvc.yaml's `python -m stages.x` must find this environment's python.
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "MLFLOW_RUN_ID": run.info.run_id,
        "MLFLOW_TRACKING_URI": runs.tracking_uri(),
        "TUNELOOP_FLOW_RUN_ID": str(flow_run.id or ""),
    }
    logger.info("dvc repro --single-item %s", stage)
    wait_s = params.schedule.dvc_lock_wait_s
    try:
        # Output is copied to this terminal as it comes, so training progress shows live.
        result = run_dvc(["repro", "--single-item", stage], repo, env, wait_s)
    except DvcLockTimeout:
        client.set_terminated(run.info.run_id, status="FAILED")
        raise
    run_id = run.info.run_id
    # A stage that ran logs its metrics to this run; one that did not log is up to date, or
    # (always changed: a registry lookup) found nothing worth a run of its own.
    unlogged = result.returncode == 0 and not client.get_run(run_id).data.metrics
    cached = unlogged and stage.partition("@")[0] not in always_changed(repo)
    tags = {runs.TAG_CACHED: str(cached).lower(), runs.TAG_FLOW_RUN: str(flow_run.id)}
    if unlogged:
        # Nothing recorded the stage's lineage: DVC found its deps and outs unchanged, or the
        # stage logged none; they are hashed (from DVC's state) as the stage would have.
        tags |= runs.lineage_tags(stage, params)
        runs.record_lineage(stage, params, run_id, root=repo)
    for key, value in tags.items():
        client.set_tag(run_id, key, value)
    # A task's stage (clean@orders) writes clean.json into the task's metrics folder.
    metrics_file = repo / params.paths.metrics / f"{lineage.project_stage(stage)}.json"
    metrics = read_json(metrics_file) if metrics_file.exists() else {}
    if unlogged and metrics:
        runs.log_metrics(metrics, run_id=run_id)
    if result.returncode != 0:
        why = failure_reason(client.get_run(run_id).data.tags)
        client.set_terminated(run_id, status="FAILED")
        said = f"stage {stage!r} failed (dvc repro exit {result.returncode})"
        raise StageFailed(f"{said}: {why}" if why else said)
    if unlogged:
        client.set_terminated(run_id, status="FINISHED")
    logger.info("%s: %s", stage, "up to date" if cached else "ran")
    return metrics


def announce_challenger(name: str, version: str, payload: dict[str, Any]) -> None:
    """Emit the event that starts the release deployment (prefect.yaml's trigger)."""
    emit_event(
        event=EVENT_REGISTERED,
        resource={
            "prefect.resource.id": f"tuneloop.model.{name}.{version}",
            "prefect.resource.name": f"{name} v{version}",
        },
        payload=payload,
    )


@task(task_run_name="register", retries=1)
def register(params: Params, run_id: str) -> registry.Registration:
    """Register the candidate (alias challenger) if the evaluate gate passed; else say why not.

    Here rather than in the DVC stage: the registry is a side effect `dvc repro`
    must not repeat or skip (see tuneloop/tracking/registry.py). Idempotent, so it may retry.
    """
    done = registry.register_candidate(params, run_id=run_id, flow_run_id=str(flow_run.id or ""))
    reasons = "\n".join(done.reasons)
    if done.created:
        get_run_logger().info("%s v%s (%s):\n%s", done.name, done.version, done.alias, reasons)
        # The task names the release (prefect.yaml's trigger passes it on): the task's view
        # names it in a project of one task too.
        payload = done.model_dump() | {"task": params.task or ""}
        announce_challenger(done.name, str(done.version), payload)
    elif done.registered:  # announced when it was made: one release per registration
        get_run_logger().info("%s; no new release event:\n%s", done.reasons[0], reasons)
    else:
        get_run_logger().warning("nothing registered:\n%s", reasons)
    return done


def data_counts(params: Params) -> DataCounts:
    """The month's data in numbers, from the ingest and clean stages' files (ingest's is the
    project's, shared by the tasks)."""
    ingest = read_model(params.project_path("metrics") / "ingest.json", IngestMetrics)
    clean = read_model(params.paths.metrics / "clean.json", CleanMetrics)
    return DataCounts(
        lines=ingest.lines,
        accepted=ingest.accepted,
        quarantined=ingest.quarantined,
        duplicates=ingest.duplicates,
        by_source=ingest.accepted_by_source,
        pool=ingest.pool_records,
        train=clean.train,
        val=clean.val,
        dpo_pairs=clean.dpo_pairs,
    )


def train_summary(params: Params) -> TrainSummary:
    train = read_model(params.paths.metrics / "train.json", TrainMetrics)
    init = read_model(params.paths.metrics / "init.json", InitMetrics)
    return TrainSummary(
        loss_first=train.first_logged_loss,
        loss_last=train.last_logged_loss,
        eval_loss=train.eval_loss,
        steps=train.global_steps,
        tokens_per_second=train.tokens_per_second,
        init_from=init.start.describe(),
    )


@flow(name="retrain", log_prints=True)
def retrain(
    repo: Path = Path(), params: Params | None = None, tasks: list[str] | None = None
) -> TasksRun:
    """Run the whole pipeline, ingest to evaluate, and return each task's data counts, losses
    and scores (``result.tasks["support"]``), whatever the number of tasks.

    ``params``: ``repo``'s params.yaml as the caller loaded it (the demo), else read here once.
    The stages read the file themselves, in their own processes.
    ``tasks``: of params.yaml's tasks, those to run (by hand: ``prefect deployment run
    retrain/retrain-monthly --param 'tasks=["orders"]'``); None runs every task.
    A task that fails does not stop the others; once they ran, ``TasksFailed`` (holding the
    result) ends the flow run Failed.
    """
    repo = repo.resolve()
    params = params or load_params(repo / "params.yaml")
    if tasks is not None:
        unknown = sorted(set(tasks) - set(params.tasks))
        if unknown or not tasks:
            raise ParamsError(
                f"retrain tasks={tasks}: run some of params.yaml's tasks {list(params.tasks)}"
                + (f"; not there: {unknown}" if unknown else "")
            )
    previous = Path.cwd()
    os.chdir(repo)  # MLflow's default store and lineage reads are relative to the project
    try:
        # The forkserver first: it preloads while the tracking server starts.
        with forkserver.serving(repo, repo / "logs"), server.local_server(repo, repo / "logs"):
            return _retrain(repo, params, tasks)
    finally:
        os.chdir(previous)


def _retrain(repo: Path, params: Params, tasks: list[str] | None = None) -> TasksRun:
    """The flow's body, with the project as the working directory and its tracking store."""
    experiment_id = runs.setup(params.tracking.experiment)
    for said in recovery.close_killed_runs(experiment_id, "retrain", str(flow_run.id or "")):
        get_run_logger().warning(said)
    git = lineage.git_state(repo)
    with mlflow.start_run(
        run_name=f"retrain-{flow_run.name or 'local'}",
        experiment_id=experiment_id,
        tags={
            runs.TAG_COMMIT: git.commit,
            runs.TAG_DIRTY: str(git.dirty).lower(),
            runs.TAG_FLOW_RUN: str(flow_run.id or ""),
            runs.TAG_PIPELINE: "retrain",
        },
    ) as parent:
        chosen = tuple(t for t in params.task_names() if tasks is None or t in tasks)
        result = _retrain_tasks(
            repo, params, chosen, parent.info.run_id, experiment_id, by_hand=tasks is not None
        )
        if result.failed:
            raise TasksFailed(result)  # the retrain's MLflow run ends FAILED too
        return result


def _commit_results(repo: Path, metrics: list[Path], said: str) -> ResultsCommit:
    """This month's dvc.lock and ``metrics`` folders onto the results branch, tagged."""
    done = results.commit_results(
        repo, [Path("dvc.lock"), *metrics], f"retrain {flow_run.name or 'local'}: {said}"
    )
    mlflow.set_tags({"results.commit": done.commit, "results.tag": done.tag})
    return ResultsCommit(commit=done.commit, tag=done.tag, branch=done.branch)


def _run_stages(
    stages: tuple[str, ...], repo: Path, params: Params, parent_run_id: str, experiment_id: str
) -> None:
    """Run ``stages`` in order under ``parent_run_id`` (their files are read through their
    models by ``_verdict``)."""
    for stage in stages:
        retries = 0 if lineage.project_stage(stage) in NOT_RETRIED else 1
        run_stage.with_options(retries=retries)(stage, repo, params, parent_run_id, experiment_id)


def _verdict(params: Params, run_id: str, experiment_id: str) -> PipelineRun:
    """A task's pipeline's summary on its run ``run_id`` (the active one), then its
    registration."""
    decision = Decision.read(params.paths.metrics / "decision.json")
    scores = read_scores(params.paths.metrics / "evaluate.json")
    data, train = data_counts(params), train_summary(params)
    # The pipeline's data versions on its own run: its stage runs' DVC tags (oldest
    # first, so a retried stage's last attempt wins).
    for child in MlflowClient().search_runs(
        [experiment_id],
        filter_string=f"tags.mlflow.parentRunId = '{run_id}'",
        order_by=["attributes.start_time ASC"],
    ):
        mlflow.set_tags({k: v for k, v in child.data.tags.items() if k.startswith(LINEAGE_TAGS)})
    runs.log_metrics({"data": data.model_dump(), "train": train.model_dump()})
    runs.log_metrics(scores, prefix="eval")
    mlflow.set_tag("gate.passed", str(decision.passed).lower())
    # The flow ends with the verdict: a registered version, or the gate's reasons.
    return PipelineRun(
        data=data,
        train=train,
        eval=scores,
        decision=decision,
        registration=register(params, run_id),
        mlflow_run_id=run_id,
    )


def nothing_new(params: Params) -> str | None:
    """Why a task's scheduled retrain would learn nothing: every pool batch of its records is
    one its champion trained on (None: there is something new, or no champion but the base).

    Its champion stays: retraining on the same data would spend the GPU hours on a candidate
    the gate compares with a model trained on exactly that data.
    """
    name = params.tracking.registered_model
    champion = registry.find_alias(name, registry.CHAMPION)
    if champion is None or registry.registered_base(champion) is not None:
        return None
    batches = {path.stem for path in pool_batches(params.paths.pool, params.task)}
    if not batches or batches - set(registry.champion_batches(champion)):
        return None
    return (
        f"no new records since {name} v{champion.version}: it trained on all "
        f"{len(batches)} pool batch(es) of the task"
    )


def _retrain_tasks(
    repo: Path,
    params: Params,
    chosen: tuple[str, ...],
    parent_run_id: str,
    experiment_id: str,
    *,
    by_hand: bool = False,
) -> TasksRun:
    """The shared stages once, then each task's pipeline under a run of its own (a project of
    one task: its one). A task that fails (a preflight refusal, a stage error) is reported
    and the next task runs; the summary names each task's outcome. On the schedule (not
    ``by_hand``), a task with no records its champion did not train on keeps it and runs
    nothing (``nothing_new``); run by hand, it runs whatever the data."""
    before = tasks_report.states(repo, params)
    _run_stages(SHARED_STAGES, repo, params, parent_run_id, experiment_id)
    outcomes: dict[str, TaskOutcome] = {}
    for name in chosen:
        view = params.for_task(name)
        why = None if by_hand else nothing_new(view)
        if why is not None:
            get_run_logger().info("task %s: %s; it keeps its champion", name, why)
            outcomes[name] = TaskUnchanged(reason=why)
            continue
        with mlflow.start_run(
            run_name=name, nested=True, tags={runs.TAG_PIPELINE: "retrain", "task": name}
        ) as run:
            try:
                _run_stages(task_stages(name, repo), repo, view, run.info.run_id, experiment_id)
                outcomes[name] = _verdict(view, run.info.run_id, experiment_id)
            except (StageFailed, DvcLockTimeout, ParamsError, OSError) as error:
                get_run_logger().error("task %s failed: %s", name, error)
                mlflow.set_tag("task.failed", str(error)[:5000])
                outcomes[name] = TaskFailed(error=str(error))
        if outcomes[name].outcome == "failed":  # the error was caught: its run ended FINISHED
            MlflowClient().set_terminated(run.info.run_id, status="FAILED")
    failed = sorted(t for t, o in outcomes.items() if o.outcome == "failed")
    mlflow.set_tag("tasks.failed", ",".join(failed))
    # Every task's adapter and champion before and after: the others did not move.
    text = tasks_report.report(params, before, tasks_report.states(repo, params), outcomes)
    # A task on every task's records: each task's adapter beside it, on the task's suites.
    compared = None
    for name, listed in params.tasks.items():
        outcome = outcomes.get(name)
        if listed.records != "all" or outcome is None:
            continue
        text += "\n" + tasks_report.single_line(params.for_task(name), outcome) + "\n"
        ran = [t for t, o in outcomes.items() if o.outcome == "ran" and t != name]
        if outcome.outcome != "ran" or not ran:
            continue
        try:
            compared = tasks_report.single_comparison(params, name, ran)
            text += "\n" + tasks_report.single_section(compared, params.gate.confidence)
        # Scores the two cannot be compared on (a suite one of them could not run): said,
        # and the month's results stand.
        except (GateError, KeyError, OSError) as error:
            get_run_logger().warning("the single adapter was not compared: %s", error)
            text += f"\nNot compared with the tasks' adapters: {error!r}\n"
    written = params.paths.reports / tasks_report.REPORT
    write_text(written, text)
    mlflow.log_text(text, tasks_report.REPORT)
    get_run_logger().info("%s", text)
    committed = None
    if params.schedule.commit_results:
        ran = sorted(t for t, o in outcomes.items() if o.outcome == "ran")
        # A project of one task: the task's metrics folder is the project's.
        folders = [params.paths.metrics, *(params.for_task(t).paths.metrics for t in chosen)]
        folders = list(dict.fromkeys(folders))
        committed = _commit_results(
            repo, [*folders, written], f"tasks ran: {', '.join(ran) or 'none'}"
        )
    return TasksRun(
        tasks=outcomes,
        compared=compared,
        failed=failed,
        report=str(repo / written),
        report_text=text,
        mlflow_run_id=parent_run_id,
        results=committed,
    )
