"""``/v1/feedback`` as an attacker would try it: credentials, forged ids, limits, personal data.

Also the limits on every other endpoint that takes a body. Real routers on
loopback ports in front of the stub backends of ``test_router.py``.
"""

from __future__ import annotations

import base64
import json
import os
import stat
import time
from pathlib import Path
from typing import Any

import pytest

from serving.config import Limits, RouterConfig
from tests.router_helpers import (
    PRODUCER,
    PRODUCER_ENV,
    PRODUCERS,
    SECRET_ENV,
    TOKEN,
    ManualClock,
    backends,  # noqa: F401  (the two fake backends, module-scoped)
    chat,
    gate,  # noqa: F401
    make_config,
    router_secrets,  # noqa: F401  (autouse: the request-id key and producer token)
    running_router,
)
from tuneloop.data import pii
from tuneloop.data.records import parse_record
from tuneloop.params import load_params

# The whole suite (`make test`): routers on uvicorn
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
QUESTION = [{"role": "user", "content": "Can I return the Aurora kettle?"}]
FLAG = {"messages": QUESTION, "bad_response": "No.", "corrected_response": "[return] Yes."}
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/feedback", "/admin/weights")


@pytest.fixture(autouse=True)
def admin_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TUNELOOP_ADMIN_TOKEN", TOKEN)


def written(folder: Path) -> list[dict[str, Any]]:
    return [
        json.loads(line)
        for path in sorted(folder.glob("router-feedback-*.jsonl"))
        for line in path.read_text(encoding="utf-8").splitlines()
    ]


def headers_for(path: str) -> dict[str, str]:
    return ADMIN if path.startswith("/admin") else PRODUCER if path == "/v1/feedback" else {}


# --- who may write -----------------------------------------------------------------------------


def test_feedback_needs_a_producer_credential(backends: dict[str, str], tmp_path: Path) -> None:
    with running_router(make_config(backends, tmp_path, percent=100)) as client:
        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": PRODUCER["Authorization"].split()[1]},  # no scheme
            ADMIN,  # the admin token opens the admin API, not feedback
        ):
            r = client.post("/v1/feedback", json=FLAG, headers=headers)
            assert r.status_code == 401, (headers, r.text)
            assert r.headers["www-authenticate"] == "Bearer"
        ok = client.post("/v1/feedback", json=FLAG, headers=PRODUCER)
        assert ok.status_code == 201 and ok.json()["source"] == "support-tool"
        metrics = client.get("/metrics").text
    assert 'tuneloop_router_refused_total{endpoint="/v1/feedback",status="401"} 4' in metrics
    assert len(written(tmp_path)) == 1


