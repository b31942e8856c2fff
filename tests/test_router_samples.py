"""The router's per-request samples and the shadow step's mirroring, on fake backends.

What the release's analysis reads: every finished request once, by cursor, with
its arm, latency, TTFT, error and counted badcase; and during the shadow step,
each mirrored request's two answers side by side while the user only ever gets
the champion's.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import httpx
import pytest

from serving.samples import completion_text, stream_text
from tests.router_helpers import (  # noqa: F401 (fixtures)
    PRODUCER,
    admin_token,
    backends,
    chat,
    gate,
    make_config,
    router_secrets,
    running_router,
    served_arm,
)
from tuneloop.release.readings import tally

# The whole suite (`make test`): routers on uvicorn
pytestmark = pytest.mark.slow


def samples(client: httpx.Client, headers: dict[str, str], since: int = 0, **query: Any) -> Any:
    reply = client.get("/admin/samples", params={"since": since, **query}, headers=headers)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_an_interval_reads_its_own_requests_by_cursor(
    backends: dict[str, str], tmp_path: Path, admin_token: dict[str, str]
) -> None:
    config = make_config(backends, tmp_path, percent=100, sample_memory=100)
    with running_router(config) as client:
        assert client.get("/admin/samples").status_code == 401
        start = samples(client, admin_token, since=2**62, limit=1)  # "from now on"
        assert (start["next"], start["items"]) == (0, [])
        for i in range(3):
            served_arm(chat(client, f"u{i}"))
        assert chat(client, "u0", x_status=503).status_code == 503
        client.post("/v1/chat/completions", json={"messages": [], "user": "u1", "stream": True})
        first = samples(client, admin_token, since=start["next"])
        # The next interval sees only what came after its cursor.
        served_arm(chat(client, "u2"))
        second = samples(client, admin_token, since=first["next"])
        # Paging: two at a time until the cursor reaches the last.
        page = samples(client, admin_token, since=0, limit=2)
        # More than the ring holds: the oldest are gone, and the reader is told so.
        for i in range(120):
            chat(client, f"v{i}")
        late = samples(client, admin_token, since=second["next"])
        bad = client.get("/admin/samples", params={"since": -1}, headers=admin_token)
    items = first["items"]
    assert [s["seq"] for s in items] == [1, 2, 3, 4, 5] and first["next"] == 5
    assert {s["arm"] for s in items} == {"challenger"}
    assert [s["error"] for s in items] == [None, None, None, "http_5xx", None]
    assert items[3]["latency_ms"] is None  # an error counts as an error, not as a latency
    assert all(s["latency_ms"] > 0 for s in items[:3])
    assert items[4]["ttft_ms"] is not None and items[0]["ttft_ms"] is None
    assert [s["seq"] for s in second["items"]] == [6]
    assert [s["seq"] for s in page["items"]] == [1, 2] and page["next"] == 2
    # 126 in all, the ring holds 27..126: 7..26 came after the cursor and are gone.
    assert late["dropped"] == 20 and len(late["items"]) == 100
    assert late["boot"] == first["boot"]
    assert bad.status_code == 422


def test_a_counted_badcase_marks_its_own_request_and_names_its_user_by_hash(
    backends: dict[str, str], tmp_path: Path, admin_token: dict[str, str]
) -> None:
    with running_router(make_config(backends, tmp_path, percent=100)) as client:
        replies = [chat(client, user) for user in ("ann", "ann", "bob")]
        for reply in replies:
            flag = {
                "messages": [{"role": "user", "content": "Can I return the Aurora kettle?"}],
                "bad_response": "no",
                "request_id": reply.headers["x-request-id"],
            }
            client.post("/v1/feedback", json=flag, headers=PRODUCER).raise_for_status()
        found = samples(client, admin_token)["items"]
    assert [s["badcase"] for s in found] == [True, True, True]
    # One user counts once in the analysis: it counts distinct user hashes, per interval.
    ann, again, bob = (s["user"] for s in found)
    assert ann == again != bob
    challenger = tally(found, 100, 0).arms["challenger"]
    assert (challenger.users, challenger.badcase_users, challenger.badcases) == (2, 2, 3)


def test_one_debug_line_per_request_and_none_above_debug(
    backends: dict[str, str], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with running_router(make_config(backends, tmp_path)) as client:
        with caplog.at_level(logging.INFO, logger="serving.router"):
            served_arm(chat(client, "u1"))
        assert not [r for r in caplog.records if r.name == "serving.router"]
        with caplog.at_level(logging.DEBUG, logger="serving.router"):
            reply = chat(client, "u1")
    lines = [r.getMessage() for r in caplog.records if r.name == "serving.router"]
    assert len(lines) == 1 and reply.headers["x-request-id"] in lines[0]
    assert "champion 200" in lines[0]


def test_shadow_mirrors_to_the_challenger_and_no_user_sees_its_answer(
    backends: dict[str, str], tmp_path: Path, admin_token: dict[str, str]
) -> None:
    with running_router(make_config(backends, tmp_path)) as client:
        assert client.post("/admin/shadow", json={"percent": 100}).status_code == 401
        assert (
            client.post("/admin/shadow", json={"percent": 101}, headers=admin_token).status_code
            == 400
        )
        status = client.post(
            "/admin/shadow", json={"percent": 100, "reason": "test"}, headers=admin_token
        ).json()
        assert (status["shadow_percent"], status["challenger_percent"]) == (100, 0)
        replies = [chat(client, f"u{i}", stream=i % 2 == 1) for i in range(10)]
        # Every answer, streamed or not, is the champion's, and so is every arm header.
        for i, reply in enumerate(replies):
            assert reply.status_code == 200
            assert reply.headers["x-tuneloop-arm"] == "champion"
            text = (stream_text if i % 2 else completion_text)(reply.content)
            assert text is not None and text.strip() == "served by champion"
            assert "challenger" not in reply.text
        pairs = wait_for_pairs(client, admin_token, 10)
        stats = client.get("/admin/stats", headers=admin_token).json()
        client.post("/admin/rollback", json={"reason": "stop"}, headers=admin_token)
        after = client.get("/admin/status", headers=admin_token).json()
    assert len(pairs) == 10
    for pair in pairs:
        assert pair["prompt"] == "Can I return the Aurora kettle?"
        assert pair["champion"]["text"].strip() == "served by champion"
        assert pair["challenger"]["text"] == "served by challenger"
        assert pair["challenger"]["error"] is None and pair["challenger"]["latency_ms"] > 0
    # Mirrored requests are no live traffic: the challenger's counters stay at zero.
    assert stats["arms"]["challenger"]["requests"] == 0
    assert after["shadow_percent"] == 0  # a rollback stops the mirroring too


def wait_for_pairs(client: httpx.Client, headers: dict[str, str], n: int) -> list[Any]:
    import time

    deadline = time.monotonic() + 10
    while True:
        page = client.get("/admin/shadow", params={"since": 0}, headers=headers).json()
        if len(page["items"]) >= n or time.monotonic() > deadline:
            return list(page["items"])
        time.sleep(0.05)


def test_a_dead_challenger_is_an_error_of_the_pair_only(
    backends: dict[str, str], tmp_path: Path, admin_token: dict[str, str]
) -> None:
    import socket

    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    dead = f"http://127.0.0.1:{closed.getsockname()[1]}"
    try:
        config = make_config({"champion": backends["champion"], "challenger": dead}, tmp_path)
        with running_router(config) as client:
            client.post("/admin/shadow", json={"percent": 100}, headers=admin_token)
            reply = chat(client, "u1")
            pairs = wait_for_pairs(client, admin_token, 1)
    finally:
        closed.close()
    assert served_arm(reply) == "champion"
    assert pairs[0]["challenger"]["error"] == "connect"
    assert pairs[0]["challenger"]["text"] is None
