"""Two months of the loop on a small demo: month two is built from month one's production.

``tuneloop demo --months 2`` (``flows/demo.py``) on a tiny project copy: the base registered
as the first champion, month 1 retrained, released for real (``transformers serve`` backends,
the router, demo customers, approvals answered as ``demo-operator``), the customers' flags
ingested in month 2, month 2 trained from the champion month 1 released, judged against it
(the regression rules and the fixed-badcase suite), and released in turn. The facts asserted
are the ones the issue lists for ``make demo``; the release overlay is shorter than
``configs/demo.yaml`` (one analysis of 4 s a step) so the test takes minutes, not tens.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from mlflow.entities.model_registry import ModelVersion
from mlflow.tracking import MlflowClient

from tests.helpers import (
    CHROMIUM,
    PASSING_TRAIN,
    TASK,
    chromium,
    copy_project,
    mlflow_server,
    write_params,
)
from tuneloop.demo.report import DemoMonth, DemoRelease, TaskMonth, format_loop
from tuneloop.judge.decision import Decision
from tuneloop.orchestration.flow_results import PipelineRun
from tuneloop.params import load_params
from tuneloop.tracking import init_from, registry
from tuneloop.tracking.registry import Registration
from tuneloop.tracking.runs import TAG_STAGE

# The whole suite (`make test`): months of the loop, transformers serve, Chromium
pytestmark = pytest.mark.slow

MODEL = "tuneloop-support"
# The tiny candidate learns the reply format in full training (helpers.PASSING_TRAIN; a LoRA
# at 1e-2 did until the general skill's phrasings changed, then answered "[] The."; the one-task
# demo trains the tiny model in full too; tests/test_evaluate.py judges on format_compliance).
# The base's general skill after the tests' 10 pre-training steps is near chance, so the
# forgetting budget is opened, and month 2 (trained further from month 1's model on 80 new chats
# a month) may drift on the 12 items of a suite: the regression rule is run and reported, with
# room. So may its FP8 export, one item flipped in 12 being a drop no number of items here
# settles (a fresh-clone run: 0.750 against the merged model's 0.833, inconclusive, nothing
# registered); the demo serves the merged candidate, so the export is scored and reported and
# decides nothing, as in configs/demo-tasks.yaml. The gate's rules are tested on their own in
# tests/test_gate.py and tests/test_evaluate.py.
LOOP = {
    "train": PASSING_TRAIN,
    # Customers at a steady 8 requests a second: the 10 % arm still sees about 3 in each 4 s
    # analysis, and the served models are not kept busy by the test's own traffic (as fast as
    # they answered, the two months' releases cost as much CPU as their two retrains).
    "demo": {"requests_per_s": 8.0},
    "gate": {
        "primary_metric": "format_compliance",
        "min_gain": 0.05,
        "max_forgetting": 1.0,
        "max_regression": 1.0,
        "fp8_max_drop": None,
    },
}
# configs/demo.yaml, shorter: one 4 s analysis per step, every check on a handful of samples.
OVERLAY = {
    "release": {
        "steps": [10, 50, 100],
        "analysis_interval": 4.0,
        "analyses_per_step": 1,
        "failure_limit": 6,
        "max_extensions": 3,
        "min_requests": 1,
        "min_latency_samples": 1,
        "min_ttft_samples": 1,
        "max_badcase_rate_increase": 1.0,
        "max_latency_p99_ratio": 100.0,
        "max_ttft_p99_ratio": 100.0,
        "approval_timeout": 300,
        "loadtest": {
            "requests": 4,
            "concurrency": 2,
            "max_tokens": 8,
            "max_ttft_ratio": 100.0,
            "max_tpot_ratio": 100.0,
        },
    }
}


@pytest.fixture(scope="module")
def loop(
    tmp_path_factory: pytest.TempPathFactory, prefect_harness: None
) -> Iterator[tuple[Path, list[DemoMonth]]]:
    from prefect.settings import PREFECT_API_URL

    from flows import demo as demo_flow

    repo = copy_project(tmp_path_factory.mktemp("loop"))
    write_params(repo, LOOP)
    (repo / "configs").mkdir()
    (repo / "configs" / "demo.yaml").write_text(yaml.safe_dump(OVERLAY, sort_keys=False))
    # The demo puts its router's secrets and the Prefect address in this process's env, as
    # `tuneloop demo` does for its children: give the later tests the env they had.
    before = dict(os.environ)
    os.environ["PREFECT_API_URL"] = str(PREFECT_API_URL.value())  # the session's server
    try:
        history = demo_flow.run(repo, months=2, approval_wait_s=1.0)
    finally:
        os.environ.clear()
        os.environ.update(before)
    yield repo, history


def support(month: DemoMonth) -> TaskMonth:
    """The month of the project's one task."""
    assert list(month.tasks) == [TASK], month.tasks
    return month.tasks[TASK]