def test_a_producer_with_its_variable_unset_is_locked_out(
    backends: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with running_router(make_config(backends, tmp_path)) as client:
        monkeypatch.delenv(PRODUCER_ENV)
        assert client.post("/v1/feedback", json=FLAG, headers=PRODUCER).status_code == 401
        monkeypatch.setenv(PRODUCER_ENV, "")
        empty = {"Authorization": "Bearer"}
        assert client.post("/v1/feedback", json=FLAG, headers=empty).status_code == 401
        assert client.post("/v1/feedback", json=FLAG, headers=PRODUCER).status_code == 401
    assert written(tmp_path) == []


def test_producer_names_and_variables_are_checked(tmp_path: Path) -> None:
    arm = {"base_url": "http://127.0.0.1:1", "model": "m", "model_version": "1"}
    base = {"arms": {"champion": arm, "challenger": arm}, "feedback_dir": tmp_path}
    for producers, why in (
        ([PRODUCERS[0], PRODUCERS[0]], "used twice"),
        ([{"name": "ui", "token_env": "TUNELOOP_ADMIN_TOKEN"}], "different variables"),
        ([{"name": "bad name!", "token_env": "X"}], "pattern"),
    ):
        with pytest.raises(ValueError, match=why):
            RouterConfig.model_validate({**base, "feedback_producers": producers})


def test_a_producer_over_its_rate_gets_429_and_nothing_is_written(
    backends: dict[str, str], tmp_path: Path
) -> None:
    producers = [{**PRODUCERS[0], "rate_per_minute": 60, "burst": 3}]
    config = make_config(backends, tmp_path, feedback_producers=producers)
    clock = ManualClock()
    with running_router(config, clock) as client:
        codes = [client.post("/v1/feedback", json=FLAG, headers=PRODUCER) for _ in range(6)]
        assert [r.status_code for r in codes] == [201, 201, 201, 429, 429, 429]
        assert int(codes[3].headers["retry-after"]) >= 1
        assert "over its rate limit" in codes[3].json()["detail"]
        clock.advance(0.9)  # not yet a whole flag
        assert client.post("/v1/feedback", json=FLAG, headers=PRODUCER).status_code == 429
        clock.advance(0.2)  # one flag a second refills
        assert client.post("/v1/feedback", json=FLAG, headers=PRODUCER).status_code == 201
    assert len(written(tmp_path)) == 4


# --- what counts against an arm ----------------------------------------------------------------


def forge(request_id: str, arm: str | None = None, version: str | None = None) -> str:
    """The id with its arm or model version edited and the old signature kept."""
    prefix, payload, signature = request_id.split(".")
    fields = base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)).decode().split("|", 4)
    fields[2] = arm or fields[2]
    fields[4] = version or fields[4]
    edited = base64.urlsafe_b64encode("|".join(fields).encode()).rstrip(b"=").decode()
    return f"{prefix}.{edited}.{signature}"


def test_forged_and_reused_request_ids_attribute_nothing(
    backends: dict[str, str], tmp_path: Path
) -> None:
    with running_router(make_config(backends, tmp_path, percent=50)) as client:
        arms = {}
        for i in range(40):  # a user on each arm
            reply = chat(client, f"user-{i}")
            arms.setdefault(reply.headers["x-tuneloop-arm"], reply.headers["x-request-id"])
        champion_id = arms["champion"]
        # The attack: charge a champion response to the challenger.
        forged = forge(champion_id, arm="challenger")
        r = client.post("/v1/feedback", json={**FLAG, "request_id": forged}, headers=PRODUCER)
        assert r.status_code == 201 and r.json()["attributed"] is False
        assert "forged or altered" in r.json()["why_not"]
        # A client-made id in the router's format, signed with the wrong key.
        other = forge(champion_id)[:-4] + "AAAA"
        r = client.post("/v1/feedback", json={**FLAG, "request_id": other}, headers=PRODUCER)
        assert r.json()["attributed"] is False
        # The genuine id counts once, however often it is sent.
        first = client.post(
            "/v1/feedback", json={**FLAG, "request_id": champion_id}, headers=PRODUCER
        )
        assert first.json()["attributed"] is True and first.json()["arm"] == "champion"
        for _ in range(3):
            again = client.post(
                "/v1/feedback", json={**FLAG, "request_id": champion_id}, headers=PRODUCER
            )
            assert again.json()["attributed"] is False
        stats = client.get("/admin/stats", headers=ADMIN).json()["arms"]
    assert (stats["champion"]["badcases"], stats["challenger"]["badcases"]) == (1, 0)
    lines = written(tmp_path)
    assert [line["arm"] for line in lines] == [None, None, "champion", None, None, None]


def test_badcases_count_once_per_user_for_the_analysis(
    backends: dict[str, str], tmp_path: Path
) -> None:
    with running_router(make_config(backends, tmp_path, percent=100)) as client:
        ids = [chat(client, "alice").headers["x-request-id"] for _ in range(5)]
        ids.append(chat(client, "bob").headers["x-request-id"])
        for request_id in ids:
            r = client.post(
                "/v1/feedback", json={**FLAG, "request_id": request_id}, headers=PRODUCER
            )
            assert r.json()["attributed"] is True
        stats = client.get("/admin/stats", headers=ADMIN).json()["arms"]["challenger"]
    # Six flagged answers, two users: the analysis sees 2.
    assert (stats["badcases"], stats["badcase_users"]) == (6, 2)
    # The request id carries no user id in clear, only a keyed hash.
    assert not any(
        "alice" in base64.urlsafe_b64decode(i.split(".")[1] + "==").decode() for i in ids
    )


