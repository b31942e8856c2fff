"""The router's own guards: a weight bound to its arms, the release's lease, fast fail, restarts.

Real routers on loopback ports in front of the stub OpenAI backends of
``test_router.py``; the state file on disk, as in production.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from serving.config import RouterConfig
from serving.routing import FastFail, Lease, SavedState, load_state, save_state
from tests.router_helpers import (
    TOKEN,
    VERSIONS,
    ManualClock,
    backends,  # noqa: F401  (the two fake backends, module-scoped)
    chat,
    gate,  # noqa: F401
    looked,
    make_config,
    router_secrets,  # noqa: F401  (autouse: the request-id key and producer token)
    running_router,
    running_state,
    served_arm,
)

# The whole suite (`make test`): routers on uvicorn
pytestmark = pytest.mark.slow

HEADERS = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(autouse=True)
def admin_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TUNELOOP_ADMIN_TOKEN", TOKEN)


def with_versions(config: RouterConfig, champion: str, challenger: str) -> RouterConfig:
    """The same router redeployed with other model versions on its arms."""
    arms = {
        arm: a.model_copy(update={"model_version": v})
        for (arm, a), v in zip(config.arms.items(), (champion, challenger), strict=True)
    }
    return config.model_copy(update={"arms": arms})


def percent(client: httpx.Client) -> int:
    value: int = client.get("/admin/status", headers=HEADERS).json()["challenger_percent"]
    return value


# --- the weight belongs to the arms it was set for ---------------------------------------------


def test_a_promoted_weight_does_not_carry_over_to_new_arms(
    backends: dict[str, str], tmp_path: Path
) -> None:
    state_file = tmp_path / "state.json"
    config = make_config(backends, tmp_path, percent=0, state_file=state_file)
    with running_router(config) as client:
        r = client.post("/admin/weights", json={"challenger_percent": 100}, headers=HEADERS)
        assert r.status_code == 200
    saved = load_state(state_file)
    assert saved is not None and saved.challenger_percent == 100 and saved.arms == VERSIONS

    # Promoted: v8 becomes the champion arm and v9 the new challenger at the next deploy.
    redeployed = with_versions(config, "8", "9")
    with running_router(redeployed) as client:
        assert percent(client) == 0
        assert all(served_arm(chat(client, f"u{i}")) == "champion" for i in range(30))
        change = client.get("/admin/status", headers=HEADERS).json()["last_change"]
    assert change["action"] == "arms_changed"
    assert "starting at the config's challenger_percent 0" in change["reason"]

    # The same arms again: the saved weight wins over the config, as before.
    with running_router(config) as client:
        assert percent(client) == 100


def test_a_state_file_without_arms_never_carries_a_weight(
    backends: dict[str, str], tmp_path: Path
) -> None:
    state_file = tmp_path / "state.json"
    # What a router of the previous version left: a weight, no arms.
    state_file.write_text(json.dumps({"challenger_percent": 100, "reason": "promoted"}))
    config = make_config(backends, tmp_path, percent=0, state_file=state_file)
    with running_router(config) as client:
        assert percent(client) == 0


# --- the lease -------------------------------------------------------------------------------


def take(client: httpx.Client, holder: str, ttl: float, **extra: Any) -> httpx.Response:
    return client.post(
        "/admin/lease", json={"holder": holder, "ttl_s": ttl, **extra}, headers=HEADERS
    )


def test_a_lease_that_is_not_renewed_rolls_back_and_says_why(
    backends: dict[str, str], tmp_path: Path
) -> None:
    state_file = tmp_path / "state.json"
    config = make_config(backends, tmp_path, state_file=state_file)
    clock = ManualClock()
    with running_state(config, clock) as (client, state):
        assert take(client, "release-1", 1.5).status_code == 200
        client.post("/admin/weights", json={"challenger_percent": 10}, headers=HEADERS)
        # Renewed four times over 2 s of the router's clock: still held.
        for _ in range(4):
            clock.advance(0.5)
            assert take(client, "release-1", 1.5).status_code == 200
        # A little short of the lease, and the router has looked: still held.
        clock.advance(1.4)
        looked(state)
        assert percent(client) == 10
        # Another release cannot take it meanwhile.
        other = take(client, "release-2", 60)
        assert other.status_code == 409 and "release-1" in other.json()["detail"]
        # Silence past the lease: the router rolls back by itself at its next look.
        clock.advance(0.2)
        looked(state)
        status = client.get("/admin/status", headers=HEADERS).json()
    assert status["challenger_percent"] == 0
    assert status["lease"] is None
    assert status["last_change"]["action"] == "lease_lapsed"
    assert "release-1" in status["last_change"]["reason"]
    saved = load_state(state_file)
    assert saved is not None
    assert (saved.challenger_percent, saved.action, saved.lease) == (0, "lease_lapsed", None)
    assert "not renewed within 1.5 s" in saved.reason


def test_the_holder_ends_its_lease_and_the_weight_stays(
    backends: dict[str, str], tmp_path: Path
) -> None:
    clock = ManualClock()
    with running_state(make_config(backends, tmp_path), clock) as (client, state):
        assert take(client, "release-1", 1.0).status_code == 200
        client.post("/admin/weights", json={"challenger_percent": 100}, headers=HEADERS)
        wrong = client.post("/admin/lease/release", json={"holder": "release-2"}, headers=HEADERS)
        assert wrong.status_code == 409
        ended = client.post(
            "/admin/lease/release", json={"holder": "release-1", "reason": "promoted"},
            headers=HEADERS,
        )  # fmt: skip
        assert ended.status_code == 200 and ended.json()["lease"] is None
        clock.advance(1.5)  # past the old expiry
        looked(state)
        assert percent(client) == 100


def test_a_router_restarted_mid_release_restores_the_weight_while_the_lease_holds(
    backends: dict[str, str], tmp_path: Path
) -> None:
    state_file = tmp_path / "state.json"
    config = make_config(backends, tmp_path, state_file=state_file)
    with running_router(config) as client:
        take(client, "release-1", 30, fast_fail={"window": 10, "max_errors": 5})
        client.post("/admin/weights", json={"challenger_percent": 10}, headers=HEADERS)
    with running_router(config) as client:
        status = client.get("/admin/status", headers=HEADERS).json()
        assert status["challenger_percent"] == 10
        assert status["lease"]["holder"] == "release-1"
        assert status["lease"]["fast_fail"] == {"window": 10, "max_errors": 5}
        assert 25 < status["lease"]["seconds_left"] <= 30
        # The restored lease is live: the release renews it where it left off.
        assert take(client, "release-1", 30).status_code == 200


def test_a_restarted_router_reports_the_last_change_as_it_was_not_the_last_renewal(
    backends: dict[str, str], tmp_path: Path
) -> None:
    """The weight's change (from, to, when, why) survives a restart; renewals save the file
    too, and a restarted replica must not tell `tuneloop status` its weight changed then."""
    config = make_config(backends, tmp_path, state_file=tmp_path / "state.json")
    clock = ManualClock()
    with running_router(config, clock) as client:
        take(client, "release-1", 30)
        client.post(
            "/admin/weights", json={"challenger_percent": 10, "reason": "canary"}, headers=HEADERS
        )
        clock.advance(1.1)  # the renewal's time differs from the change's, to the second
        assert take(client, "release-1", 30).status_code == 200
        before = client.get("/admin/status", headers=HEADERS).json()["last_change"]
    with running_router(config, clock) as client:
        after = client.get("/admin/status", headers=HEADERS).json()["last_change"]
    assert (before["action"], before["from"], before["to"]) == ("weights", 0, 10), before
    assert after == before


def test_a_lease_that_lapsed_while_the_router_was_down_rolls_back_at_start(
    backends: dict[str, str], tmp_path: Path
) -> None:
    state_file = tmp_path / "state.json"
    save_state(
        state_file,
        SavedState(
            challenger_percent=50,
            arms=VERSIONS,
            action="weights",
            reason="approved by ann",
            lease=Lease("release-1", 60, time.time() - 5, FastFail(20, 10)),
        ),
    )
    with running_router(make_config(backends, tmp_path, state_file=state_file)) as client:
        status = client.get("/admin/status", headers=HEADERS).json()
    assert status["challenger_percent"] == 0 and status["lease"] is None
    assert status["last_change"]["action"] == "lease_lapsed"
    saved = load_state(state_file)
    assert saved is not None and (saved.challenger_percent, saved.action) == (0, "lease_lapsed")
    assert "while the router was down" in saved.reason


# --- fast fail -------------------------------------------------------------------------------


@pytest.fixture
def dead_url() -> Iterator[str]:
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
    try:
        yield f"http://127.0.0.1:{closed.getsockname()[1]}"
    finally:
        closed.close()


def test_a_burst_of_challenger_errors_rolls_back_in_the_router(
    backends: dict[str, str], tmp_path: Path, dead_url: str
) -> None:
    arms = {"champion": backends["champion"], "challenger": dead_url}
    # A refused connection fails at once; the default 2 s connect timeout could still fire
    # first on a busy machine (the router's loop starved for 2 s), a 504 where this counts 502s.
    state_file = tmp_path / "state.json"
    patient = {"connect": 30.0}
    config = make_config(arms, tmp_path, percent=100, state_file=state_file, timeouts=patient)
    with running_router(config) as client:
        # No lease, no fast fail: errors are only counted (the analysis judges them).
        assert [chat(client, f"u{i}").status_code for i in range(5)] == [502] * 5
        assert percent(client) == 100
        take(client, "release-1", 60, fast_fail={"window": 4, "max_errors": 3})
        codes = [chat(client, f"u{i}").status_code for i in range(3)]
        assert codes == [502, 502, 502]
        # The third error rolled back: the very next request reaches the champion.
        assert served_arm(chat(client, "u9")) == "champion"
        status = client.get("/admin/status", headers=HEADERS).json()
    assert status["challenger_percent"] == 0 and status["lease"] is None
    assert status["last_change"]["action"] == "fast_fail"
    assert "3 of the last 3 challenger requests failed" in status["last_change"]["reason"]
    saved = load_state(tmp_path / "state.json")
    assert saved is not None and (saved.challenger_percent, saved.action) == (0, "fast_fail")


def test_fast_fail_counts_backend_5xx_but_not_client_errors(
    backends: dict[str, str], tmp_path: Path
) -> None:
    with running_router(make_config(backends, tmp_path, percent=100)) as client:
        take(client, "release-1", 60, fast_fail={"window": 4, "max_errors": 2})
        assert chat(client, "u1", x_status=400).status_code == 400
        assert chat(client, "u1", x_status=422).status_code == 422
        assert chat(client, "u1", x_status=503).status_code == 503
        assert percent(client) == 100
        assert chat(client, "u1", x_status=500).status_code == 500
        assert percent(client) == 0
