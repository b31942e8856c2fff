"""The release controller's pure judgement, the load test, and the routers' admin client.

Fast: no model, no Prefect server. The flow itself runs end to end in
``test_release_flow.py``.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from prefect.input import RunInput

from serving.metrics import new_stats
from tests.helpers import write_params
from tests.router_helpers import (
    SECRET_ENV,
    TOKEN,
    StreamGate,
    fake_backend,
    make_config,
    router_secrets,  # noqa: F401  (autouse: the request-id key and producer token)
    running_router,
    serve,
)
from tuneloop.params import ParamsError, ReleaseParams, load_params, parse_params
from tuneloop.release.admin import AdminError, LeaseKeeper, RouterAdmin
from tuneloop.release.analysis import (
    Approval,
    ArmFigures,
    InvalidAnswer,
    Snapshot,
    StatsError,
    analyse,
    approval_poll_seconds,
    interval,
    merge,
    next_step,
    parse_stats,
    validate_answer,
)
from tuneloop.release.loadtest import LoadResult, compare_load, load_test

ROOT = Path(__file__).resolve().parents[1]


def release_params(**changes: Any) -> ReleaseParams:
    shipped = load_params(ROOT / "params.yaml").release
    return shipped.model_copy(update=changes)


def figures(
    requests: int,
    errors: int = 0,
    badcases: int = 0,
    p99: float | None = 100.0,
    ttft: float | None = 20.0,
) -> ArmFigures:
    return ArmFigures(requests, errors, badcases, p99, ttft)


def window(challenger: ArmFigures, champion: ArmFigures, percent: int = 10) -> Snapshot:
    return Snapshot(percent, {"champion": champion, "challenger": challenger})


# --- stats in, verdicts out --------------------------------------------------------------------


def test_parse_stats_reads_what_the_router_serves() -> None:
    stats = new_stats(("champion", "challenger"), 100)
    stats["challenger"].requests = 40
    stats["challenger"].errors["http_5xx"] = 2
    stats["challenger"].errors["timeout"] = 1
    stats["challenger"].badcases = 9  # flags ...
    stats["challenger"].badcase_users = 4  # ... from four users: what the analysis counts
    for ms in (10, 20, 300):
        stats["challenger"].latency.observe(ms / 1000)
    payload = {
        "challenger_percent": 10,
        "arms": {arm: {"model_version": "1", **s.as_json()} for arm, s in stats.items()},
    }
    snap = parse_stats(json.loads(json.dumps(payload)))  # through JSON, as over HTTP
    ch = snap.arms["challenger"]
    assert (ch.requests, ch.errors, ch.badcases) == (40, 3, 4)
    assert ch.latency_p99_ms == 300.0 and ch.ttft_p99_ms is None
    assert snap.arms["champion"].error_rate is None  # no requests: no rate, not 0
    with pytest.raises(StatsError, match="tuneloop router"):
        parse_stats({"arms": {}})


def test_interval_is_the_difference_and_survives_a_router_restart() -> None:
    before = window(figures(100, 1, 2), figures(900, 3))
    after = window(figures(150, 4, 2, p99=80.0), figures(1300, 3))
    d = interval(before, after)
    assert (d.arms["challenger"].requests, d.arms["challenger"].errors) == (50, 3)
    assert d.arms["challenger"].latency_p99_ms == 80.0
    assert d.challenger_share == pytest.approx(50 / 450)
    restarted = interval(after, window(figures(7), figures(60)))
    assert restarted.arms["challenger"].requests == 7  # counters went down: the later read alone


def test_replicas_add_up_take_the_worst_p99_and_must_agree_on_the_weight() -> None:
    a = window(figures(10, 1, p99=50.0, ttft=None), figures(90))
    b = window(figures(30, 0, 3, p99=70.0, ttft=30.0), figures(270, p99=None))
    m = merge([a, b])
    assert (m.arms["challenger"].requests, m.arms["challenger"].errors) == (40, 1)
    assert m.arms["challenger"].latency_p99_ms == 70.0
    assert m.arms["challenger"].ttft_p99_ms == 30.0
    assert m.arms["champion"].latency_p99_ms == 100.0
    with pytest.raises(StatsError, match="disagree"):
        merge([a, window(figures(1), figures(1), percent=50)])


def test_a_healthy_canary_passes() -> None:
    verdict = analyse(window(figures(60), figures(540)), release_params(), 10)
    assert verdict.passed and not verdict.interrupted
    assert verdict.reasons[0].startswith("all checks passed")


@pytest.mark.parametrize(
    ("challenger", "failed"),
    [
        (figures(100, errors=3), "error_rate"),
        (figures(100, badcases=5), "badcase_rate"),
        (figures(100, p99=130.0), "latency_p99_ms"),
        (figures(100, ttft=25.0), "ttft_p99_ms"),
        (figures(49), "challenger_requests"),
    ],
)
def test_each_threshold_fails_the_analysis_and_says_why(
    challenger: ArmFigures, failed: str
) -> None:
    # Champion: 1 % errors, 2 % badcases, p99 100 ms, TTFT 20 ms; limits +0.01, +0.02, 1.2x.
    champion = figures(1000, errors=10, badcases=20)
    verdict = analyse(window(challenger, champion), release_params(), 10)
    assert not verdict.passed
    assert [c.name for c in verdict.checks if c.passed is False] == [failed]
    assert verdict.reasons[0].startswith(failed) and "FAILED" in verdict.reasons[0]


def test_missing_figures_skip_a_check_but_missing_traffic_fails() -> None:
    verdict = analyse(window(figures(60, ttft=None), figures(540)), release_params(), 10)
    assert verdict.passed
    assert {c.name: c.passed for c in verdict.checks}["ttft_p99_ms"] is None
    assert not analyse(window(figures(0), figures(540)), release_params(), 10).passed


def test_at_100_percent_the_challenger_is_held_to_absolute_rates() -> None:
    # The champion gets no requests any more; its latency window still holds earlier ones.
    idle = figures(0, p99=100.0)
    assert analyse(window(figures(500, errors=5), idle, 100), release_params(), 100).passed
    verdict = analyse(window(figures(500, errors=10), idle, 100), release_params(), 100)
    assert not verdict.passed  # 2 % > 0 + 1 %


def test_a_weight_moved_by_someone_else_interrupts_the_release() -> None:
    verdict = analyse(window(figures(60), figures(540), percent=0), release_params(), 10)
    assert verdict.interrupted and not verdict.passed


def load(ttft_ms: float, tpot_ms: float, errors: int = 0) -> LoadResult:
    ok = 16 - errors
    return LoadResult(16, errors, 2.0, ok * 8, (ttft_ms,) * ok, (tpot_ms,) * ok, True)


@pytest.mark.parametrize(
    ("candidate", "failed"),
    [
        (load(50, 10), []),
        (load(61, 10), ["loadtest_ttft_p50_ms"]),  # limit 1.2 x 50 ms
        (load(50, 12.1), ["loadtest_tpot_p50_ms"]),  # limit 1.2 x 10 ms
        (load(50, 10, errors=1), ["loadtest_errors"]),
    ],
)
def test_the_load_gate_blocks_a_regression(candidate: LoadResult, failed: list[str]) -> None:
    params = release_params().loadtest
    verdict = compare_load(load(50, 10), candidate, params)
    assert [c.name for c in verdict.checks if not c.passed] == failed
    assert verdict.passed == (not failed)


def test_a_candidate_without_a_single_token_is_blocked() -> None:
    empty = LoadResult(16, 0, 2.0, 0, ())
    verdict = compare_load(load(50, 10), empty, release_params().loadtest)
    assert not verdict.passed
    assert {c.name for c in verdict.checks if c.passed is False} == {
        "loadtest_ttft_p50_ms",
        "loadtest_tpot_p50_ms",
    }


# --- the ramp and the person's answer ----------------------------------------------------------


def test_next_step_and_how_often_a_pause_polls() -> None:
    assert [next_step((10, 50, 100), p) for p in (0, 10, 30, 50, 100)] == [10, 50, 50, 100, None]
    assert approval_poll_seconds(5) == 1
    assert approval_poll_seconds(86400) == 10


def test_an_answer_is_validated_again_in_the_flow() -> None:
    ok = {"decision": "approve", "approver": "alice", "next_percent": 50}
    assert validate_answer(ok, 10) == Approval.model_validate(ok)
    for bad, why in [
        ({**ok, "next_percent": 150}, "next_percent"),
        ({**ok, "next_percent": 10}, "not above the current 10"),
        ({**ok, "approver": "   "}, "approver is blank"),
        ({**ok, "decision": "maybe"}, "decision"),
        ({**ok, "percent": 50}, "percent"),
        ({"decision": "approve", "approver": "a"}, "next_percent"),
    ]:
        with pytest.raises(InvalidAnswer, match=why):
            validate_answer(bad, 10)
    # A rejection may name any percent: it rolls back whatever it says.
    assert (
        validate_answer({**ok, "decision": "reject", "next_percent": 10}, 10).decision == "reject"
    )


def test_the_form_keeps_its_bounds_where_with_initial_data_drops_them() -> None:
    from flows.release import approval_form

    form = approval_form(current=10, proposed=50, description="ramp?")
    field = form.model_json_schema()["properties"]["next_percent"]
    assert (field["minimum"], field["maximum"], field["default"]) == (11, 100, 50)
    assert form._description == "ramp?"
    # The Prefect quirk the flow guards against: initial data replaces the field, bounds lost.
    dropped = RunInput.subclass_from_base_model_type(Approval).with_initial_data(next_percent=50)
    assert "maximum" not in dropped.model_json_schema()["properties"]["next_percent"]


def test_release_params_steps_must_rise_to_100() -> None:
    data = yaml.safe_load((ROOT / "params.yaml").read_text())
    for steps, why in [([10, 50], "end at 100"), ([50, 10, 100], "rise"), ([0, 100], "rise")]:
        data["release"]["steps"] = steps
        with pytest.raises(ParamsError, match=why):
            parse_params(data)


# --- the load generator against stub backends --------------------------------------------------


def streaming_backend(
    first_token_delay: float, eos_after: int, token_delay: float = 0.0, strict: bool = False
) -> FastAPI:
    """An OpenAI streaming stub that stops at its "EOS" after ``eos_after`` tokens unless asked
    for a fixed length, in vLLM's form (``min_tokens``, ``ignore_eos``) or, with ``strict``,
    only in ``transformers serve``'s (``generation_config``; other unknown fields are a 422,
    as there)."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        body = await request.json()
        assert body["stream"] is True and body["model"] == "m"
        tokens = min(eos_after, body["max_tokens"])
        if strict:
            if {"min_tokens", "ignore_eos"} & set(body):
                return JSONResponse({"detail": "Unexpected fields"}, status_code=422)
            if "generation_config" in body:
                config = json.loads(body["generation_config"])
                tokens = max(tokens, config["min_new_tokens"])
        elif body.get("ignore_eos"):
            tokens = max(tokens, body["min_tokens"])

        async def events() -> AsyncIterator[bytes]:
            yield b'data: {"choices": [{"delta": {"role": "assistant"}}]}\n\n'
            await asyncio.sleep(first_token_delay)
            for _ in range(tokens):
                yield b'data: {"choices": [{"delta": {"content": "ok "}}]}\n\n'
                await asyncio.sleep(token_delay)
            usage = {"completion_tokens": tokens}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def test_the_load_test_times_first_tokens_and_catches_a_slow_candidate() -> None:
    with serve(streaming_backend(0.0, 8)) as fast, serve(streaming_backend(0.15, 8)) as slow:
        champion = load_test(fast, "m", requests=8, concurrency=4, max_tokens=8)
        candidate = load_test(slow, "m", requests=8, concurrency=4, max_tokens=8)
    assert champion.errors == candidate.errors == 0
    assert champion.output_tokens == candidate.output_tokens == 64  # from the usage chunk
    assert candidate.ttft_p50_ms is not None and candidate.ttft_p50_ms >= 150
    verdict = compare_load(champion, candidate, release_params().loadtest)
    assert not verdict.passed
    assert "loadtest_ttft_p50_ms" in verdict.reasons[0]


