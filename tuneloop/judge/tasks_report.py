"""What a retrain did to each task: the interference report.

Each task has its own adapter, so a month that retrains one task cannot move another's
scores: the other's adapter is the same bytes and its champion the same version. This report
shows it rather than asserting it. For every task it sets the adapter's DVC md5 (dvc.lock's
out of ``train@<task>``) and the registry's champion before the run beside the same
after it, with the task's outcome, gate and scores; a task whose adapter or champion moved
without its pipeline running would stand out here. A task that did not run shows the scores
of its last evaluation, and whether dvc.lock ties that evaluation to the adapter it has now
(train's adapter -> merge -> the merged model evaluate judged): the scores it still stands on.

A task with ``records: all`` trains one adapter on every task's data (the single model), and
``single_comparison`` sets each task's adapter beside it on the task's suites, item by item,
with the gate's paired bootstrap: which of the two a team should serve, per task, measured
rather than assumed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from tuneloop.io import ModelFileError
from tuneloop.judge.decision import Decision, Scores, read_scores
from tuneloop.judge.gate import CANDIDATE, SuiteBootstrap
from tuneloop.orchestration.flow_results import AdapterComparison, PipelineRun, TaskOutcome
from tuneloop.params import Params
from tuneloop.tracking import lineage, registry

# The file, in the project's reports folder, and its name among the run's MLflow artifacts.
REPORT = "tasks.md"
# The single adapter (every task's data) in a comparison with a task's own.
SINGLE = "single"


@dataclass(frozen=True)
class TaskState:
    adapter: str | None  # the adapter's DVC md5 in dvc.lock; None before its first run
    champion: str | None  # the registry's champion version; None before the first release
    # Whether dvc.lock's last evaluation judged the merge of this very adapter (compared only
    # between before and after through ``adapter``; not part of equality).
    judged_this_adapter: bool = field(default=False, compare=False)


def states(repo: Path, params: Params) -> dict[str, TaskState]:
    """Each task's adapter and champion as they are now."""
    lock = lineage.dvc_lock_md5s(repo)
    found = {}
    for task in params.task_names():
        view = params.for_task(task)

        def stage(name: str, kind: str, path: Path, task: str = task) -> str | None:
            entry = lock.get(f"{name}@{task}", {})
            return entry.get(kind, {}).get(path.as_posix())

        adapter = stage("train", "outs", view.paths.adapter)
        merged = stage("merge", "outs", view.paths.merged)
        champion = registry.find_alias(view.tracking.registered_model, registry.CHAMPION)
        found[task] = TaskState(
            adapter=adapter,
            champion=None if champion is None else str(champion.version),
            judged_this_adapter=adapter is not None
            and merged is not None
            and stage("merge", "deps", view.paths.adapter) == adapter
            and stage("evaluate", "deps", view.paths.merged) == merged,
        )
    return found


def _short(md5: str | None) -> str:
    return "none" if md5 is None else md5.removesuffix(".dir")[:10]


def _scores(params: Params, evaluation: Scores, reference: str) -> str:
    """The candidate's primary metric on the task's suites, beside the reference's."""
    metric = params.gate.primary_metric
    shown = []
    for suite in params.evaluate.suites:
        mine = evaluation.get("candidate", {}).get(suite, {}).get(metric)
        theirs = evaluation.get(reference, {}).get(suite, {}).get(metric)
        if mine is not None:
            against = "" if theirs is None else f" ({reference} {theirs:.3f})"
            shown.append(f"{suite}/{metric} {mine:.3f}{against}")
    return "; ".join(shown) or "-"


def _last_judged(params: Params, state: TaskState) -> str:
    """The scores of a task that did not run: its last evaluation, and what it judged."""
    try:
        evaluation = read_scores(params.paths.metrics / "evaluate.json")
        decision = Decision.read(params.paths.metrics / "decision.json")
    except (OSError, ModelFileError):
        return "never judged"
    scores = _scores(params, evaluation, decision.reference)
    on = "this adapter" if state.judged_this_adapter else "not the adapter it has now (dvc.lock)"
    return f"last judged ({on}): {scores}"


