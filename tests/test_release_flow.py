"""The release flow end to end on CPU: two ``transformers serve`` backends behind the router.

A real MLflow registry (a temp SQLite store) holds two versions of a logged model,
aliased ``champion`` and ``challenger``; the router runs in-process on a loopback
port; a traffic generator sends chat requests as 400 named users. The flow runs in
a thread against the shared Prefect test server, and the test answers its pauses
through the ``tuneloop`` CLI, as a person would.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any
from uuid import UUID

import httpx
import mlflow
import pytest
from mlflow.tracking import MlflowClient
from prefect.states import State

from serving.app import create_app
from serving.config import RouterConfig
from tests.helpers import write_params
from tests.registry_helpers import register_versions
from tests.router_helpers import (
    PRODUCER,
    PRODUCER_ENV,
    PRODUCER_TOKEN,
    PRODUCERS,
    SECRET,
    SECRET_ENV,
    serve,
)
from tuneloop.cli import main as cli
from tuneloop.net import free_port
from tuneloop.orchestration.flow_results import ReleaseOutcome
from tuneloop.release import approval, signoff
from tuneloop.release.backends import Backend, start_transformers_serve
from tuneloop.release.events import Analysis, ApprovalStep, Shift
from tuneloop.review import store as review_store
from tuneloop.review.store import ReviewItem, ReviewStore, create_invite, create_review

logger = logging.getLogger(__name__)

# The whole suite (`make test`): the Prefect test server, transformers serve
pytestmark = pytest.mark.slow

TOKEN = "release-test-token"
MODEL = "tuneloop-support"
USERS = [f"user-{i}" for i in range(400)]

# Short intervals and lenient latency ratios: two cores shared by two backends,
# the router, the Prefect server and the test make latencies noisy, and the
# thresholds under test here are error and badcase rates.
RELEASE = {
    "admin_token_env": "TUNELOOP_ADMIN_TOKEN",
    # The router runs in this process beside the flow and the traffic, sharing its GIL: on a
    # busy 2-core runner a page of samples took longer than the default 10 s to come back.
    "admin_timeout_s": 60,
    "steps": [10, 50, 100],
    # 4 s: at 10 % the canary needs min_requests of its own in each interval, and on a busy
    # 2-core runner the test traffic makes ~8 requests a second.
    "analysis_interval": 4.0,
    "analyses_per_step": 1,
    "failure_limit": 2,
    "min_requests": 3,
    "min_latency_samples": 3,
    "min_ttft_samples": 1,
    # At 10 % a 4 s interval holds ~3 canary requests, two of them streamed: let an
    # inconclusive analysis grow to 16 s before it counts as failed.
    "max_extensions": 3,
    "max_error_rate_increase": 0.05,
    "max_badcase_rate_increase": 0.05,
    # Two CPU backends on a busy 2-core runner differ by more than any real canary
    # would; these tests are about approvals and rollbacks, so latency gates are loose
    # here (their logic is tested with planted figures in test_release.py).
    "max_latency_p99_ratio": 100.0,
    "max_ttft_p99_ratio": 100.0,
    "approval_timeout": 60,
    "loadtest": {
        "enabled": True,
        "requests": 8,
        "concurrency": 2,
        "max_tokens": 8,
        "max_ttft_ratio": 1000.0,
        "max_tpot_ratio": 1000.0,
    },
}


# --- fixtures: models, backends, registry ------------------------------------------------------


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from tuneloop.demo.domain import tokenizer_corpus
    from tuneloop.demo.tiny import save_tiny
    from tuneloop.params import TinyModel

    shape = TinyModel(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=128, vocab_size=600, max_position_embeddings=512,
    )  # fmt: skip
    folder = tmp_path_factory.mktemp("models")
    corpus = list(tokenizer_corpus(0))
    # Two versions of one model: same shape and tokenizer, different weights.
    out = {"1": folder / "v1", "2": folder / "v2"}
    for seed, path in enumerate(out.values()):
        save_tiny(path, shape, corpus, seed=seed)
    return out


@pytest.fixture(scope="module")
def stack(
    models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Path, dict[str, Backend]]]:
    """(project folder with its MLflow registry, the two running backends)."""
    folder = tmp_path_factory.mktemp("release-repo")
    # Backends load (~16 s) while the registry is written, then both must be healthy.
    started = {
        arm: start_transformers_serve(models[version], free_port(), folder / f"{arm}.log", 1)
        for arm, version in (("champion", "1"), ("challenger", "2"))
    }
    try:
        # Each version's artifact is the folder its backend serves.
        register_versions(folder, MODEL, [{"model_dir": str(models[v])} for v in ("1", "2")])
        for arm, backend in started.items():
            waited = backend.wait_healthy(timeout=180)
            logger.info("%s backend healthy after %.1f s", arm, waited)
        yield folder, started
    finally:
        for backend in started.values():
            backend.stop()


@pytest.fixture
def repo(stack: tuple[Path, dict[str, Backend]]) -> Path:
    return stack[0]


@pytest.fixture
def backends(stack: tuple[Path, dict[str, Backend]]) -> dict[str, Backend]:
    return stack[1]


@pytest.fixture
def aliases(repo: Path) -> MlflowClient:
    """Champion v1, challenger v2, as before every release."""
    client = MlflowClient(f"sqlite:///{repo / 'mlflow.db'}")
    for alias in ("previous-champion", "challenger"):
        with contextlib.suppress(mlflow.exceptions.MlflowException):  # not set: nothing to do
            client.delete_registered_model_alias(MODEL, alias)
    client.set_registered_model_alias(MODEL, "champion", "1")
    client.set_registered_model_alias(MODEL, "challenger", "2")
    return client


# --- the router and traffic --------------------------------------------------------------------


@contextmanager
def router(backends: dict[str, Backend], feedback: Path) -> Iterator[str]:
    arms = {
        arm: {"base_url": b.url, "model": b.model, "model_version": version}
        for (arm, b), version in zip(backends.items(), ("1", "2"), strict=True)
    }
    # The traffic flags every challenger answer in some tests: no rate limit in the way.
    producers = [{**PRODUCERS[0], "rate_per_minute": 600_000, "burst": 10_000}]
    config = RouterConfig.model_validate(
        {"arms": arms, "feedback_dir": feedback, "feedback_producers": producers}
    )
    with serve(create_app(config)) as url:
        yield url


@dataclass
class Traffic:
    """Chat requests as named users, in batches of 10 bracketed by two reads of the weight.

    A batch counts toward a weight only when the weight was the same before and
    after it, so the observed split is never smeared across a change. With
    ``plant_badcases``, every challenger answer is flagged through /v1/feedback.
    """

    url: str
    plant_badcases: bool = False
    max_requests: int = 20_000  # bounded, whatever happens to the test
    seen: list[tuple[int, str, str]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    errors: list[str] = field(default_factory=list)

    def run(self) -> None:
        headers = {"Authorization": f"Bearer {TOKEN}"}
        sent = 0
        with httpx.Client(base_url=self.url, timeout=30, trust_env=False) as client:
            while not self.stop.is_set() and sent < self.max_requests:
                before = client.get("/admin/status", headers=headers).json()["challenger_percent"]
                batch = []
                for _ in range(10):
                    user = USERS[sent % len(USERS)]
                    # Two requests in three stream, so the router measures TTFT on both arms
                    # (3 does not divide the user count: every user streams now and then).
                    batch.append((user, self._chat(client, user, stream=sent % 3 != 2)))
                    sent += 1
                after = client.get("/admin/status", headers=headers).json()["challenger_percent"]
                if before == after:
                    self.seen.extend((before, user, arm) for user, arm in batch if arm)

    def _chat(self, client: httpx.Client, user: str, stream: bool) -> str:
        body = {
            "model": "tuneloop",
            "messages": [{"role": "user", "content": "Can I return the Aurora kettle?"}],
            "max_tokens": 2,
            "user": user,
            "stream": stream,
        }
        reply = client.post("/v1/chat/completions", json=body)
        if reply.status_code != 200:
            self.errors.append(f"{reply.status_code}: {reply.text[:200]}")
            return ""
        arm = reply.headers["x-tuneloop-arm"]
        if self.plant_badcases and arm == "challenger":
            flag = {
                "messages": body["messages"],
                "bad_response": "Sorry, I cannot help with that.",
                "corrected_response": "[return] Yes, within 30 days.",
                "request_id": reply.headers["x-request-id"],
            }
            client.post("/v1/feedback", json=flag, headers=PRODUCER).raise_for_status()
        return arm

    @contextmanager
    def running(self) -> Iterator[Traffic]:
        thread = threading.Thread(target=self.run, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self.stop.set()
            thread.join(timeout=60)

    def split(self) -> dict[int, tuple[int, float]]:
        """Per weight: (requests, observed challenger share)."""
        by_percent: dict[int, Counter[str]] = defaultdict(Counter)
        for percent, _, arm in self.seen:
            by_percent[percent][arm] += 1
        return {
            p: (sum(c.values()), c["challenger"] / sum(c.values())) for p, c in by_percent.items()
        }


# --- running the flow --------------------------------------------------------------------------


@dataclass
class FlowThread:
    thread: threading.Thread
    out: dict[str, Any]

    def state(self, timeout: float = 120) -> State[Any]:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the release flow did not finish"
        if "error" in self.out:
            raise self.out["error"]
        state: State[Any] = self.out["state"]
        return state


def release_outcome(state: State[Any]) -> ReleaseOutcome:
    from flows.release import release_outcome as outcome

    return outcome(state)


def start_release(
    repo: Path, router_url: str, gate: dict[str, Any] | None = None, **release: Any
) -> FlowThread:
    from flows.release import release as release_flow

    overrides = {"release": {**RELEASE, "routers": [router_url], **release}}
    write_params(repo, overrides | ({"gate": gate} if gate else {}))
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["state"] = release_flow(repo, return_state=True)
        except BaseException as error:  # re-raised in the test thread
            out["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return FlowThread(thread, out)


def wait_paused(flow: FlowThread, timeout: float = 90) -> str:
    """The id of the release run waiting for approval."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        waiting = approval.waiting_releases()
        if waiting:
            assert len(waiting) == 1, waiting
            return waiting[0]["id"]
        assert flow.thread.is_alive(), f"flow ended before pausing: {flow.out}"
        time.sleep(0.3)
    raise AssertionError("the release flow never paused for approval")