def test_the_load_test_compares_equal_lengths_whatever_the_eos() -> None:
    # The candidate would stop after 3 tokens, the champion runs on: forced to 16 each, both
    # in the form each backend takes, and the same per-token speed passes.
    with (
        serve(streaming_backend(0.0, 100, token_delay=0.01)) as champ,
        serve(streaming_backend(0.0, 3, token_delay=0.01, strict=True)) as cand,
    ):
        champion = load_test(champ, "m", requests=4, concurrency=2, max_tokens=16)
        candidate = load_test(cand, "m", requests=4, concurrency=2, max_tokens=16)
    assert (champion.style, candidate.style) == ("vllm", "transformers")
    assert champion.fixed_length and candidate.fixed_length
    assert champion.output_tokens == candidate.output_tokens == 64
    assert candidate.tpot_p50_ms is not None and candidate.tpot_p50_ms >= 9
    params = release_params().loadtest.model_copy(update={"max_ttft_ratio": 100.0})
    assert compare_load(champion, candidate, params).passed


def test_a_backend_that_takes_no_fixed_length_is_said_so() -> None:
    with serve(fake_backend("champion", StreamGate())) as url:
        result = load_test(url, "m", requests=2, concurrency=1, max_tokens=8)
    assert result.errors == 0 and result.style == "vllm"  # it took the fields and ignored them
    assert not result.fixed_length and result.output_tokens == 2 * 3  # "served by champion"


