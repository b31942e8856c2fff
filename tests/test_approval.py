"""``tuneloop approve | reject | status``: argument handling, refusals, and the status view.

The happy paths (answering a real paused release) run in ``test_release_flow.py``.
"""

from __future__ import annotations

import getpass
import json
import logging
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import mlflow
import pytest
from prefect import flow
from prefect.settings import PREFECT_API_URL, temporary_settings

from tests.helpers import write_params
from tests.registry_helpers import register_versions
from tests.router_helpers import (
    TOKEN,
    StreamGate,
    fake_backend,
    make_config,
    router_secrets,  # noqa: F401  (autouse: the request-id key and producer token)
    running_router,
    serve,
)
from tuneloop.cli import build_parser
from tuneloop.cli import main as cli
from tuneloop.release import approval

# The whole suite (`make test`): the Prefect test server
pytestmark = pytest.mark.slow


def test_the_cli_takes_approve_reject_and_status() -> None:
    parser = build_parser()
    args = parser.parse_args(["approve", "brave-otter", "--approver", "ann", "--percent", "30"])
    assert (args.flow_run, args.approver, args.percent, args.comment) == (
        "brave-otter",
        "ann",
        30,
        "",
    )
    args = parser.parse_args(["reject", "id-1", "--approver", "bo", "--comment", "off tone"])
    assert (args.flow_run, args.comment) == ("id-1", "off tone")
    assert parser.parse_args(["status", "--json"]).json
    args = parser.parse_args(["rollback", "--reason", "5xx burst"])
    assert (args.reason, args.operator) == ("5xx burst", getpass.getuser())
    for missing in (["approve", "x"], ["reject", "x", "--approver", "bo"]):
        with pytest.raises(SystemExit):
            parser.parse_args(missing)


def test_a_rejection_needs_a_reason(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["reject", "x", "--approver", "bo", "--comment", "  "]) == 1
    assert "needs a --comment" in capsys.readouterr().err


def test_answers_need_the_server_the_release_runs_on(capsys: pytest.CaptureFixture[str]) -> None:
    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        assert cli(["approve", "x", "--approver", "ann"]) == 1
    assert "PREFECT_API_URL" in capsys.readouterr().err


@flow(name="not-a-release")
def _finishes() -> int:
    return 1


def test_only_a_paused_run_can_be_answered(
    prefect_harness: None, capsys: pytest.CaptureFixture[str]
) -> None:
    state: Any = _finishes(return_state=True)
    run_id = str(state.state_details.flow_run_id)
    assert cli(["approve", run_id, "--approver", "ann"]) == 1
    assert "is not waiting for approval: Completed" in capsys.readouterr().err
    assert cli(["approve", "no-such-run", "--approver", "ann"]) == 1
    assert "none flow runs named 'no-such-run'" in capsys.readouterr().err
    assert approval.waiting_releases() == []


