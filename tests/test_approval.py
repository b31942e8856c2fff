"""``tuneloop approve | reject | status``: argument handling, refusals, and the status view.

The happy paths (answering a real paused release) run in ``test_release_flow.py``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from prefect import flow
from prefect.settings import PREFECT_API_URL, temporary_settings

from tests.conftest import write_params
from tests.test_router import TOKEN, StreamGate, fake_backend, make_config, running_router, serve
from tuneloop.cli import build_parser
from tuneloop.cli import main as cli
from tuneloop.release import approval


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
            assert cli(["status"]) == 0
            shown = capsys.readouterr().out
            assert cli(["status", "--json"]) == 0
            as_json = capsys.readouterr().out
    assert f"router    {url}: champion v7 75 %, challenger v8 25 %" in shown
    assert "champion  " in shown and "requests, errors 0.00%" in shown
    # No registry in this folder yet: said so, not a crash.
    assert "registry  registered model 'tuneloop-support'" in shown
    assert "no release is waiting for approval" in shown
    parsed = json.loads(as_json)
    assert parsed["routers"][url]["weights"] == {"champion": 75, "challenger": 25}
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
