"""The release flow's shadow step end to end, on fake backends that answer in a set format.

A temp MLflow registry holds champion v1 and challenger v2; the router runs
in-process in front of two small OpenAI-compatible backends; traffic comes from
named users; the flow runs in a thread against the shared Prefect test server,
with ``release.shadow_percent`` at 100. What is checked:

- while the shadow step runs, every user gets the champion's answer and arm
  header (each response is looked at), and the comparison is on the candidate's
  MLflow run (metrics with p-values, the event log);
- a challenger that keeps the support desk's answer format passes the shadow
  step, and only then does the 10 % canary start;
- a challenger that breaks the format fails the shadow step: rolled back, no
  canary ever.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from serving.app import create_app
from serving.config import RouterConfig
from tests.helpers import write_params
from tests.registry_helpers import register_champion_and_challenger
from tests.router_helpers import (
    PRODUCER_ENV,
    PRODUCER_TOKEN,
    PRODUCERS,
    SECRET,
    SECRET_ENV,
    StreamGate,
    fake_backend,
    serve,
)
from tuneloop.cli import main as cli
from tuneloop.release import approval

# The whole suite (`make test`): the Prefect test server, routers
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "shadow-test-token"
HEADERS = {"Authorization": f"Bearer {TOKEN}"}
MODEL = "tuneloop-support"
IN_FORMAT = "[return] Yes, within 30 days."
RELEASE = {
    "admin_token_env": "TUNELOOP_ADMIN_TOKEN",
    "steps": [10, 50, 100],
    "analysis_interval": 2.0,
    "analyses_per_step": 1,
    "failure_limit": 2,
    "min_requests": 3,
    "min_latency_samples": 3,
    "min_ttft_samples": 1,
    "max_extensions": 1,
    # Both fake backends answer at once; latency differences here are the runner's noise.
    "max_latency_p99_ratio": 100.0,
    "max_ttft_p99_ratio": 100.0,
    "approval_timeout": 60,
    "shadow_percent": 100,
    "shadow": {"min_pairs": 10, "max_format_drop": 0.02},
    "loadtest": {
        "requests": 4,
        "concurrency": 1,
        "max_tokens": 4,
        "max_ttft_ratio": 1000.0,
        "max_tpot_ratio": 1000.0,
    },
}


@dataclass
class Seen:
    """Every response's arm header and answer, with the router's weights around it."""

    url: str
    replies: list[tuple[int, int, str, str]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        sent = 0
        with httpx.Client(base_url=self.url, timeout=10, trust_env=False) as client:
            while not self.stop.is_set():
                before = client.get("/admin/status", headers=HEADERS).json()
                body = {
                    "messages": [{"role": "user", "content": "Can I return the Aurora kettle?"}],
                    "user": f"user-{sent % 200}",
                }
                reply = client.post("/v1/chat/completions", json=body)
                after = client.get("/admin/status", headers=HEADERS).json()
                text = reply.json()["choices"][0]["message"]["content"]
                # Shadow on before and after: the request was served during the shadow step.
                shadowed = before["shadow_percent"] and after["shadow_percent"]
                self.replies.append(
                    (
                        int(shadowed),
                        after["challenger_percent"],
                        reply.headers["x-tuneloop-arm"],
                        text,
                    )
                )
                sent += 1

    @contextmanager
    def running(self) -> Iterator[Seen]:
        thread = threading.Thread(target=self.run, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self.stop.set()
            thread.join(timeout=30)


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TUNELOOP_ADMIN_TOKEN", TOKEN)
    monkeypatch.setenv(SECRET_ENV, SECRET)
    monkeypatch.setenv(PRODUCER_ENV, PRODUCER_TOKEN)


def run_release(tmp_path: Path, challenger_text: str, answer: bool) -> dict[str, Any]:
    """The release with the shadow step, champion answering in format, the challenger as told.

    ``answer``: reject at the first approval pause (the canary started) via the CLI.
    """
    from flows.release import release as release_flow
    from flows.release import release_outcome

    repo = tmp_path / "repo"
    repo.mkdir()
    client = register_champion_and_challenger(repo, MODEL)
    gate = StreamGate()
    with ExitStack() as stack:
        backends = {
            "champion": stack.enter_context(serve(fake_backend("champion", gate, IN_FORMAT))),
            "challenger": stack.enter_context(
                serve(fake_backend("challenger", gate, challenger_text))
            ),
        }
        arms = {
            arm: {"base_url": url, "model": f"{arm}-model", "model_version": version}
            for (arm, url), version in zip(backends.items(), ("1", "2"), strict=True)
        }
        config = RouterConfig.model_validate(
            {"arms": arms, "feedback_dir": tmp_path / "feedback", "feedback_producers": PRODUCERS}
        )
        url = stack.enter_context(serve(create_app(config)))
        write_params(
            repo,
            {
                "release": {**RELEASE, "routers": [url]},
                "paths": {
                    "eval_suites": str(ROOT / "eval"),
                    "fixed_badcases": str(ROOT / "data" / "fixed_badcases"),
                },
            },
        )
        seen = stack.enter_context(Seen(url).running())
        out: dict[str, Any] = {}

        def run() -> None:
            try:
                out["state"] = release_flow(repo, return_state=True)
            except BaseException as error:  # re-raised in the test thread
                out["error"] = error

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 120
        while thread.is_alive() and time.monotonic() < deadline:
            waiting = approval.waiting_releases()
            if answer and waiting:
                reject = ["reject", waiting[0]["id"], "--approver", "dana", "--comment", "enough"]
                assert cli(reject) == 0
                break
            time.sleep(0.3)
        thread.join(60)
        assert not thread.is_alive(), "the release flow did not finish"
        final = httpx.get(f"{url}/admin/status", headers=HEADERS, trust_env=False).json()
    if "error" in out:
        raise out["error"]
    state = out["state"]
    result = release_outcome(state)
    run_id = str(client.get_model_version(MODEL, "2").run_id)
    log = client.download_artifacts(run_id, f"release/{result.flow_run_id}.jsonl", str(tmp_path))
    return {
        "state": state,
        "result": result,
        "final": final,
        "replies": seen.replies,
        "events": [json.loads(line) for line in Path(log).read_text().splitlines()],
        "metrics": client.get_run(run_id).data.metrics,
    }


def no_user_saw_the_challenger(replies: list[tuple[int, int, str, str]]) -> int:
    shadowed = [(arm, text) for shadow, percent, arm, text in replies if shadow and percent == 0]
    assert shadowed, "no request was served during the shadow step"
    assert all(arm == "champion" and text == IN_FORMAT for arm, text in shadowed), shadowed[:3]
    return len(shadowed)


def test_a_challenger_in_format_passes_the_shadow_step_and_only_then_gets_the_canary(
    prefect_harness: None, env: None, tmp_path: Path
) -> None:
    found = run_release(tmp_path, "[warranty] The kettle has a 24-month warranty.", answer=True)
    assert no_user_saw_the_challenger(found["replies"]) >= 10
    kinds = [(h.kind, getattr(h, "percent", None)) for h in found["result"].history]
    shadow_analyses = [h for h in found["result"].history if h.kind == "shadow_analysis"]
    assert kinds[0] == ("shadow", 100) and ("shadow", 0) in kinds
    assert kinds.index(("shadow", 0)) < kinds.index(("shift", 10))
    assert shadow_analyses[-1].outcome == "pass"
    assert found["final"]["challenger_percent"] == 0  # the test rejected the canary
    # The comparison is on the candidate's run, with its figures and p-values.
    event = next(e for e in found["events"] if e["kind"] == "shadow_analysis")
    checks = {c["name"]: c for c in event["checks"]}
    assert checks["shadow_format_compliance"]["challenger"] == 1.0
    assert checks["shadow_format_compliance"]["p_value"] == 1.0
    assert event["figures"]["shadow.pairs"] >= 10
    metrics = found["metrics"]
    assert metrics["release.analysis.shadow_format_compliance.champion"] == 1.0
    assert "release.analysis.shadow_latency_ms.p_value" in metrics
    assert "release.shadow.challenger.answer_chars_median" in metrics


def test_a_challenger_that_breaks_the_answer_format_fails_the_shadow_step(
    prefect_harness: None, env: None, tmp_path: Path
) -> None:
    found = run_release(tmp_path, "Sure! The kettle has a 24-month warranty.", answer=False)
    no_user_saw_the_challenger(found["replies"])
    state, result = found["state"], found["result"]
    assert state.is_failed(), state
    assert result.outcome == "rolled_back"
    assert result.reason.startswith("shadow step:")
    assert "shadow_format_compliance" in result.reason
    assert result.failures == RELEASE["failure_limit"]
    assert "shift" not in {h.kind for h in result.history}  # no canary, ever
    assert {percent for _, percent, _, _ in found["replies"]} == {0}
    assert (found["final"]["challenger_percent"], found["final"]["shadow_percent"]) == (0, 0)
    assert found["metrics"]["release.analysis.shadow_format_compliance.challenger"] == 0.0