def _seconds(start: str, end: str) -> float:
    def parse(at: str) -> datetime:
        return datetime.fromisoformat(at.replace("Z", "+00:00"))

    return (parse(end) - parse(start)).total_seconds()


def router_status(url: str) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    status: dict[str, Any] = httpx.get(
        f"{url}/admin/status", headers=headers, trust_env=False
    ).json()
    return status


def events(repo: Path, client: MlflowClient, flow_run_id: str) -> list[dict[str, Any]]:
    run_id = client.get_model_version(MODEL, "2").run_id
    assert run_id is not None
    path = client.download_artifacts(run_id, f"release/{flow_run_id}.jsonl", str(repo / "dl"))
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


@pytest.fixture
def token(monkeypatch: pytest.MonkeyPatch) -> None:
    """The admin token, the routers' request-id key and the feedback producer's token."""
    monkeypatch.setenv("TUNELOOP_ADMIN_TOKEN", TOKEN)
    monkeypatch.setenv(SECRET_ENV, SECRET)
    monkeypatch.setenv(PRODUCER_ENV, PRODUCER_TOKEN)


# --- tests -------------------------------------------------------------------------------------


def test_canary_ramps_with_cli_approvals_and_promotes(
    prefect_harness: None,
    backends: dict[str, Backend],
    repo: Path,
    aliases: MlflowClient,
    token: None,
    tmp_path: Path,
) -> None:
    with router(backends, tmp_path / "feedback") as url, Traffic(url).running() as traffic:
        flow = start_release(repo, url)
        approved = []
        for approver, percent in (("alice", 10), ("bob", 50)):
            run_id = wait_paused(flow)
            # The pause holds the weight: let the traffic reach the requests the split check
            # below needs at it (on a busy machine an analysis interval may see fewer), well
            # within the approval timeout.
            deadline = time.monotonic() + 40
            while traffic.split().get(percent, (0, 0.0))[0] < 50 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert cli(["approve", run_id, "--approver", approver, "--comment", "looks fine"]) == 0
            approved.append(run_id)
            # Wait for the ramp before looking for the next pause.
            deadline = time.monotonic() + 30
            while approval.waiting_releases() and time.monotonic() < deadline:
                time.sleep(0.2)
        state = flow.state()
        time.sleep(1.0)  # a few batches at 100 %
    assert state.is_completed(), state
    result = state.result()
    assert result.outcome == "promoted"
    assert [h.percent for h in result.history if isinstance(h, Shift)] == [10, 50, 100]
    assert [h.approver for h in result.history if isinstance(h, ApprovalStep)] == ["alice", "bob"]

    # The registry: the candidate is champion, the old champion kept for an instant return.
    found = aliases.get_registered_model(MODEL).aliases
    assert {k: str(v) for k, v in found.items()} == {"champion": "2", "previous-champion": "1"}

    # The observed split at each weight, from the test's own traffic.
    split = traffic.split()
    logger.warning("observed split: %s", split)
    for percent in (10, 50):
        n, share = split[percent]
        assert n >= 50, split
        assert abs(share * 100 - percent) <= 8, split
    assert split[100][1] == 1.0
    assert not traffic.errors, traffic.errors[:3]

    # Sticky: one arm per user at a given weight, and a ramp only ever adds users.
    arms: dict[tuple[int, str], set[str]] = defaultdict(set)
    for percent, user, arm in traffic.seen:
        arms[percent, user].add(arm)
    assert all(len(a) == 1 for a in arms.values())
    for user in USERS:
        on = [arms[p, user] for p in (0, 10, 50, 100) if (p, user) in arms]
        flat = [next(iter(a)) for a in on]
        assert flat == sorted(flat, key=lambda a: a == "challenger"), (user, flat)

    # Everything is on the candidate's run.
    recorded = events(repo, aliases, approved[0])
    kinds = [e["kind"] for e in recorded]
    # The blind review's place comes before the first traffic: here there is none, and the
    # release says so ("no blind review ..."), then load-tests.
    assert kinds[:3] == ["start", "review", "loadtest"]
    assert kinds.count("approval") == 2 and kinds[-1] == "promote"
    run = aliases.get_run(str(aliases.get_model_version(MODEL, "2").run_id))
    assert run.data.tags["release.status"] == "promoted"
    assert "release.loadtest.challenger.ttft_p50_ms" in run.data.metrics