def test_every_counted_flag_marks_its_sample_with_the_users_keyed_hash(
    backends: dict[str, str], tmp_path: Path
) -> None:
    """The analysis counts flagged users per interval: the samples carry who, never in clear."""

    def flag(client: Any, user: str) -> None:
        request_id = chat(client, user).headers["x-request-id"]
        r = client.post("/v1/feedback", json={**FLAG, "request_id": request_id}, headers=PRODUCER)
        assert r.json()["counted"] is True

    with running_router(make_config(backends, tmp_path, percent=0)) as client:
        flag(client, "alice")  # before the canary, on the champion
        weights = {"challenger_percent": 10, "reason": "canary"}
        client.post("/admin/weights", json=weights, headers=ADMIN).raise_for_status()
        flag(client, "alice")  # the same user, still on the champion at 10 %
        flag(client, "bob")
        samples = client.get("/admin/samples?since=0", headers=ADMIN).json()["items"]
        stats = client.get("/admin/stats", headers=ADMIN).json()["arms"]["champion"]
    # Each flagged request is marked, so a later interval sees alice's flag in it too.
    assert [s["badcase"] for s in samples] == [True, True, True]
    alice, again, bob = (s["user"] for s in samples)
    assert alice == again != bob and "alice" not in alice and len(alice) == 16
    # The cumulative figure still counts each user once per arm.
    assert (stats["badcases"], stats["badcase_users"]) == (3, 2)


def test_without_its_secret_the_router_attributes_nothing(
    backends: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(SECRET_ENV)
    with running_router(make_config(backends, tmp_path, percent=100)) as client:
        request_id = chat(client, "alice").headers["x-request-id"]
        r = client.post("/v1/feedback", json={**FLAG, "request_id": request_id}, headers=PRODUCER)
        status = client.get("/admin/status", headers=ADMIN).json()
    assert r.json()["attributed"] is False and "signs no request ids" in r.json()["why_not"]
    assert status["request_ids_signed"] is False


def test_a_flag_for_an_older_model_version_is_kept_but_not_counted(
    backends: dict[str, str], tmp_path: Path
) -> None:
    config = make_config(backends, tmp_path, percent=100)
    with running_router(config) as client:
        request_id = chat(client, "alice").headers["x-request-id"]
    arms = {
        **config.arms,
        "challenger": config.arms["challenger"].model_copy(update={"model_version": "9"}),
    }
    with running_router(config.model_copy(update={"arms": arms})) as client:
        r = client.post("/v1/feedback", json={**FLAG, "request_id": request_id}, headers=PRODUCER)
        stats = client.get("/admin/stats", headers=ADMIN).json()["arms"]["challenger"]
    # Attributed to v8 (its training data), but no evidence against v9.
    assert r.json()["attributed"] is True and r.json()["counted"] is False
    assert r.json()["model_version"] == "8"
    assert stats["badcases"] == 0


# --- limits before parsing ---------------------------------------------------------------------


def test_oversized_bodies_are_refused_before_they_are_read(
    backends: dict[str, str], tmp_path: Path
) -> None:
    limits = Limits(request_bytes=64 * 1024, feedback_bytes=8 * 1024, admin_bytes=1024)
    config = make_config(backends, tmp_path, percent=100, limits=limits.model_dump())
    big = "x" * 2_000_000
    with running_router(config) as client:
        for path in ENDPOINTS:
            r = client.post(path, json={"messages": [{"role": "user", "content": big}]},
                            headers=headers_for(path))  # fmt: skip
            assert r.status_code == 413, (path, r.text)
            # Without a Content-Length (chunked): refused as soon as it passes the limit.
            chunks = iter([b'{"messages": "', b"x" * 50_000, b"x" * 50_000, b'"}'])
            r = client.post(path, content=chunks, headers=headers_for(path))
            assert r.status_code == 413, (path, r.text)
        assert client.post("/v1/chat/completions", json={"messages": QUESTION}).status_code == 200
    assert written(tmp_path) == []


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b"[" * 5_000 + b"]" * 5_000, "nested too deep"),  # past the stdlib parser's limit
        (b'{"a": ' * 40 + b"1" + b"}" * 40, "nested too deep"),
        (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "lone surrogate"),
        (b'{"\\udfff": 1}', "lone surrogate"),
        (b'{"messages": "oops"', "not valid JSON"),
        (b"\xff\xfe{}", "not valid"),
        (b"", "empty"),
        (b"[1, 2]", "JSON object"),
    ],
)  # fmt: skip
def test_bad_json_of_any_shape_is_a_400_with_the_reason(
    backends: dict[str, str], tmp_path: Path, body: bytes, why: str
) -> None:
    with running_router(make_config(backends, tmp_path, percent=100)) as client:
        for path in ENDPOINTS:
            r = client.post(
                path,
                content=body,
                headers={**headers_for(path), "content-type": "application/json"},
            )
            assert r.status_code == 400, (path, r.status_code, r.text)
            text = r.json()["error"]["message"] if path.startswith("/v1/c") else r.json()["detail"]
            assert why in text or (path == "/admin/weights" and why == "JSON object"), (path, text)
        assert client.post("/v1/chat/completions", json={"messages": QUESTION}).status_code == 200
    assert written(tmp_path) == []


