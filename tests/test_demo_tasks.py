"""The two-task demo's own parts (``flows/demo.py`` with ``configs/demo-tasks.yaml``): each
task's month seeded into its folder, the summary month by month per task, each task's
customers. The whole demo is `make demo`; these hold its pieces without serving a model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from flows import demo
from tests.gate_helpers import a_decision
from tests.helpers import ROOT
from tuneloop.demo import customers, orders, workspace
from tuneloop.demo.report import (
    DemoMonth,
    TaskMonth,
    format_loop,
    losses,
    metric_figures,
)
from tuneloop.io import write_json, write_text
from tuneloop.judge import tasks_report
from tuneloop.orchestration.flow_results import (
    DataCounts,
    PipelineRun,
    ReleaseOutcome,
    TaskFailed,
    TaskUnchanged,
    TrainSummary,
)
from tuneloop.params import Params, parse_params
from tuneloop.tracking.registry import Registration

# The fast tier: no pipeline, server or rank.
pytestmark = pytest.mark.fast


def tasks_params(incoming: Path, **tasks: dict[str, Any]) -> Params:
    config = ROOT / "configs" / "demo-tasks.yaml"
    params = workspace.merged(
        yaml.safe_load((ROOT / "params.yaml").read_text()),
        yaml.safe_load(config.read_text()),
        config,
    )
    params["paths"]["incoming"] = str(incoming)
    params["demo"] |= {"n_support": 30, "n_badcases": 3, "n_orders": 20, "n_order_badcases": 2}
    if tasks:
        params["tasks"] = tasks
    return parse_params(params, config)


def test_each_task_gets_its_month_in_its_folder_and_orders_only_its_first(
    tmp_path: Path,
) -> None:
    params = tasks_params(tmp_path)
    first = demo.seed_month(params, 1)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in first) == [
        "orders/order-corrections-2026-10.jsonl",
        "orders/orders-export-2026-10.jsonl",
        "support/router-feedback-2026-10.jsonl",
        "support/support-export-2026-10.jsonl",
    ]
    # The order intake sends nothing new in month 2: its pipeline has nothing to rerun on.
    second = demo.seed_month(params, 2)
    assert {p.parent.name for p in second} == {"support"}
    assert sorted(p.name for p in (tmp_path / "orders").iterdir()) == [
        "order-corrections-2026-10.jsonl",
        "orders-export-2026-10.jsonl",
    ]
    # A task the demo has no data for is refused by name, before anything is written.
    odd = tasks_params(
        tmp_path / "odd",
        support={"folder": "s", "registered_model": "tuneloop-support"},
        copy={"folder": "c", "registered_model": "tuneloop-copy"},
    )
    with pytest.raises(ValueError, match=r"not \['copy'\]"):
        demo.seed_month(odd, 1)
    assert not (tmp_path / "odd").exists()


def test_order_customers_send_orders_and_support_customers_ask_the_desk() -> None:
    order = customers.ASKS["orders"](11, 2)()
    assert json.loads(order.answer)["product"] and order.intent == "order"
    question = customers.ASKS["support"](11, 2)()
    assert question.intent != "order" and not question.answer.startswith("{")
    assert not demo.DEMO_TASKS["orders"].flags and demo.DEMO_TASKS["support"].flags


def retrained(accuracy: float) -> PipelineRun:
    return PipelineRun(
        data=DataCounts(
            lines=10, accepted=9, quarantined=0, duplicates=1, pool=9, train=8, val=1, dpo_pairs=0
        ),
        train=TrainSummary(
            loss_first=5.0,
            loss_last=1.0,
            eval_loss=None,
            steps=12,
            tokens_per_second=None,
            init_from="base",
        ),
        eval={"candidate": {"orders_demo": {"accuracy": accuracy}}},
        decision=a_decision(),
        registration=Registration(
            registered=True, name="tuneloop-orders", version="2", alias="challenger"
        ),
        mlflow_run_id="run-1",
    )


def test_the_summary_shows_each_task_month_by_month(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Month 2's interference report, as the flow writes it: orders did not run, its row shows
    # the scores of its last evaluation and that dvc.lock ties them to its adapter.
    monkeypatch.chdir(tmp_path)
    params = tasks_params(tmp_path / "incoming")
    view = params.for_task("orders")
    metrics = {"candidate": {"orders_demo": {"accuracy": 0.995}}}
    metrics["champion"] = {"orders_demo": {"accuracy": 0.0}}
    write_json(view.paths.metrics / "evaluate.json", metrics)
    a_decision().model_copy(update={"reference": "champion"}).write(
        view.paths.metrics / "decision.json"
    )
    orders_state = tasks_report.TaskState("5f0c8a1e2b.dir", "2", judged_this_adapter=True)
    support_state = tasks_report.TaskState("77aa01bc3d.dir", "3")
    before = {"orders": orders_state, "support": tasks_report.TaskState("0123456789.dir", "2")}
    after = {"orders": orders_state, "support": support_state}
    kept = "no new records since tuneloop-orders v2: it trained on all 1 pool batch(es) of the task"
    second = tasks_report.report(params, before, after, {"orders": TaskUnchanged(reason=kept)})
    # Month 1's, when orders ran: the file at the same path, rewritten by month 2.
    first = tasks_report.report(
        params,
        {"support": before["support"]},
        {"orders": tasks_report.TaskState("5f0c8a1e2b.dir", "1"), "support": before["support"]},
        {"orders": retrained(0.995)},
    )
    report = tmp_path / "reports" / "tasks.md"
    write_text(report, second)
    history: list[DemoMonth] = [
        DemoMonth(
            month=1,
            label="2026-10",
            seconds=500,
            report=str(report),
            report_text=first,
            failed=[],
            tasks={
                "orders": TaskMonth(
                    retrain=retrained(0.995),
                    release=ReleaseOutcome(outcome="promoted", reason="v2 promoted at 100 %"),
                ),
            },
        ),
        DemoMonth(
            month=2,
            label="2026-11",
            seconds=200,
            report=str(report),
            report_text=second,
            failed=[],
            tasks={
                "orders": TaskMonth(
                    retrain=TaskUnchanged(reason=kept),
                    release=demo.not_released(TaskUnchanged(reason=kept)),
                ),
            },
        ),
    ]
    text = format_loop(history, ("tuneloop-support", "tuneloop-orders"))
    months = text.split("\nmonth ")
    assert "--- task orders" in months[1] and "orders_demo: accuracy 0.995" in months[1]
    assert "release  promoted: v2 promoted at 100 %" in months[1]
    assert f"retrain  not run: {kept}; its champion stays" in months[2]
    assert f"{report}: each task's adapter and champion" in months[2]
    # The report's table under it: orders untouched, on the scores it was last judged with.
    row = next(line for line in months[2].splitlines() if "| orders |" in line)
    assert "| nothing new |" in row and "5f0c8a1e2b -> 5f0c8a1e2b (untouched)" in row, row
    assert "| 2 -> 2 |" in row, row
    assert "last judged (this adapter): orders_demo/accuracy 0.995 (champion 0.000)" in row
    # Support: not run this month (no outcome), never judged (no files in its folder), and
    # its adapter changed all the same: the report names it as moved without running.
    row = next(line for line in months[2].splitlines() if "| support |" in line)
    assert "| not run |" in row and "never judged" in row, row
    assert "Moved without running: support." in months[2]
    # Month 1 shows its own table, not the file month 2 rewrote: orders ran, from no adapter.
    row = next(line for line in months[1].splitlines() if "| orders |" in line)
    assert "| ran |" in row and "none -> 5f0c8a1e2b |" in row and "| none -> 1 |" in row, row
    assert "orders_demo/accuracy 0.995" in row and "Moved without running: none." in months[1]
    assert "Models -> tuneloop-support, tuneloop-orders" in text
    assert demo.not_released(TaskFailed(error="preflight refused")) == ReleaseOutcome(
        outcome="not released", reason="preflight refused"
    )
    # A month the gate held: its reasons in a sentence, never the registration's fields.
    reasons = ["gate fail: nothing registered", "support_demo/accuracy: FAIL"]
    held = Registration(registered=False, name="tuneloop-support", reasons=reasons)
    release = demo.not_released(retrained(0.1).model_copy(update={"registration": held}))
    assert release.reason == "gate fail: nothing registered; support_demo/accuracy: FAIL"
    # A project of one task: the same month, without task headings or the tasks' table.
    held_month = DemoMonth(
        month=3,
        label="2026-12",
        seconds=1,
        report=str(report),
        report_text=first,
        failed=[],
        tasks={"support": TaskMonth(retrain=retrained(0.1), release=release)},
    )
    one = format_loop([held_month])
    assert f"release  not released: {release.reason}" in one
    assert (
        "--- task" not in one and "| orders |" not in one and "Models -> tuneloop-support:" in one
    )
    assert orders.FIELDS == ("product", "express")


def test_a_run_too_short_to_log_a_loss_is_said_in_words() -> None:
    # 2 steps under train.logging_steps 25 log no loss; a suite's first items may hold no
    # unanswerable one. The summary said so with a TypeError.
    short = TrainSummary(
        loss_first=None,
        loss_last=None,
        eval_loss=None,
        steps=2,
        tokens_per_second=None,
        init_from="base",
    )
    assert losses(short) == "no loss logged (fewer steps than train.logging_steps) in 2 steps"
    logged = short.model_copy(update={"loss_first": 2.5, "loss_last": 0.25, "eval_loss": 0.3})
    logged = logged.model_copy(update={"steps": 40})
    assert losses(logged) == "loss 2.500 -> 0.250 (val 0.300) in 40 steps"
    figures = metric_figures({"accuracy": 0.5, "hallucination_rate": None})
    assert figures == "accuracy 0.500, hallucination_rate n/a"
