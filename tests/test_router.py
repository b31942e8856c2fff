"""The canary router against real HTTP backends on 127.0.0.1.

Two small FastAPI apps stand in for vLLM: they speak the OpenAI chat and
completions protocol (SSE streaming included) and say which arm served. The
router runs on a uvicorn loopback port, as in production.
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from serving.app import create_app
from serving.config import RouterConfig, RouterConfigError, load_router_config
from serving.metrics import percentile
from serving.routing import SavedState, arm_for_bucket, bucket, load_state, save_state
from tests.router_helpers import (  # noqa: F401 (fixtures)
    MODELS,
    PRODUCER,
    PRODUCER_ENV,
    PRODUCER_TOKEN,
    PRODUCERS,
    SECRET,
    SECRET_ENV,
    TOKEN,
    VERSIONS,
    StreamGate,
    admin_token,
    backends,
    chat,
    fake_backend,
    gate,
    make_config,
    router_secrets,
    running_router,
    serve,
    served_arm,
)
from tuneloop.data.records import parse_record

# The whole suite (`make test`): routers on uvicorn
pytestmark = pytest.mark.slow

# --- pure parts -------------------------------------------------------------------------------


@given(st.text(min_size=1), st.integers(0, 100), st.integers(0, 100))
def test_ramping_up_never_moves_a_user_off_the_challenger(user: str, p1: int, p2: int) -> None:
    low, high = sorted((p1, p2))
    b = bucket(user)
    assert 0 <= b < 100
    assert bucket(user) == b
    if arm_for_bucket(b, low) == "challenger":
        assert arm_for_bucket(b, high) == "challenger"


def test_bucket_extremes() -> None:
    assert all(arm_for_bucket(b, 0) == "champion" for b in range(100))
    assert all(arm_for_bucket(b, 100) == "challenger" for b in range(100))


@given(st.lists(st.floats(0, 1e3), min_size=1, max_size=200), st.floats(0.01, 1.0))
def test_percentile_is_an_observed_value_with_the_right_rank(values: list[float], q: float) -> None:
    value = percentile(values, q)
    assert value in values
    assert sum(v <= value for v in values) >= q * len(values)
    assert sum(v < value for v in values) < q * len(values) or value == min(values)


def test_percentile_of_nothing_is_nan() -> None:
    assert math.isnan(percentile([], 0.5))


def test_config_needs_exactly_two_named_arms(tmp_path: Path) -> None:
    arm = {"base_url": "http://127.0.0.1:1", "model": "m", "model_version": "1"}
    with pytest.raises(ValueError, match="champion"):
        RouterConfig.model_validate({"arms": {"champion": arm}, "feedback_dir": tmp_path})
    path = tmp_path / "router.yaml"
    path.write_text(
        "arms:\n"
        "  champion: {base_url: http://a, model: m, model_version: '1'}\n"
        "  challenger: {base_url: http://b, model: m, model_version: '2'}\n"
        f"feedback_dir: {tmp_path}\n"
        "challenger_pct: 10\n"
    )
    with pytest.raises(RouterConfigError, match="challenger_pct"):
        load_router_config(path)


# --- through the router -----------------------------------------------------------------------


def test_split_follows_the_weight_and_users_stick(backends: dict[str, str], tmp_path: Path) -> None:
    with running_router(make_config(backends, tmp_path, percent=30)) as client:
        arms = {f"user-{i}": served_arm(chat(client, f"user-{i}")) for i in range(2000)}
        share = Counter(arms.values())["challenger"] / len(arms)
        assert abs(share - 0.30) < 0.03, share
        # The same users again, some through the X-User-Id header instead of the body.
        for user in list(arms)[:200]:
            assert served_arm(chat(client, user)) == arms[user]
            again = client.post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "hi"}]},
                headers={"X-User-Id": user},
            )
            assert served_arm(again) == arms[user]


def test_anonymous_requests_spread_by_weight(backends: dict[str, str], tmp_path: Path) -> None:
    with running_router(make_config(backends, tmp_path, percent=50)) as client:
        arms = Counter(served_arm(chat(client)) for _ in range(400))
    assert 0.40 < arms["challenger"] / 400 < 0.60, arms


def test_model_name_is_rewritten_per_arm(backends: dict[str, str], tmp_path: Path) -> None:
    for percent, arm in ((0, "champion"), (100, "challenger")):
        with running_router(make_config(backends, tmp_path, percent=percent)) as client:
            reply = chat(client, "u1")
            assert served_arm(reply) == arm
            assert reply.json()["model"] == MODELS[arm]
            legacy = client.post("/v1/completions", json={"model": "tuneloop", "prompt": "hi"})
            assert legacy.json()["model"] == MODELS[arm]
            assert legacy.json()["choices"][0]["text"] == f"served by {arm}"
            wrong = chat(client, "u1", model="gpt-4")
            assert wrong.status_code == 404
            assert wrong.json()["error"]["code"] == "model_not_found"
            models = client.get("/v1/models").json()
            assert [m["id"] for m in models["data"]] == ["tuneloop"]


def test_streaming_chunks_arrive_before_the_backend_finishes(
    backends: dict[str, str], tmp_path: Path, gate: StreamGate
) -> None:
    gate.release.clear()
    gate.finished.clear()
    with (
        running_router(make_config(backends, tmp_path, percent=100)) as client,
        client.stream(
            "POST",
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "stream": True, "x_gate": 1},
        ) as response,
    ):
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = response.iter_lines()
        first = next(line for line in events if line.startswith("data:"))
        # The backend is parked after its first chunk until we release it.
        assert not gate.finished.is_set()
        assert json.loads(first[5:])["model"] == MODELS["challenger"]
        gate.release.set()
        rest = [line for line in events if line.startswith("data:")]
    assert rest[-1] == "data: [DONE]"
    assert gate.finished.is_set()


def test_admin_needs_the_token_and_changes_nothing_without_it(
    backends: dict[str, str],
    tmp_path: Path,
    admin_token: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with running_router(make_config(backends, tmp_path, percent=10)) as client:
        bad_headers: list[dict[str, str]] = [
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": TOKEN},
            {"Authorization": f"Basic {TOKEN}"},
        ]
        for headers in bad_headers:
            r = client.post("/admin/weights", json={"challenger_percent": 90}, headers=headers)
            assert r.status_code == 401
            r = client.post("/admin/rollback", json={"reason": "x"}, headers=headers)
            assert r.status_code == 401
            assert client.get("/admin/status", headers=headers).status_code == 401
            assert client.get("/admin/stats", headers=headers).status_code == 401
        status = client.get("/admin/status", headers=admin_token).json()
        assert status["challenger_percent"] == 10
        assert status["last_change"] is None

        # An unset variable locks the admin API, even for the old token.
        monkeypatch.delenv("TUNELOOP_ADMIN_TOKEN")
        r = client.post("/admin/weights", json={"challenger_percent": 90}, headers=admin_token)
        assert r.status_code == 401
        monkeypatch.setenv("TUNELOOP_ADMIN_TOKEN", TOKEN)
        assert client.get("/admin/status", headers=admin_token).json()["challenger_percent"] == 10

        r = client.post("/admin/weights", json={"challenger_percent": 101}, headers=admin_token)
        assert r.status_code == 400
        assert "challenger_percent" in r.json()["detail"]
        r = client.post("/admin/weights", json={"challenger_percent": 25}, headers=admin_token)
        assert r.status_code == 200
        assert r.json()["weights"] == {"champion": 75, "challenger": 25}
        assert r.json()["arms"]["challenger"]["model_version"] == VERSIONS["challenger"]


def test_rollback_holds_from_the_next_request_and_survives_a_restart(
    backends: dict[str, str], tmp_path: Path, admin_token: dict[str, str]
) -> None:
    config = make_config(backends, tmp_path, percent=100, state_file=tmp_path / "state.json")
    with running_router(config) as client:
        assert served_arm(chat(client, "u1")) == "challenger"
        r = client.post("/admin/rollback", json={"reason": "error rate"}, headers=admin_token)
        assert r.status_code == 200
        assert r.json()["challenger_percent"] == 0
        assert r.json()["last_change"]["reason"] == "error rate"
        assert all(served_arm(chat(client, f"u{i}")) == "champion" for i in range(50))
    saved = load_state(tmp_path / "state.json")
    assert saved is not None and saved.challenger_percent == 0
    assert saved.reason == "error rate" and saved.arms == VERSIONS
    # The config still says 100; the saved rollback must win after a restart.
    with running_router(config) as client:
        assert served_arm(chat(client, "u1")) == "champion"


def test_a_weight_that_cannot_be_saved_is_refused_but_a_rollback_still_holds(
    backends: dict[str, str], tmp_path: Path, admin_token: dict[str, str]
) -> None:
    state_file = tmp_path / "blocker" / "state.json"
    config = make_config(backends, tmp_path, percent=100, state_file=state_file)
    with running_router(config) as client:
        (tmp_path / "blocker").write_text("a file where the state folder should be")
        r = client.post("/admin/weights", json={"challenger_percent": 20}, headers=admin_token)
        assert r.status_code == 500
        assert "weight unchanged" in r.json()["detail"]
        assert served_arm(chat(client, "u1")) == "challenger"
        r = client.post("/admin/rollback", json={"reason": "disk full"}, headers=admin_token)
        assert r.status_code == 500
        assert r.json()["challenger_percent"] == 0
        assert served_arm(chat(client, "u1")) == "champion"


def test_a_rollback_during_a_slow_weight_change_wins_at_once(
    backends: dict[str, str],
    tmp_path: Path,
    admin_token: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import serving.router_state

    def slow_save(path: Path, state: SavedState) -> None:
        time.sleep(0.5)  # a slow disk under the admin lock
        save_state(path, state)

    monkeypatch.setattr(serving.router_state, "save_state", slow_save)
    state_file = tmp_path / "state.json"
    config = make_config(backends, tmp_path, percent=100, state_file=state_file)

    async def race(url: str) -> tuple[int, int, str]:
        async with httpx.AsyncClient(base_url=url, timeout=10, headers=admin_token) as client:
            ramp = asyncio.create_task(
                client.post("/admin/weights", json={"challenger_percent": 60})
            )
            await asyncio.sleep(0.2)  # the ramp is now saving, holding the lock
            rollback = asyncio.create_task(client.post("/admin/rollback", json={"reason": "r"}))
            await asyncio.sleep(0.05)
            # The rollback has not answered yet (it waits to save), but it holds already.
            assert not rollback.done()
            probe = await client.post(
                "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
            )
            return (await ramp).status_code, (await rollback).status_code, probe.json()["arm"]

    with serve(create_app(config)) as url:
        assert asyncio.run(race(url)) == (409, 200, "champion")
        with httpx.Client(base_url=url, headers=admin_token) as client:
            assert client.get("/admin/status").json()["challenger_percent"] == 0
    saved = load_state(state_file)
    assert saved is not None and saved.challenger_percent == 0


def read_feedback(folder: Path) -> list[dict[str, Any]]:
    files = sorted(folder.glob("router-feedback-*.jsonl"))
    assert len(files) == 1, files
    return [json.loads(line) for line in files[0].read_text().splitlines()]


def test_feedback_is_attributed_only_by_the_routers_own_request_id(
    backends: dict[str, str], tmp_path: Path, admin_token: dict[str, str]
) -> None:
    feedback_dir = tmp_path / "incoming"
    with running_router(make_config(backends, feedback_dir, percent=100)) as client:
        reply = chat(client, "alice")
        flag = {
            "messages": [{"role": "user", "content": "Can I return the Aurora kettle?"}],
            "bad_response": "No.",
            "corrected_response": "[return] The Aurora kettle can be returned within 30 days.",
        }
        request_id = reply.headers["x-request-id"]

        def send(**extra: Any) -> httpx.Response:
            return client.post("/v1/feedback", json={**flag, **extra}, headers=PRODUCER)

        # The router's id; the completion's own id (not signed); the same id again; junk.
        by_request = send(request_id=request_id)
        by_completion = send(request_id=reply.json()["id"], tags=["fact"])
        again = send(request_id=request_id)
        unknown = send(request_id="nope")
        assert by_request.status_code == 201, by_request.text
        assert by_request.json() == {
            **by_request.json(),
            "arm": "challenger",
            "model_version": VERSIONS["challenger"],
            "attributed": True,
            "counted": True,
            "source": "support-tool",
        }
        for r, why in (
            (by_completion, "not a request id this router issued"),
            (again, "already flagged"),
            (unknown, "not a request id this router issued"),
        ):
            assert r.status_code == 201, r.text
            assert r.json()["arm"] is None and r.json()["attributed"] is False
            assert why in r.json()["why_not"]
        empty = send(messages=[])
        assert empty.status_code == 400
        assert "messages" in empty.json()["detail"]
        # What ingest would quarantine is refused now, with ingest's reason.
        ends_with_assistant = [*flag["messages"], {"role": "assistant", "content": "No."}]
        misordered = send(messages=ends_with_assistant)
        assert misordered.status_code == 422
        assert misordered.json()["kind"] == "wrong_turn_order"
        stats = client.get("/admin/stats", headers=admin_token).json()
    assert stats["arms"]["challenger"]["badcases"] == 1
    assert stats["arms"]["challenger"]["badcase_users"] == 1
    assert stats["arms"]["champion"]["badcases"] == 0

    lines = read_feedback(feedback_dir)
    assert len(lines) == 4
    for line in lines:
        parse_record(line)  # next month's ingest accepts every line as a badcase
        assert line["source"] == "router-feedback"
        assert line["messages"] == flag["messages"]
        assert line["bad_response"] == "No."
        assert line["corrected_response"] == flag["corrected_response"]
        assert line["created_at"].endswith("Z")
        assert "tuneloop.feedback.source=support-tool" in line["tags"]
    assert (lines[0]["arm"], lines[0]["model_version"]) == ("challenger", VERSIONS["challenger"])
    assert "unattributed" not in lines[0]["tags"]
    assert lines[1]["tags"] == ["fact", "tuneloop.feedback.source=support-tool", "unattributed"]
    for line in lines[1:]:
        assert line["arm"] is None and line["model_version"] is None
    assert set(lines[0]) == {
        "messages", "bad_response", "corrected_response", "source",
        "model_version", "arm", "created_at", "tags",
    }  # fmt: skip


def test_concurrent_feedback_never_interleaves_lines(
    backends: dict[str, str], tmp_path: Path
) -> None:
    producers = [{**PRODUCERS[0], "burst": 100}]
    config = make_config(backends, tmp_path, feedback_producers=producers)
    long_text = "x" * 20_000  # larger than a pipe buffer, so a torn write would show

    async def flood(url: str) -> list[int]:
        async with httpx.AsyncClient(base_url=url, timeout=10, headers=PRODUCER) as client:
            replies = await asyncio.gather(
                *(
                    client.post(
                        "/v1/feedback",
                        json={
                            "messages": [{"role": "user", "content": f"q{i}"}],
                            "bad_response": long_text,
                        },
                    )
                    for i in range(40)
                )
            )
        return [r.status_code for r in replies]

    with serve(create_app(config)) as url:
        assert asyncio.run(flood(url)) == [201] * 40
    lines = read_feedback(tmp_path)
    assert sorted(line["messages"][0]["content"] for line in lines) == sorted(
        f"q{i}" for i in range(40)
    )


def metric_samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_metrics_count_requests_and_errors_per_arm(
    backends: dict[str, str], tmp_path: Path, admin_token: dict[str, str]
) -> None:
    with running_router(make_config(backends, tmp_path, percent=100)) as client:
        for i in range(5):
            served_arm(chat(client, f"u{i}"))
        assert chat(client, "u1", x_status=503).status_code == 503
        streamed = client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "stream": True},
        )
        assert streamed.text.endswith("data: [DONE]\n\n")
        client.post("/admin/weights", json={"challenger_percent": 0}, headers=admin_token)
        served_arm(chat(client, "u1"))
        assert chat(client, "u1", x_status=400).status_code == 400  # the client's fault
        response = client.get("/metrics")
        stats = client.get("/admin/stats", headers=admin_token).json()

    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    samples = metric_samples(response.text)
    champion, challenger = (("arm", "champion"),), (("arm", "challenger"),)
    assert samples[("tuneloop_router_requests_total", challenger)] == 7
    assert samples[("tuneloop_router_requests_total", champion)] == 2
    assert samples[("tuneloop_router_errors_total", (*challenger, ("kind", "http_5xx")))] == 1
    assert samples[("tuneloop_router_errors_total", (*champion, ("kind", "http_5xx")))] == 0
    assert samples[("tuneloop_router_latency_seconds_count", challenger)] == 7
    assert samples[("tuneloop_router_ttft_seconds_count", challenger)] == 1
    assert samples[("tuneloop_router_challenger_percent", ())] == 0
    p99 = samples[("tuneloop_router_latency_seconds", (*challenger, ("quantile", "0.99")))]
    assert 0 < p99 < 5
    assert math.isnan(samples[("tuneloop_router_ttft_seconds", (*champion, ("quantile", "0.5")))])
    info = ("tuneloop_router_arm_info", (*challenger, ("model_version", "8")))
    assert samples[info] == 1

    arm = stats["arms"]["challenger"]
    assert arm["requests"] == 7
    assert arm["errors"] == 1
    assert arm["errors_by_kind"]["http_5xx"] == 1
    assert arm["model_version"] == VERSIONS["challenger"]
    assert 0 < arm["latency_ms"]["p50"] <= arm["latency_ms"]["p90"] <= arm["latency_ms"]["p99"]
    assert stats["arms"]["champion"]["ttft_ms"]["p50"] is None


def test_connection_errors_and_timeouts_are_counted(
    backends: dict[str, str], tmp_path: Path, admin_token: dict[str, str]
) -> None:
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    dead_url = f"http://127.0.0.1:{closed.getsockname()[1]}"  # bound, never listening
    try:
        config = make_config(
            {"champion": backends["champion"], "challenger": dead_url},
            tmp_path,
            percent=100,
            # The refused connect fails at once, within any connect timeout a busy machine needs.
            timeouts={"read": 0.3, "connect": 30.0},
        )
        with running_router(config) as client:
            down = chat(client, "u1")
            assert down.status_code == 502
            assert down.json()["error"]["code"] == "connect"
            client.post("/admin/rollback", json={"reason": "down"}, headers=admin_token)
            slow = chat(client, "u1", x_sleep=1.0)
            assert slow.status_code == 504
            # Like every other answer: which arm failed, and an id a support tool can flag.
            for reply, arm in ((down, "challenger"), (slow, "champion")):
                assert reply.headers["x-tuneloop-arm"] == arm
                assert reply.headers["x-request-id"].startswith("r1.")
            stats = client.get("/admin/stats", headers=admin_token).json()
    finally:
        closed.close()
    assert stats["arms"]["challenger"]["errors_by_kind"]["connect"] == 1
    assert stats["arms"]["champion"]["errors_by_kind"]["timeout"] == 1
    assert stats["arms"]["champion"]["error_rate"] == 1.0
