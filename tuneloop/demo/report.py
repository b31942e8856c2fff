"""The month-by-month summary ``tuneloop demo`` prints at the end of the loop.

What a person wants to see after N monthly cycles: the data each month brought (by source),
how each candidate scored against the base and the champion, what the people's blind review
said (month 1: the demo's panel), what its release did (the split, the analyses, who
approved, the outcome), and where to look next.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

WHERE_TO_LOOK = """
Where to look:
  MLflow   {bin}/mlflow ui --backend-store-uri sqlite:///mlflow.db --port 5000
           -> http://127.0.0.1:5000: experiment 'tuneloop', tick the two `retrain-...` runs and
              press Compare (one month each); Models -> {model}: every version, its aliases
              (champion, previous-champion) and the lineage tags (tuneloop.tracking.init_from: what
              each month started from)
  DVC      {bin}/dvc metrics diff tuneloop/results~1 tuneloop/results: the last two months
           (schedule.commit_results commits each month's dvc.lock and metrics/ to that branch,
           with a tag per retrain; `git tag -l 'retrain-*'`)
  Prefect  PREFECT_API_URL=http://127.0.0.1:4200/api {bin}/prefect server start
           -> http://127.0.0.1:4200: the retrain and release flow runs of every month
"""


def losses(train: dict[str, Any]) -> str:
    """A retrain's losses in words; a run shorter than ``train.logging_steps`` logged none."""
    first, last, val = train.get("loss_first"), train.get("loss_last"), train.get("eval_loss")
    if first is None or last is None:
        shown = "no loss logged (fewer steps than train.logging_steps)"
    else:
        shown = f"loss {first:.3f} -> {last:.3f}"
    if val is not None:
        shown += f" (val {val:.3f})"
    return f"{shown} in {train['steps']} steps"


def metric_figures(metrics: dict[str, Any]) -> str:
    """``accuracy 0.625, ...``; a metric a suite could not compute (no unanswerable item
    among the scored ones, say) is "n/a", not a crash."""
    return ", ".join(
        f"{name} {value:.3f}" if isinstance(value, int | float) else f"{name} n/a"
        for name, value in sorted(metrics.items())
    )


def _scores(evaluation: dict[str, Any], model: str) -> str:
    suites = evaluation.get(model)
    if not suites:
        return "-"
    return "; ".join(f"{suite}: {metric_figures(metrics)}" for suite, metrics in suites.items())


def _release_lines(release: dict[str, Any]) -> list[str]:
    lines = [f"  release  {release.get('outcome', '?')}: {release.get('reason', '')}"]
    for event in release.get("history", []):
        kind = event.get("kind")
        if kind == "shift":
            lines.append(f"           challenger -> {event['percent']} %")
        elif kind == "analysis":
            share = event.get("challenger_share")
            shown = "n/a" if share is None else f"{share:.0%} of requests to the challenger"
            verdict = "pass" if event.get("passed") else "FAIL"
            lines.append(f"           analysis at {event['percent']} %: {verdict} ({shown})")
        elif kind == "approval":
            lines.append(
                f"           {event['decision']} by {event['approver']} at {event['percent']} %"
            )
        elif kind == "rollback":
            lines.append(
                f"           rollback in {event['seconds'] * 1000:.0f} ms: {event['reason']}"
            )
    seen = release.get("traffic", {}).get("arms", {})
    for arm, tally in seen.items():
        lines.append(
            f"           customers on {arm}: {tally['requests']} requests, {tally['wrong']} wrong "
            f"answers, {tally['flagged']} flagged as badcases"
        )
    return lines


def _retrain_lines(retrain: dict[str, Any]) -> list[str]:
    """What one retrain (of the project, or of one task) brought, scored and decided."""
    data, decision = retrain["data"], retrain["decision"]
    by_source = data.get("by_source") or {}
    sources = ", ".join(f"{n} {s}" for s, n in sorted(by_source.items()))
    out = [
        f"  data     {data['lines']} lines -> {data['accepted']} new records"
        + (f" ({sources})" if sources else "")
        + f"; pool {data['pool']}; train {data['train']} / val {data['val']}"
    ]
    train = retrain["train"]
    out.append(f"  train    from {train.get('init_from', 'base')}: {losses(train)}")
    evaluation = retrain["eval"]
    for name in ("base", "champion", "candidate"):
        if name in evaluation:
            out.append(f"  eval     {name:<10} {_scores(evaluation, name)}")
    verdict = "PASS" if decision["passed"] else str(decision["verdict"]).upper()
    let_through = [u for u in decision.get("unsettled", []) if not u["blocking"]]
    if let_through:
        verdict += f", {len(let_through)} rule(s) unsettled (gate.on_inconclusive: warn)"
    out.append(f"  gate     {verdict}")
    out.extend(f"           {reason}" for reason in decision.get("reasons", []))
    registration = retrain.get("registration") or {}
    if registration.get("registered"):
        out.append(
            f"  registry {registration['name']} v{registration['version']} "
            f"({registration['alias']})"
        )
    return out


def _month_lines(entry: dict[str, Any]) -> list[str]:
    """A month of one task: its retrain (or why it did not run), review and release."""
    retrain = entry["retrain"]
    if retrain.get("outcome") == "unchanged":
        return [f"  retrain  not run: {retrain['reason']}; its champion stays"]
    if retrain.get("outcome") == "failed":
        return [f"  retrain  FAILED: {retrain['error']}"]
    out = _retrain_lines(retrain)
    review = entry.get("review")
    if review:
        out.append(f"  review   {review['summary']}")
        out.extend(f"           {line}" for line in review["table"].splitlines() if line)
    out.extend(_release_lines(entry.get("release") or {}))
    return out


def _task_table(report: str) -> list[str]:
    """The interference report's table and its verdict line (``tasks_report.report``)."""
    return [line for line in report.splitlines() if line.startswith(("|", "Moved without running"))]


def format_loop(
    history: list[dict[str, Any]], models: tuple[str, ...] = ("tuneloop-support",)
) -> str:
    """The summary of ``history`` (``flows.demo.run``'s); ``models``: the registered models."""
    out = ["", "=== tuneloop: the loop, month by month ==="]
    for month in history:
        out.append(f"\nmonth {month['month']} ({month['label']}), {month['seconds']:.0f} s")
        if "tasks" not in month:
            out.extend(_month_lines(month))
            continue
        for task, entry in month["tasks"].items():
            out.append(f"  --- task {task}")
            out.extend(_month_lines(entry))
        out.append(
            f"  tasks    {month['report']}: each task's adapter and champion, before and after"
            " the retrain (the release follows it)"
        )
        # The month's text as its retrain wrote it: the file holds the last month's only.
        out.extend(f"           {line}" for line in _task_table(month["report_text"]))
    bin_dir = os.path.relpath(Path(sys.executable).parent)
    out.append(WHERE_TO_LOOK.format(model=", ".join(models), bin=bin_dir))
    return "\n".join(out)