def report(
    params: Params,
    before: Mapping[str, TaskState],
    after: Mapping[str, TaskState],
    outcomes: Mapping[str, TaskOutcome],
) -> str:
    """The markdown table: one row per task, what ran, what moved, what the gate said."""
    lines = [
        "# Tasks: what this retrain did to each",
        "",
        "Each task trains its own adapter: a task that did not run keeps its adapter (the same",
        "DVC md5) and its champion, so its scores cannot have moved; its row shows the scores",
        "of its last evaluation and whether dvc.lock ties them to the adapter it has now.",
        "",
        "| task | run | adapter before -> after | champion before -> after | gate | scores |",
        "|---|---|---|---|---|---|",
    ]
    for task in params.task_names():
        was, now = before.get(task, TaskState(None, None)), after[task]
        outcome = outcomes.get(task)
        view = params.for_task(task)
        if outcome is None:
            run, gate, scores = "not run", "-", _last_judged(view, now)
        elif outcome.outcome == "failed":
            run, gate, scores = "failed", "-", outcome.error[:200]
        elif outcome.outcome == "unchanged":
            run, gate, scores = "nothing new", "-", f"{outcome.reason}; {_last_judged(view, now)}"
        else:
            run = "ran"
            gate = "PASS" if outcome.decision.passed else "FAIL"
            scores = _pipeline_scores(view, outcome)
        adapter = f"{_short(was.adapter)} -> {_short(now.adapter)}"
        adapter += "" if was.adapter != now.adapter else " (untouched)"
        champion = f"{was.champion or 'none'} -> {now.champion or 'none'}"
        lines.append(f"| {task} | {run} | {adapter} | {champion} | {gate} | {scores} |")
    moved = [
        task
        for task in params.task_names()
        if (task not in outcomes or outcomes[task].outcome == "unchanged")
        and before.get(task) != after[task]
    ]
    lines += ["", f"Moved without running: {', '.join(moved) or 'none'}.", ""]
    return "\n".join(lines)


def _pipeline_scores(params: Params, outcome: PipelineRun) -> str:
    return _scores(params, outcome.eval, outcome.decision.reference)


def single_line(params: Params, outcome: TaskOutcome) -> str:
    """What became of the single adapter (every task's data; ``params`` its task's view) this
    month, in a sentence."""
    said = f"One adapter on every task's data ({params.tracking.registered_model}): "
    if outcome.outcome == "failed":
        return said + f"failed: {outcome.error[:200]}"
    if outcome.outcome == "unchanged":
        return said + f"not run: {outcome.reason}."
    gate = "PASS" if outcome.decision.passed else "FAIL"
    registration = outcome.registration
    if registration is None:
        kept = "judged beside the tasks' adapters, not registered"
    elif registration.registered:
        kept = f"registered as v{registration.version}"
    else:
        kept = "not registered"
    return said + f"ran, gate {gate}, {kept}; {_pipeline_scores(params, outcome)}."


def single_comparison(
    params: Params, single_task: str, tasks: Sequence[str]
) -> list[AdapterComparison]:
    """Each of ``tasks``' candidate adapter against the candidate of ``single_task`` (a task
    on every task's records), on each of the task's suites and metrics: the same items,
    paired, with the gate's bootstrap and confidence (the task's ``gate``). ``better``: whose
    the interval says, if it settles it.
    """
    # lm-eval, which the scoring module imports, takes seconds; the flow imports this module.
    from tuneloop.judge.scoring import read_items

    metrics = params.for_task(single_task).paths.metrics
    single = read_items(metrics / "eval-items" / f"{CANDIDATE}.jsonl")
    directions = Decision.read(metrics / "decision.json").higher_is_better
    rows = []
    for task in tasks:
        view = params.for_task(task)
        own = read_items(view.paths.metrics / "eval-items" / f"{CANDIDATE}.jsonl")
        for suite in view.evaluate.suites:
            theirs = single[suite].aligned(own[suite].ids, f"the single adapter on {suite}")
            boot = SuiteBootstrap(suite, {CANDIDATE: own[suite], SINGLE: theirs}, (), view.gate)
            for metric in sorted(set(own[suite].values) & set(theirs.values)):
                row, found = boot.compare(CANDIDATE, SINGLE, metric, directions[suite][metric])
                better: Literal["adapter", "single", "no settled difference"]
                better = "no settled difference"
                if found is not None and found.low > 0:
                    better = "adapter"
                elif found is not None and found.high < 0:
                    better = "single"
                rows.append(AdapterComparison(**row.model_dump(), task=task, better=better))
    return rows


def single_section(rows: Sequence[AdapterComparison], confidence: float) -> str:
    """The comparison as a markdown table (``single_comparison``'s rows)."""
    lines = [
        "## Each task's adapter against one adapter on every task's data",
        "",
        f"Paired on the task's suites, the same items; better by (adapter - single, "
        f"{confidence:.0%} interval), positive when the task's own adapter is better.",
        "",
        "| task | suite/metric | adapter | single | better by | better |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        shown = "-"
        if r.diff is not None:
            shown = f"{r.diff:+.3f} [{r.low:+.3f}, {r.high:+.3f}]"
        mine = "-" if r.value is None else f"{r.value:.3f}"
        theirs = "-" if r.reference_value is None else f"{r.reference_value:.3f}"
        lines.append(
            f"| {r.task} | {r.suite}/{r.metric} | {mine} | {theirs} | {shown} | {r.better} |"
        )
    return "\n".join([*lines, ""])