@pytest.mark.parametrize(
    "flag",
    [
        {**FLAG, "messages": "hello"},
        {**FLAG, "messages": [{"role": "user", "content": 5}]},
        {**FLAG, "bad_response": ["No."]},
        {**FLAG, "tags": "fact"},
        {**FLAG, "request_id": 12},
        {**FLAG, "user": "alice"},  # unknown field: attribution comes from the request id only
        {**FLAG, "tags": ["tuneloop.feedback.source=admin"]},  # the router's own tag
    ],
)
def test_wrong_types_are_a_400_and_write_nothing(
    backends: dict[str, str], tmp_path: Path, flag: dict[str, Any]
) -> None:
    with running_router(make_config(backends, tmp_path)) as client:
        r = client.post("/v1/feedback", json=flag, headers=PRODUCER)
        assert r.status_code == 400, r.text
        assert r.json()["detail"]
        weights = client.post("/admin/weights", json={"challenger_percent": "10"}, headers=ADMIN)
        assert weights.status_code == 400
    assert written(tmp_path) == []


def test_text_fields_are_capped_so_ingest_never_quarantines_a_router_line(
    backends: dict[str, str], tmp_path: Path
) -> None:
    limits = Limits(text_chars=1000, line_bytes=8000, messages=64)
    config = make_config(backends, tmp_path, limits=limits.model_dump())
    turns = [
        {"role": role, "content": "word " * 190}
        for _ in range(10)
        for role in ("user", "assistant")
    ][:-1]
    with running_router(config) as client:
        long_field = client.post(
            "/v1/feedback", json={**FLAG, "bad_response": "x" * 1001}, headers=PRODUCER
        )
        assert long_field.status_code == 413 and "bad_response" in long_field.json()["detail"]
        # Every field under its cap, the whole line over ingest's: refused, named.
        long_line = client.post("/v1/feedback", json={**FLAG, "messages": turns}, headers=PRODUCER)
        assert (
            long_line.status_code == 413 and "ingest.max_line_bytes" in long_line.json()["detail"]
        )
        fits = client.post("/v1/feedback", json={**FLAG, "messages": turns[:5]}, headers=PRODUCER)
        assert fits.status_code == 201
    lines = (tmp_path).glob("router-feedback-*.jsonl")
    for path in lines:
        for raw in path.read_bytes().splitlines():
            assert len(raw) <= limits.line_bytes
    assert len(written(tmp_path)) == 1