def test_the_load_test_counts_a_dead_backend_as_errors() -> None:
    result = load_test("http://127.0.0.1:9", "m", requests=3, concurrency=3, max_tokens=4)
    assert result.errors == 3 and result.ttft_p50_ms is None


# --- the routers' admin API --------------------------------------------------------------------


@pytest.fixture(scope="module")
def backends() -> Iterator[dict[str, str]]:
    gate = StreamGate()
    with serve(fake_backend("champion", gate)) as a, serve(fake_backend("challenger", gate)) as b:
        yield {"champion": a, "challenger": b}


@contextmanager
def routers(backends: dict[str, str], tmp_path: Path, n: int) -> Iterator[list[str]]:
    with ExitStack() as stack:
        urls = []
        for i in range(n):
            client = stack.enter_context(
                running_router(make_config(backends, tmp_path / f"feedback{i}"))
            )
            urls.append(str(client.base_url).rstrip("/"))
        yield urls


def test_admin_calls_without_the_token_fail_and_change_nothing(
    backends: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TUNELOOP_ADMIN_TOKEN", TOKEN)
    with routers(backends, tmp_path, 1) as urls:
        monkeypatch.delenv("TUNELOOP_ADMIN_TOKEN")
        with pytest.raises(AdminError, match=r"\$TUNELOOP_ADMIN_TOKEN is not set"):
            RouterAdmin.from_env(urls, "TUNELOOP_ADMIN_TOKEN")
        monkeypatch.setenv("TUNELOOP_ADMIN_TOKEN", TOKEN)
        with RouterAdmin(urls, "wrong") as wrong:
            with pytest.raises(AdminError, match="401"):
                wrong.set_weight(50, "sneaky")
            with pytest.raises(AdminError, match="401"):
                wrong.rollback("sneaky", attempts=1)
        with RouterAdmin.from_env(urls, "TUNELOOP_ADMIN_TOKEN") as admin:
            status = admin.status()[urls[0]]
    assert status["challenger_percent"] == 0 and status["last_change"] is None


def test_every_replica_moves_together_and_a_rollback_holds_at_once(
    backends: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TUNELOOP_ADMIN_TOKEN", TOKEN)
    with routers(backends, tmp_path, 2) as urls, RouterAdmin(urls, TOKEN) as admin:
        admin.set_weight(100, "test")
        assert {s["challenger_percent"] for s in admin.status().values()} == {100}
        seconds = admin.rollback("canary broke")
        assert seconds < 1.0
        body = {"model": "tuneloop", "messages": [{"role": "user", "content": "hi"}]}
        for url in urls:  # the very next request on every replica goes to the champion
            reply = httpx.post(f"{url}/v1/chat/completions", json=body, trust_env=False)
            assert reply.headers["x-tuneloop-arm"] == "champion"
        assert {s["last_change"]["reason"] for s in admin.status().values()} == {"canary broke"}
        snap = merge([parse_stats(s) for s in admin.stats().values()])
        assert snap.arms["champion"].requests == 2


def test_a_release_refuses_routers_that_serve_other_versions(
    backends: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flows.release import ReleaseRefused, _check_routers

    monkeypatch.setenv("TUNELOOP_ADMIN_TOKEN", TOKEN)
    with routers(backends, tmp_path, 1) as urls, RouterAdmin(urls, TOKEN) as admin:
        arms = _check_routers(admin, candidate="8", champion="7")
        assert arms["challenger"]["base_url"] == backends["challenger"]
        with pytest.raises(ReleaseRefused, match=r"router\.yaml"):
            _check_routers(admin, candidate="9", champion="7")
        admin.take_lease("another-release", 60)
        with pytest.raises(ReleaseRefused, match=r"another release \(another-release\) holds"):
            _check_routers(admin, candidate="8", champion="7")
        admin.end_lease("another-release", "done")
        admin.set_weight(5, "left over")
        with pytest.raises(ReleaseRefused, match="already sends 5 %"):
            _check_routers(admin, candidate="8", champion="7")


def test_a_release_refuses_routers_that_cannot_attribute_badcases(
    backends: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flows.release import ReleaseRefused, _check_routers

    monkeypatch.delenv(SECRET_ENV)
    monkeypatch.setenv("TUNELOOP_ADMIN_TOKEN", TOKEN)
    with (
        routers(backends, tmp_path, 1) as urls,
        RouterAdmin(urls, TOKEN) as admin,
        pytest.raises(ReleaseRefused, match="signs no request ids"),
    ):
        _check_routers(admin, candidate="8", champion="7")


def test_the_lease_keeper_renews_while_it_runs_and_ends_the_lease(
    backends: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TUNELOOP_ADMIN_TOKEN", TOKEN)
    with routers(backends, tmp_path, 2) as urls, RouterAdmin(urls, TOKEN) as admin:
        fast_fail = {"window": 20, "max_errors": 10}
        with LeaseKeeper(admin, "release-1", 1.5, fast_fail) as keeper:
            admin.set_weight(10, "canary")
            time.sleep(3.0)  # twice the lease: only the renewals keep it
            leases = [s["lease"] for s in admin.status().values()]
            assert {lease["holder"] for lease in leases} == {"release-1"}
            assert {s["challenger_percent"] for s in admin.status().values()} == {10}
            assert keeper.renewals >= 4 and keeper.failures == 0
            assert leases[0]["fast_fail"] == fast_fail
        # Ended on leaving: no rollback follows, the weight stays.
        time.sleep(2.0)
        statuses = admin.status().values()
        assert [s["lease"] for s in statuses] == [None, None]
        assert {s["challenger_percent"] for s in statuses} == {10}


def test_a_lease_the_keeper_cannot_take_stops_the_release_before_traffic_moves(
    backends: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TUNELOOP_ADMIN_TOKEN", TOKEN)
    with routers(backends, tmp_path, 1) as urls, RouterAdmin(urls, TOKEN) as admin:
        admin.take_lease("someone-else", 60)
        with (
            pytest.raises(AdminError, match=r"409.*someone-else"),
            LeaseKeeper(admin, "release-1", 60, None),
        ):
            pass


def test_a_rollback_that_cannot_land_says_how_to_do_it_by_hand() -> None:
    with RouterAdmin(["http://127.0.0.1:9"], TOKEN, timeout=0.5) as admin:
        start = time.monotonic()
        with pytest.raises(AdminError, match=r"ROLLBACK DID NOT LAND.*admin/rollback"):
            admin.rollback("x", attempts=2)
        assert time.monotonic() - start < 5


def test_a_crashed_or_cancelled_release_rolls_back_through_its_hooks(
    backends: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prefect.client.schemas.objects import FlowRun
    from prefect.states import Crashed

    from flows.release import release, roll_back_on_exit

    assert roll_back_on_exit in release.on_crashed_hooks
    assert roll_back_on_exit in release.on_cancellation_hooks
    monkeypatch.setenv("TUNELOOP_ADMIN_TOKEN", TOKEN)
    with routers(backends, tmp_path, 2) as urls, RouterAdmin(urls, TOKEN) as admin:
        admin.set_weight(10, "canary")
        write_params(tmp_path, {"release": {"routers": urls}})
        run = FlowRun(flow_id=uuid.uuid4(), name="brave-otter", parameters={"repo": str(tmp_path)})
        roll_back_on_exit(release, run, Crashed(message="killed by a termination signal"))
        statuses = list(admin.status().values())
    assert {s["challenger_percent"] for s in statuses} == {0}
    for status in statuses:
        reason = status["last_change"]["reason"]
        assert "brave-otter" in reason and "Crashed" in reason and "termination" in reason