def registered(month: DemoMonth) -> Registration:
    retrain = support(month).retrain
    assert isinstance(retrain, PipelineRun), retrain
    assert retrain.registration is not None
    return retrain.registration


def versions(repo: Path) -> dict[int, ModelVersion]:
    client = MlflowClient(f"sqlite:///{repo / 'mlflow.db'}")
    return {int(v.version): v for v in client.search_model_versions(f"name = '{MODEL}'")}


def alias(repo: Path, name: str) -> int:
    client = MlflowClient(f"sqlite:///{repo / 'mlflow.db'}")
    return int(client.get_model_version_by_alias(MODEL, name).version)


def test_each_month_registers_a_candidate_after_the_base(
    loop: tuple[Path, list[DemoMonth]],
) -> None:
    repo, history = loop
    assert [month.month for month in history] == [1, 2]
    for month in history:
        registration = registered(month)
        assert registration.registered and registration.alias == "challenger", registration
    found = versions(repo)
    assert sorted(found) == [1, 2, 3]
    assert registry.TAG_BASE in found[1].tags  # the first champion: the base itself
    made = [registered(month).version for month in history]
    assert made == ["2", "3"]


def test_month_one_scored_its_champion_the_base_once(
    loop: tuple[Path, list[DemoMonth]],
) -> None:
    repo, _ = loop
    client = MlflowClient(f"sqlite:///{repo / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("tuneloop")
    assert experiment is not None
    evaluations = client.search_runs(
        [experiment.experiment_id],
        f"tags.`{TAG_STAGE}` = 'evaluate@support'",
        order_by=["attributes.start_time ASC"],
    )
    # Month 1's champion is the base (v1): its answers are the base's, not scored again.
    # Month 2's is the model month 1 released: scored on its own.
    found = [run.data.tags.get("evaluate.champion_is_base") for run in evaluations]
    assert found == ["true", "false"], found


def test_month_two_trained_from_the_champion_month_one_released(
    loop: tuple[Path, list[DemoMonth]],
) -> None:
    repo, history = loop
    first = support(history[0]).release
    assert first.outcome == "promoted", first
    found = versions(repo)
    # Month 1 started from the first champion, which is the registered base (v1).
    assert found[2].tags[init_from.TAG] == f"champion {MODEL} v1"
    assert found[3].tags[init_from.TAG] == f"champion {MODEL} v2"
    # Month 2 saw both months' pool batches, month 1's at the replay share.
    seen = init_from.split_batches(found[3].tags[init_from.TAG_BATCHES])
    new = init_from.split_batches(found[3].tags[init_from.TAG_NEW_BATCHES])
    assert set(init_from.split_batches(found[2].tags[init_from.TAG_BATCHES])) < set(seen)
    assert new and not set(new) & set(init_from.split_batches(found[2].tags[init_from.TAG_BATCHES]))
    params = load_params(repo / "params.yaml")
    assert float(found[3].tags[init_from.TAG_REPLAY]) == params.clean.replay_fraction


def test_month_two_was_judged_against_the_champion_and_its_fixed_badcases(
    loop: tuple[Path, list[DemoMonth]],
) -> None:
    repo, _ = loop
    decision = Decision.read(repo / "metrics" / "decision.json")
    assert decision.champion is not None and decision.champion.version == "2", decision.champion
    assert any("candidate" in r and "vs champion" in r for r in decision.reasons), decision
    # Month 1's corrections, scored for the champion (month 1's model) and the candidate; the
    # ones the champion answers right must stay right. (The tests' 40-step model answers few
    # exactly, so how many it fixed is not asserted; the rule's counting is test_gate's.)
    fixed = decision.fixed_badcases
    assert fixed.suite == "fixed_badcases" and fixed.items > 0, fixed
    assert fixed.max_broken_fixes is not None and fixed.broken <= fixed.max_broken_fixes
    assert fixed.status == "pass"
    assert any(r.startswith("fixed_badcases: the champion answers") for r in decision.reasons)


def test_router_feedback_reached_the_pool_with_arm_and_model_version(
    loop: tuple[Path, list[DemoMonth]],
) -> None:
    repo, history = loop
    pool = load_params(repo / "params.yaml").paths.pool
    records = [
        json.loads(line)
        for path in sorted((repo / pool / "records" / "support").glob("*.jsonl"))
        for line in path.read_text(encoding="utf-8").splitlines()
    ]
    feedback = [r for r in records if r["meta"].get("source") == "router-feedback"]
    assert feedback, "no router feedback in the pool"
    assert {r["meta"]["arm"] for r in feedback} <= {"champion", "challenger"}
    # Released in month 1 behind the router: the base (v1) and month 1's candidate (v2).
    assert {r["meta"]["model_version"] for r in feedback} <= {"1", "2"}
    assert all(r["corrected_response"] for r in feedback)
    month_2 = support(history[1]).retrain
    assert isinstance(month_2, PipelineRun) and month_2.data.by_source["router-feedback"] > 0


def test_both_releases_ran_as_flows_with_their_approver_recorded(
    loop: tuple[Path, list[DemoMonth]],
) -> None:
    repo, history = loop
    client = MlflowClient(f"sqlite:///{repo / 'mlflow.db'}")
    for month, version in zip(history, ("2", "3"), strict=True):
        release = support(month).release
        assert isinstance(release, DemoRelease), release
        assert release.outcome in {"promoted", "rolled_back"}, release
        assert release.demo_approvals, f"month {month.month}: nobody approved"
        tags = client.get_run(versions(repo)[int(version)].run_id).data.tags
        recorded = [v for k, v in tags.items() if k.startswith("release.approval.")]
        assert recorded and all("demo-operator" in v for v in recorded), tags
    # The champion alias is where the second release left it.
    if support(history[1]).release.outcome == "promoted":
        assert (alias(repo, "champion"), alias(repo, "previous-champion")) == (3, 2)
    else:
        assert alias(repo, "champion") == 2


def test_month_one_was_reviewed_blind_by_the_panel_and_its_release_showed_it(
    loop: tuple[Path, list[DemoMonth]], tmp_path: Path
) -> None:
    repo, history = loop
    review = support(history[0]).review
    assert review is not None and review.review == f"{MODEL}-v2"
    assert support(history[1]).review is None
    # Three reviewers, each through the page's HTTP API: every item, plus their controls.
    items = review.results.items
    assert set(review.votes_by_reviewer) == {"ana", "bo", "chen"}
    assert all(cast > items for cast in review.votes_by_reviewer.values()), review
    assert review.results.votes == 3 * items
    assert review.check is None  # gate.blind_review unset: reported, never blocking
    form = support(history[0]).release.approval_form
    assert f"Blind review: {review.summary}" in form and "| slice | votes |" in form
    client = MlflowClient(f"sqlite:///{repo / 'mlflow.db'}")
    candidate = versions(repo)[2]
    run = client.get_run(str(candidate.run_id))
    assert run.data.metrics["review.votes"] == 3 * items
    assert candidate.tags["review.result"] == review.summary
    # The demo tracked through its own MLflow server, which keeps artifacts as plain files:
    # the store alone reads them back once the server is gone.
    folder = Path(client.download_artifacts(str(candidate.run_id), "", str(tmp_path)))
    assert (folder / "review" / "results.png").is_file()
    assert "| all |" in (folder / "review" / "results.md").read_text(encoding="utf-8")
    card = (folder / "evaluation" / "model-card.md").read_text(encoding="utf-8")
    assert f"{review.summary}." in card
    summary = format_loop(list(history))
    assert f"  review   {review.summary}" in summary
    assert "--- task" not in summary  # one task: its month, no task headings


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium")
def test_the_mlflow_ui_compares_the_two_months(
    loop: tuple[Path, list[DemoMonth]], tmp_path: Path
) -> None:
    """The compare view of the task's two monthly runs (each in its month's retrain run),
    rendered by a real browser (the manual's picture of it comes from the demo:
    docs/screenshots.py)."""
    repo, history = loop
    client = MlflowClient(f"sqlite:///{repo / 'mlflow.db'}")
    runs = []
    for month in history:
        retrain = support(month).retrain
        assert isinstance(retrain, PipelineRun), retrain
        runs.append(retrain.mlflow_run_id)
    experiment = client.get_run(runs[0]).info.experiment_id
    ids = ",".join(f'"{run}"' for run in runs)
    with mlflow_server(f"sqlite:///{repo / 'mlflow.db'}") as base:
        page = f'{base}/#/compare-runs?runs=[{ids}]&experiments=["{experiment}"]'
        dom = chromium(page, tmp_path / "profile", "--dump-dom")
        for run in runs:
            assert client.get_run(run).info.run_name in dom, "a month is missing from the view"
        shot = tmp_path / "mlflow-compare.png"
        chromium(page, tmp_path / "profile2", f"--screenshot={shot}", "--window-size=1400,1000")
    assert shot.stat().st_size > 10_000
