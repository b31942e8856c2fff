"""The month-by-month summary ``tuneloop demo`` prints at the end of the loop.

What a person wants to see after N monthly cycles: the data each month brought (by source),
how each candidate scored against the base and the champion, what the people's blind review
said (month 1: the demo's panel), what its release did (the split, the analyses, who
approved, the outcome), and where to look next.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from tuneloop.judge.decision import Check, Scores
from tuneloop.orchestration.flow_results import (
    PipelineRun,
    ReleaseOutcome,
    TaskOutcome,
    TrainSummary,
)
from tuneloop.release.approval import Answered
from tuneloop.release.events import Analysis, ApprovalStep, Rollback, Shift
from tuneloop.review.tally import ReviewResults

WHERE_TO_LOOK = """
Where to look:
  MLflow   {bin}/mlflow ui --backend-store-uri sqlite:///mlflow.db --port 5000
           -> http://127.0.0.1:5000: experiment 'tuneloop', a `retrain-...` run a month, a run
              per task in it: tick a task's runs of two months and press Compare.
              Models -> {model}: every version, its aliases (champion, previous-champion)
              and the lineage tags (tuneloop.tracking.init_from: what each month started from)
  DVC      {bin}/dvc metrics diff tuneloop/results~1 tuneloop/results: the last two months
           (schedule.commit_results commits each month's dvc.lock and metrics/ to that branch,
           with a tag per retrain; `git tag -l 'retrain-*'`)
  Prefect  PREFECT_API_URL=http://127.0.0.1:4200/api {bin}/prefect server start
           -> http://127.0.0.1:4200: the retrain and release flow runs of every month
"""


class _Summary(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ArmTraffic(_Summary):
    """What the demo's customers on one arm saw."""

    requests: int
    wrong: int
    flagged: int
    errors: int


class Traffic(_Summary):
    seconds: float
    arms: dict[str, ArmTraffic]
    feedback_refused: dict[str, int]  # HTTP status -> feedback posts the router refused


class DemoRelease(ReleaseOutcome):
    """A release of the demo: the flow's outcome, its final state, and the customers' side."""

    state: str | None  # the flow run's final state name
    message: str | None
    demo_approvals: list[Answered]  # what the demo approved for nobody (approval.approve)
    traffic: Traffic | None


class DemoReview(_Summary):
    """The demo panel's blind review of a month's challenger."""

    review: str
    votes_by_reviewer: dict[str, int]
    summary: str
    table: str
    results: ReviewResults
    check: Check | None  # None without gate.blind_review


class TaskMonth(_Summary):
    """A month of one task: retrain, review, release."""

    retrain: TaskOutcome
    review: DemoReview | None = None
    # Not released: the outcome says why, in a sentence (``flows.demo.not_released``).
    release: DemoRelease | ReleaseOutcome


class DemoMonth(_Summary):
    """A month of the demo: each task's month (a project of one task: its one) and the
    retrain's report of every task."""

    month: int
    label: str
    seconds: float
    tasks: dict[str, TaskMonth]
    report: str  # the report's path
    report_text: str  # the month's own text: the file holds the last month's only
    failed: list[str]


def losses(train: TrainSummary) -> str:
    """A retrain's losses in words; a run shorter than ``train.logging_steps`` logged none."""
    first, last, val = train.loss_first, train.loss_last, train.eval_loss
    if first is None or last is None:
        shown = "no loss logged (fewer steps than train.logging_steps)"
    else:
        shown = f"loss {first:.3f} -> {last:.3f}"
    if val is not None:
        shown += f" (val {val:.3f})"
    return f"{shown} in {train.steps} steps"


def metric_figures(metrics: Mapping[str, float | None]) -> str:
    """``accuracy 0.625, ...``; a metric a suite could not compute (no unanswerable item
    among the scored ones, say) is "n/a", not a crash."""
    return ", ".join(
        f"{name} {value:.3f}" if isinstance(value, int | float) else f"{name} n/a"
        for name, value in sorted(metrics.items())
    )


def _scores(evaluation: Scores, model: str) -> str:
    suites = evaluation.get(model)
    if not suites:
        return "-"
    return "; ".join(f"{suite}: {metric_figures(metrics)}" for suite, metrics in suites.items())