def test_badcases_on_the_canary_roll_back_by_themselves(
    prefect_harness: None,
    backends: dict[str, Backend],
    repo: Path,
    aliases: MlflowClient,
    token: None,
    tmp_path: Path,
) -> None:
    with (
        router(backends, tmp_path / "feedback") as url,
        Traffic(url, plant_badcases=True).running() as traffic,
    ):
        flow = start_release(repo, url)
        state = flow.state()
        time.sleep(0.5)  # a few batches after the rollback
        final = router_status(url)
    assert state.is_failed(), state
    result = release_outcome(state)
    assert result.outcome == "rolled_back"
    # Every decided analysis failed; an inconclusive one (too few canary requests on a busy
    # runner) only extended its interval.
    analyses = [h for h in result.history if isinstance(h, Analysis) and h.kind == "analysis"]
    decided = [h for h in analyses if not h.extended]
    assert result.failures == RELEASE["failure_limit"] == len(decided)
    assert all(h.outcome != "pass" for h in analyses)
    assert "badcase_rate" in result.reason
    assert result.rollback_seconds < 1.0
    assert final["challenger_percent"] == 0
    # By itself, within failure_limit intervals of the canary (plus bookkeeping).
    recorded = {e["kind"]: e for e in events(repo, aliases, result.flow_run_id)}
    took = _seconds(recorded["shift"]["at"], recorded["rollback"]["at"])
    logger.warning(
        "canary -> rollback in %.1f s; rollback call %.3f s", took, result.rollback_seconds
    )
    assert took <= len(analyses) * RELEASE["analysis_interval"] + 4
    # After the rollback every request went to the champion.
    assert {arm for percent, _, arm in traffic.seen if percent == 0} == {"champion"}
    assert {k: str(v) for k, v in aliases.get_registered_model(MODEL).aliases.items()} == {
        "champion": "1",
        "challenger": "2",
    }
    run = aliases.get_run(str(aliases.get_model_version(MODEL, "2").run_id))
    assert run.data.tags["release.status"] == "rolled_back"