def test_status_shows_weights_figures_aliases_and_waiting_runs(
    prefect_harness: None,
    in_folder: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("TUNELOOP_ADMIN_TOKEN", TOKEN)
    gate = StreamGate()
    with (
        serve(fake_backend("champion", gate)) as champion,
        serve(fake_backend("challenger", gate)) as challenger,
    ):
        backends = {"champion": champion, "challenger": challenger}
        config = make_config(backends, in_folder / "feedback", percent=25)
        with running_router(config) as client:
            url = str(client.base_url).rstrip("/")
            write_params(in_folder, {"release": {"routers": [url]}})
            for user in range(20):
                body = {"model": "tuneloop", "messages": [{"role": "user", "content": "hi"}]}
                client.post("/v1/chat/completions", json={**body, "user": f"u{user}"})
            headers = {"Authorization": f"Bearer {TOKEN}"}
            lease = {"holder": "release-run-1", "ttl_s": 600}
            assert client.post("/admin/lease", json=lease, headers=headers).status_code == 200
            assert cli(["status"]) == 0
            shown = capsys.readouterr().out
            assert cli(["status", "--json"]) == 0
            as_json = capsys.readouterr().out
    assert f"router    {url}: champion v7 at 75 %, challenger v8 at 25 %" in shown
    # One table, figures right-aligned under their headers, "-" where there is none.
    table = [line.split() for line in shown.splitlines() if line.startswith(("arm ", "champ"))]
    assert table[0] == ["arm", "requests", "errors", "badcases", "p99", "latency", "p99", "TTFT"]
    assert table[1][0] == "champion" and table[1][2] == "0.00%"
    assert "n/a" not in shown and "challenger0" not in shown
    assert "lease: held by release-run-1 until " in shown
    # No registry in this folder yet: said so, not a crash.
    assert "registry  registered model 'tuneloop-support': no MLflow store at" in shown
    assert "no release is waiting for approval" in shown
    parsed = json.loads(as_json)
    assert parsed["routers"][url]["weights"] == {"champion": 75, "challenger": 25}
    assert parsed["routers"][url]["lease"]["holder"] == "release-run-1"
    assert parsed["arms"]["challenger"]["requests"] + parsed["arms"]["champion"]["requests"] == 20


def test_status_without_a_router_token_says_why(
    in_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TUNELOOP_ADMIN_TOKEN", raising=False)
    write_params(in_folder)
    from tuneloop.params import load_params

    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        text = approval.format_status(approval.status(load_params()))
    assert "routers   unavailable: $TUNELOOP_ADMIN_TOKEN is not set" in text
    assert "waiting   unknown: PREFECT_API_URL is not set" in text


def _release_under_way(folder: Path) -> str:
    """A registry whose challenger's run is tagged as a running release; that run's id."""
    client = register_versions(folder, "tuneloop-support", [{}])
    run_id = str(client.get_model_version("tuneloop-support", "1").run_id)
    client.set_registered_model_alias("tuneloop-support", "challenger", "1")
    client.set_tag(run_id, "release.status", "running")
    return run_id


def test_rollback_sets_every_router_to_0_and_records_who_and_why(
    in_folder: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv("TUNELOOP_ADMIN_TOKEN", TOKEN)
    headers = {"Authorization": f"Bearer {TOKEN}"}
    run_id = _release_under_way(in_folder)
    gate = StreamGate()
    with ExitStack() as stack:
        backends = {
            arm: stack.enter_context(serve(fake_backend(arm, gate)))
            for arm in ("champion", "challenger")
        }
        clients = [
            stack.enter_context(
                running_router(
                    make_config(
                        backends, in_folder / "feedback", state_file=in_folder / f"state{i}.json"
                    )
                )
            )
            for i in range(2)
        ]
        for client in clients:
            lease = {"holder": "release-run-1", "ttl_s": 600}
            client.post("/admin/lease", json=lease, headers=headers)
            client.post("/admin/weights", json={"challenger_percent": 30}, headers=headers)
        urls = [str(c.base_url).rstrip("/") for c in clients]
        write_params(in_folder, {"release": {"routers": urls}})
        with caplog.at_level(logging.WARNING, logger="serving.router"):
            assert cli(["rollback", "--reason", "pager: 5xx on v8", "--operator", "dana"]) == 0
        out = capsys.readouterr().out
        statuses = [c.get("/admin/status", headers=headers).json() for c in clients]
    assert "rolled back on 2 router(s)" in out and f"release's MLflow run {run_id}" in out
    for status in statuses:
        assert status["challenger_percent"] == 0 and status["lease"] is None
        change = status["last_change"]
        assert (change["action"], change["operator"], change["reason"]) == (
            "rollback",
            "dana",
            "pager: 5xx on v8",
        )
    for i in range(2):
        saved = json.loads((in_folder / f"state{i}.json").read_text())
        assert (saved["challenger_percent"], saved["operator"]) == (0, "dana")
    rollbacks = [r.getMessage() for r in caplog.records if "ROLLBACK" in r.getMessage()]
    assert len(rollbacks) == 2 and all("(by dana)" in m for m in rollbacks)
    tags = mlflow.MlflowClient(f"sqlite:///{in_folder / 'mlflow.db'}").get_run(run_id).data.tags
    assert (tags["release.rollback.operator"], tags["release.rollback.reason"]) == (
        "dana",
        "pager: 5xx on v8",
    )


def test_a_rollback_needs_a_reason_and_reachable_routers(
    in_folder: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TUNELOOP_ADMIN_TOKEN", TOKEN)
    write_params(in_folder, {"release": {"routers": ["http://127.0.0.1:9"]}})
    assert cli(["rollback", "--reason", " "]) == 1
    assert "needs a --reason" in capsys.readouterr().err
    assert cli(["rollback", "--reason", "incident"]) == 1
    assert "ROLLBACK DID NOT LAND" in capsys.readouterr().err


UNSETTLED = (
    "forgetting general_demo/accuracy: inconclusive, about 312 more items would settle it",
)


def test_an_approval_without_the_acknowledgement_of_unsettled_rules_is_refused() -> None:
    answer = {"decision": "approve", "approver": "lin", "next_percent": 50}
    with pytest.raises(approval.InvalidAnswer, match="tick acknowledge_inconclusive") as refused:
        approval.validate_answer(answer, 10, UNSETTLED)
    assert "about 312 more items would settle it" in str(refused.value)
    ticked = approval.validate_answer({**answer, "acknowledge_inconclusive": True}, 10, UNSETTLED)
    assert ticked.acknowledge_inconclusive and ticked.next_percent == 50
    # Nothing unsettled: no tick needed; a rejection never needs one.
    assert approval.validate_answer(answer, 10).decision == "approve"
    rejected = {"decision": "reject", "approver": "lin", "next_percent": 50, "comment": "no"}
    assert approval.validate_answer(rejected, 10, UNSETTLED).decision == "reject"


def test_the_form_asks_for_the_tick_and_the_cli_sends_it() -> None:
    form = approval.approval_form(10, 50, "figures")
    field = form.model_json_schema()["properties"]["acknowledge_inconclusive"]
    assert field["default"] is False and field["type"] == "boolean"
    args = build_parser().parse_args(
        ["approve", "run-1", "--approver", "lin", "--acknowledge-inconclusive"]
    )
    assert args.acknowledge_inconclusive is True


def test_status_lists_the_challengers_unsettled_rules_and_review() -> None:
    shown = approval.format_status(
        {
            "aliases": {"champion": "1", "challenger": "2"},
            "challenger_tags": {
                "gate.on_inconclusive": "warn",
                "gate.unsettled": "\n".join(UNSETTLED),
                "review.result": "blind review m1: 60 votes by 3 reviewers: PASS",
            },
            "waiting_for_approval": [],
        }
    )
    assert "registry  champion v1, challenger v2" in shown
    assert "review: blind review m1: 60 votes by 3 reviewers: PASS" in shown
    assert "unsettled: 1 rule(s) let through" in shown and "--acknowledge-inconclusive" in shown
    assert f"- {UNSETTLED[0]}" in shown