def _release_lines(release: ReleaseOutcome) -> list[str]:
    lines = [f"  release  {release.outcome}: {release.reason}"]
    for event in release.history:
        if isinstance(event, Shift):
            lines.append(f"           challenger -> {event.percent} %")
        elif isinstance(event, Analysis) and event.kind == "analysis":
            share = event.challenger_share
            shown = "n/a" if share is None else f"{share:.0%} of requests to the challenger"
            verdict = "pass" if event.passed else "FAIL"
            lines.append(f"           analysis at {event.percent} %: {verdict} ({shown})")
        elif isinstance(event, ApprovalStep):
            lines.append(f"           {event.decision} by {event.approver} at {event.percent} %")
        elif isinstance(event, Rollback):
            lines.append(f"           rollback in {event.seconds * 1000:.0f} ms: {event.reason}")
    seen = release.traffic.arms if isinstance(release, DemoRelease) and release.traffic else {}
    for arm, tally in seen.items():
        lines.append(
            f"           customers on {arm}: {tally.requests} requests, {tally.wrong} wrong "
            f"answers, {tally.flagged} flagged as badcases"
        )
    return lines


def _retrain_lines(retrain: PipelineRun) -> list[str]:
    """What one retrain (of the project, or of one task) brought, scored and decided."""
    data, decision = retrain.data, retrain.decision
    sources = ", ".join(f"{n} {s}" for s, n in sorted(data.by_source.items()))
    out = [
        f"  data     {data.lines} lines -> {data.accepted} new records"
        + (f" ({sources})" if sources else "")
        + f"; pool {data.pool}; train {data.train} / val {data.val}"
    ]
    train = retrain.train
    out.append(f"  train    from {train.init_from}: {losses(train)}")
    evaluation = retrain.eval
    for name in ("base", "champion", "candidate"):
        if name in evaluation:
            out.append(f"  eval     {name:<10} {_scores(evaluation, name)}")
    verdict = "PASS" if decision.passed else decision.verdict.upper()
    let_through = decision.let_through()
    if let_through:
        verdict += f", {len(let_through)} rule(s) unsettled (gate.on_inconclusive: warn)"
    out.append(f"  gate     {verdict}")
    out.extend(f"           {reason}" for reason in decision.reasons)
    registration = retrain.registration
    if registration is not None and registration.registered:
        out.append(f"  registry {registration.name} v{registration.version} ({registration.alias})")
    return out


def _month_lines(entry: TaskMonth) -> list[str]:
    """A month of one task: its retrain (or why it did not run), review and release."""
    retrain = entry.retrain
    if retrain.outcome == "unchanged":
        return [f"  retrain  not run: {retrain.reason}; its champion stays"]
    if retrain.outcome == "failed":
        return [f"  retrain  FAILED: {retrain.error}"]
    out = _retrain_lines(retrain)
    review = entry.review
    if review:
        out.append(f"  review   {review.summary}")
        out.extend(f"           {line}" for line in review.table.splitlines() if line)
    out.extend(_release_lines(entry.release))
    return out


def _task_table(report: str) -> list[str]:
    """The interference report's table and its verdict line (``tasks_report.report``)."""
    return [line for line in report.splitlines() if line.startswith(("|", "Moved without running"))]


def format_loop(history: list[DemoMonth], models: tuple[str, ...] = ("tuneloop-support",)) -> str:
    """The summary of ``history`` (``flows.demo.run``'s); ``models``: each task's registered
    model. A project of one task reads without task headings or the report's table, which
    sets tasks side by side: its month says it all."""
    out = ["", "=== tuneloop: the loop, month by month ==="]
    several = len(models) > 1
    for month in history:
        out.append(f"\nmonth {month.month} ({month.label}), {month.seconds:.0f} s")
        for task, entry in month.tasks.items():
            out.extend([f"  --- task {task}"] if several else [])
            out.extend(_month_lines(entry))
        if not several:
            continue
        out.append(
            f"  tasks    {month.report}: each task's adapter and champion, before and after"
            " the retrain (the release follows it)"
        )
        # The month's text as its retrain wrote it: the file holds the last month's only.
        out.extend(f"           {line}" for line in _task_table(month.report_text))
    bin_dir = os.path.relpath(Path(sys.executable).parent)
    out.append(WHERE_TO_LOOK.format(model=", ".join(models), bin=bin_dir))
    return "\n".join(out)
