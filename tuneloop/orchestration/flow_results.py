"""What the retrain and release flows return: the summaries a person, the demo and the CLI read.

A Prefect flow may return a pydantic model; these are those models, defined once, so the
summary printed at the end of a month reads fields, never a guessed key.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tuneloop.judge.decision import Comparison, Decision, Scores
from tuneloop.release.events import ReleaseEvent
from tuneloop.tracking.registry import Registration


class _Result(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class DataCounts(_Result):
    """What ingest and clean made of the month's lines."""

    lines: int
    accepted: int
    quarantined: int
    duplicates: int
    by_source: dict[str, int] = {}
    pool: int
    train: int
    val: int
    dpo_pairs: int


class TrainSummary(_Result):
    loss_first: float | None  # None: fewer steps than train.logging_steps
    loss_last: float | None
    eval_loss: float | None
    steps: int
    tokens_per_second: float | None
    init_from: str  # what the run started from, in words


class ResultsCommit(_Result):
    """The month's dvc.lock and metrics on the results branch."""

    commit: str
    tag: str
    branch: str


class PipelineRun(_Result):
    """One pipeline that ran (the project's, a task's or the single adapter's): its data,
    training, scores, the gate's decision and its registration."""

    outcome: Literal["ran"] = "ran"
    data: DataCounts
    train: TrainSummary
    eval: Scores
    decision: Decision
    registration: Registration | None = None  # None: judged only, not registered
    mlflow_run_id: str
    results: ResultsCommit | None = None


class TaskUnchanged(_Result):
    """A task whose retrain was skipped: nothing new since its champion."""

    outcome: Literal["unchanged"] = "unchanged"
    reason: str


class TaskFailed(_Result):
    outcome: Literal["failed"] = "failed"
    error: str


TaskOutcome = Annotated[PipelineRun | TaskUnchanged | TaskFailed, Field(discriminator="outcome")]


class AdapterComparison(Comparison):
    """A task's own adapter against the single adapter on every task's data (a task of
    ``records: all``)."""

    task: str
    better: Literal["adapter", "single", "no settled difference"]


class TasksRun(_Result):
    """A retrain, of one task or several: each task's outcome, and the report."""

    tasks: dict[str, TaskOutcome]
    # Each task's adapter against a task's on every task's records (`records: all`).
    compared: list[AdapterComparison] | None = None
    failed: list[str]
    report: str  # the report's path
    report_text: str  # the month's own text: the file is rewritten by the next retrain
    mlflow_run_id: str
    results: ResultsCommit | None = None


class ExperimentOutcome(_Result):
    """One param set of a sweep or a pilot, run as a DVC experiment."""

    settings: dict[str, Any] = Field(description="the params it set, dotted keys")
    rev: str | None = Field(description="the experiment's commit; None: it did not finish")
    error: str | None = None
    scores: dict[str, float | None] = Field(
        description="the gate's primary metric on each suite, and eval_loss"
    )
    gate_passed: bool | None = Field(description="None: it did not reach the gate")


class ExperimentRun(_Result):
    """What the experiment flow ran, by experiment name, under one MLflow parent run."""

    mlflow_run_id: str
    experiments: dict[str, ExperimentOutcome]


class ReleaseOutcome(_Result):
    """What a release did; ``not released`` when there was nothing to release, and why."""

    outcome: Literal["promoted", "rolled_back", "blocked", "failed", "not released"]
    reason: str  # a sentence a person reads
    flow_run_id: str | None = None
    analyses: int = 0
    failures: int = 0
    rollback_seconds: float | None = None
    # Every step of the release in order: shifts, analyses, approvals, the rollback.
    history: list[ReleaseEvent] = []
    approval_form: str = ""  # what every approval form said of the blind review