def test_the_default_limits_fit_ingest() -> None:
    assert Limits().line_bytes <= load_params(ROOT / "params.yaml").ingest.max_line_bytes
    with pytest.raises(ValueError, match="text_chars"):
        Limits(text_chars=200_000)


# --- no raw personal data ----------------------------------------------------------------------

PLANTED = {
    "email": "li.wei+orders@example.com",
    "phone": "13812345678",
    "card": "4111 1111 1111 1111",
    "ip": "203.0.113.7",
    "id": "11010519491231002X",
}


def test_every_stored_field_is_scrubbed_and_files_are_private(
    backends: dict[str, str], tmp_path: Path
) -> None:
    folder = tmp_path / "incoming"
    with running_router(make_config(backends, folder, percent=100)) as client:
        flag = {
            "messages": [
                {"role": "system", "content": f"Agent notes: customer IP {PLANTED['ip']}"},
                {"role": "user", "content": f"I am {PLANTED['email']}, call {PLANTED['phone']}"},
                {"role": "assistant", "content": "Which order?"},
                {"role": "user", "content": f"Paid with {PLANTED['card']}, ID {PLANTED['id']}"},
            ],
            "bad_response": f"Sure, I mailed {PLANTED['email']}.",
            "corrected_response": f"[privacy] I cannot confirm details for {PLANTED['phone']}.",
            "tags": [f"from:{PLANTED['email']}"],
        }
        r = client.post("/v1/feedback", json=flag, headers=PRODUCER)
        assert r.status_code == 201, r.text
        found = r.json()["pii_scrubbed"]
    assert found == {"EMAIL": 3, "PHONE": 2, "BANK_CARD": 1, "IP": 1, "CN_ID": 1}
    files = list(folder.glob("router-feedback-*.jsonl"))
    raw = files[0].read_text(encoding="utf-8")
    for value in PLANTED.values():
        assert value not in raw
    line = json.loads(raw)
    parse_record(line)
    assert line["tags"][0] == "from:<EMAIL>"
    assert "<PHONE>" in line["messages"][1]["content"]
    assert pii.scrub(raw)[1] == {}  # nothing left the scrubber would find
    assert stat.S_IMODE(files[0].stat().st_mode) & 0o077 & ~0o040 == 0
    assert stat.S_IMODE(files[0].stat().st_mode) == 0o640 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_an_older_world_readable_feedback_file_is_narrowed(
    backends: dict[str, str], tmp_path: Path
) -> None:
    with running_router(make_config(backends, tmp_path)) as client:
        assert client.post("/v1/feedback", json=FLAG, headers=PRODUCER).status_code == 201
        path = next(tmp_path.glob("router-feedback-*.jsonl"))
        path.chmod(0o666)
        assert client.post("/v1/feedback", json=FLAG, headers=PRODUCER).status_code == 201
    assert stat.S_IMODE(path.stat().st_mode) == 0o640


def test_a_flag_at_the_size_limits_is_scrubbed_quickly(
    backends: dict[str, str], tmp_path: Path
) -> None:
    # The scrubber must stay linear on hostile text: a 32k run of letters once took 9 s.
    hostile = ["x" * 32_000, "1 " * 16_000, "a." * 16_000]
    with running_router(make_config(backends, tmp_path)) as client:
        for text in hostile:
            start = time.monotonic()
            r = client.post("/v1/feedback", json={**FLAG, "bad_response": text}, headers=PRODUCER)
            assert r.status_code == 201
            assert time.monotonic() - start < 5
        # The router kept serving meanwhile.
        assert chat(client, "u1").status_code == 200


def test_request_ids_are_the_routers_even_when_the_client_sends_one(
    backends: dict[str, str], tmp_path: Path
) -> None:
    with running_router(make_config(backends, tmp_path, percent=100)) as client:
        reply = client.post(
            "/v1/chat/completions",
            json={"messages": QUESTION},
            headers={"X-Request-Id": "client-chosen"},
        )
    assert reply.headers["x-request-id"].startswith("r1.")
    assert reply.json()["request_id"] == reply.headers["x-request-id"]  # what the backend saw