def test_no_answer_rolls_back_at_the_timeout(
    prefect_harness: None,
    backends: dict[str, Backend],
    repo: Path,
    aliases: MlflowClient,
    token: None,
    tmp_path: Path,
) -> None:
    with router(backends, tmp_path / "feedback") as url, Traffic(url).running() as traffic:
        flow = start_release(repo, url, approval_timeout=5)
        wait_paused(flow)
        state = flow.state()
        final = router_status(url)
    # Prefect fails a run whose pause timed out, even though the flow rolled back.
    assert state.is_failed(), state
    assert final["challenger_percent"] == 0
    assert max(percent for percent, _, _ in traffic.seen) == 10  # never ramped
    run = aliases.get_run(str(aliases.get_model_version(MODEL, "2").run_id))
    assert run.data.tags["release.status"] == "rolled_back"
    assert run.data.tags["release.reason"] == "no approval within 5 s at 10 %"
    assert aliases.get_model_version_by_alias(MODEL, "champion").version in ("1", 1)


def test_a_rejection_rolls_back_and_a_bad_answer_changes_nothing(
    prefect_harness: None,
    backends: dict[str, Backend],
    repo: Path,
    aliases: MlflowClient,
    token: None,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    with router(backends, tmp_path / "feedback") as url, Traffic(url).running():
        flow = start_release(repo, url)
        run_id = wait_paused(flow)
        assert cli(["approve", run_id, "--approver", "carol", "--percent", "150"]) == 1
        assert "out of range" in capsys.readouterr().err
        assert cli(["approve", run_id, "--approver", "carol", "--percent", "5"]) == 1
        assert router_status(url)["challenger_percent"] == 10
        assert approval.waiting_releases()[0]["id"] == run_id  # still waiting
        assert cli(["reject", run_id, "--approver", "carol", "--comment", "tone is off"]) == 0
        state = flow.state()
        final = router_status(url)
    assert state.is_failed(), state
    assert state.message == "release rolled back: rejected by carol at 10 %: tone is off"
    assert final["challenger_percent"] == 0
    assert final["last_change"]["reason"].startswith("rejected by carol")


def test_a_canary_that_fails_while_waiting_for_approval_rolls_back(
    prefect_harness: None,
    backends: dict[str, Backend],
    repo: Path,
    aliases: MlflowClient,
    token: None,
    tmp_path: Path,
) -> None:
    with router(backends, tmp_path / "feedback") as url, Traffic(url).running() as traffic:
        flow = start_release(repo, url)
        wait_paused(flow)
        traffic.plant_badcases = True  # the canary goes bad while nobody has answered yet
        state = flow.state()
        final = router_status(url)
        assert not approval.waiting_releases()
    assert state.is_failed(), state
    result = release_outcome(state)
    assert result.outcome == "rolled_back"
    assert "badcase_rate" in result.reason
    assert result.failures == RELEASE["failure_limit"]
    assert final["challenger_percent"] == 0
    assert {k: str(v) for k, v in aliases.get_registered_model(MODEL).aliases.items()} == {
        "champion": "1",
        "challenger": "2",
    }


def test_with_blind_review_set_no_traffic_moves_until_the_review_is_settled(
    prefect_harness: None,
    backends: dict[str, Backend],
    repo: Path,
    aliases: MlflowClient,
    token: None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # A review of v2 against v1 in its own store, as `tuneloop review create` makes one.
    monkeypatch.setenv("TUNELOOP_REVIEW_DB", f"sqlite:///{tmp_path / 'review.db'}")
    store = ReviewStore()
    name = signoff.review_name(MODEL, "2")
    items = [
        ReviewItem(f"question {i}?", f"champion answer {i}", f"candidate answer {i}")
        for i in range(4)
    ]
    create_review(store, name, items, champion=f"{MODEL} v1", candidate=f"{MODEL} v2", controls=0)
    gate = {"blind_review": {"min_votes": 4, "margin": 0.1}}
    with router(backends, tmp_path / "feedback") as url, Traffic(url).running() as traffic:
        flow = start_release(repo, url, gate=gate)
        run_id = wait_paused(flow)
        # Paused for the review, before the load test and the lease: no challenger traffic.
        assert router_status(url)["challenger_percent"] == 0
        assert router_status(url).get("lease") is None
        # Not a step to approve or reject: the run waits for its reviewers.
        assert cli(["reject", run_id, "--approver", "dana", "--comment", "no"]) == 1
        assert "waits for its blind review" in capsys.readouterr().err
        # "Done" too early: judged again, still too few votes, and it pauses again.
        paused = paused_state(run_id)
        assert cli(["approve", run_id, "--approver", "dana"]) == 0
        assert "its blind review is judged again" in capsys.readouterr().out
        wait_paused_again(flow, run_id, paused)
        assert router_status(url)["challenger_percent"] == 0
        # One reviewer prefers the candidate on every item: 4 of 4, a clear win.
        reviewer = review_store.reviewer_of(store, create_invite(store, "rita", review=name).token)
        while (page := review_store.next_page(store, reviewer)) is not None:
            choice = "a" if page.answer_a.startswith("candidate") else "b"
            review_store.record_vote(store, reviewer, page.key, page.nonce, choice, "")
        assert cli(["approve", run_id, "--approver", "dana"]) == 0
        # Settled: the load test runs and the canary takes its first step.
        deadline = time.monotonic() + 120
        while router_status(url)["challenger_percent"] != 10:
            assert time.monotonic() < deadline and flow.thread.is_alive(), flow.out
            time.sleep(0.5)
        step_run = wait_paused(flow)
        assert cli(["reject", step_run, "--approver", "dana", "--comment", "enough"]) == 0
        state = flow.state()
    store.close()
    assert state.is_failed(), state  # rejected at 10 %
    assert max(percent for percent, _, _ in traffic.seen) == 10
    run = aliases.get_run(str(aliases.get_model_version(MODEL, "2").run_id))
    logged = events(repo, aliases, str(state.state_details.flow_run_id))
    reviews = [e for e in logged if e["kind"] == "review"]
    assert [e["check"]["status"] for e in reviews] == ["inconclusive", "inconclusive", "pass"]
    kinds = [e["kind"] for e in logged]
    assert kinds.index("review") < kinds.index("loadtest") < kinds.index("lease")
    assert run.data.metrics["review.votes"] == 4.0
    assert run.data.tags["review.status"] == "pass"
    shown = aliases.get_model_version(MODEL, "2").tags[signoff.TAG_REVIEW]
    assert "4 votes by 1 reviewers" in shown


def paused_state(run_id: str) -> str:
    """The id of the paused state run ``run_id`` is in."""
    from prefect import get_client

    with get_client(sync_client=True) as client:
        state = client.read_flow_run(UUID(run_id)).state
    assert state is not None and state.is_paused(), state
    return str(state.id)


def wait_paused_again(flow: FlowThread, run_id: str, before: str, timeout: float = 60) -> None:
    """Until run ``run_id``, answered in paused state ``before``, has run and paused again."""
    from prefect import get_client

    deadline = time.monotonic() + timeout
    with get_client(sync_client=True) as client:
        while time.monotonic() < deadline:
            state = client.read_flow_run(UUID(run_id)).state
            assert flow.thread.is_alive(), f"flow ended: {flow.out}"
            if state is not None and state.is_paused() and str(state.id) != before:
                return
            time.sleep(0.3)
    raise AssertionError("the release did not pause again for its review")
