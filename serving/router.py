"""The canary router: one OpenAI-compatible endpoint in front of a champion and a challenger.

Clients call ``/v1/chat/completions``, ``/v1/completions`` and ``/v1/models``
here exactly as they would call vLLM or ``transformers serve``; each request goes
to one arm, chosen by weight and sticky per user, and streaming responses are
relayed chunk by chunk as they arrive.

Why tuneloop has its own router instead of an off-the-shelf proxy (Envoy or an
Nginx split, a Gateway API weighted route, a generic LLM gateway):

- **per-arm model-name rewrite**: each arm serves its own backend model name
  (vLLM's ``--served-model-name``, a LoRA adapter name) while clients keep
  asking for one public name; the rewrite happens inside the JSON body, which
  L4/L7 traffic splitters do not touch;
- **stickiness by user**: a stable hash of ``X-User-Id`` or the body's ``user``
  picks one of 100 buckets, so a user sees one model through a canary step, and
  ramping the weight only ever adds users to the challenger;
- **feedback capture**: every response carries a signed ``X-Request-Id`` that
  says which arm and model version served it, so ``/v1/feedback`` (from
  authenticated producers only) turns a flagged response into a scrubbed
  badcase record charged to the right model and written where next month's
  ingest reads it (``serving.attribution``, ``serving.feedback``);
- per-arm errors, latency, time to first token and badcases for the release
  controller's analysis, per request and read by cursor (``serving.samples``),
  and a rollback that holds from the very next request;
- **shadow traffic**: during a release's shadow step a share of the champion's
  requests is mirrored to the challenger in the background; the user gets the
  champion's answer only, and both answers are kept side by side for the
  analysis to score (``/admin/shadow``);
- **guards of its own** while a release holds its lease (``/admin/lease``): a
  lease that is not renewed, or a burst of challenger errors, sets the
  challenger to 0 % in the router itself, with no controller alive to ask.

Every body is size-capped before it is read and parsed defensively
(``serving.limits``): bad input is a 4xx with the reason, never a 500.

Run it with ``python -m serving.router --config router.yaml``; tests and the
benchmark build it with ``create_app(config)``.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import math
import os
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, TypeVar

import httpx
from fastapi import Depends, FastAPI, Header, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from serving.attribution import Attribution, RequestIds, SeenKeys
from serving.config import RouterConfig, load_router_config
from serving.feedback import (
    FeedbackRequest,
    FeedbackWriter,
    badcase_record,
    check_sizes,
    encode_line,
)
from serving.limits import Refused, parse_json, read_body
from serving.metrics import ArmStats, ErrorKind, new_stats, render_prometheus
from serving.samples import (
    MAX_PAGE,
    Answer,
    Ring,
    Sample,
    SampleLog,
    ShadowPair,
    completion_text,
    prompt_text,
    stream_text,
)
from serving.state import (
    ErrorBurst,
    FastFail,
    Lease,
    SavedState,
    arm_for_bucket,
    bucket,
    load_state,
    save_state,
    starting_state,
    utc_iso,
)
from tuneloop.data.records import InvalidRecord
from tuneloop.release import ARMS

logger = logging.getLogger(__name__)

PROXIED = ("/v1/chat/completions", "/v1/completions")
FEEDBACK = "/v1/feedback"
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# How often the router looks at its lease when none is about to lapse.
LEASE_TICK_S = 0.5
# A failing backend is reported at most this often (with a count), not once per request.
BACKEND_WARN_EVERY_S = 10.0
# Bytes of a streamed champion answer kept to assemble its text: SSE costs ~50x the text.
SSE_BYTES_PER_CHAR = 64

Body = TypeVar("Body", bound=BaseModel)


@dataclass
class TokenBucket:
    """A producer's rate limit: ``burst`` flags at once, refilled at ``per_second``."""

    per_second: float
    burst: int
    tokens: float
    at: float

    def take(self, now: float) -> float:
        """0 when a flag may go now (and spend it); else the seconds until one may."""
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.per_second)
        self.at = now
        if self.tokens >= 1:
            self.tokens -= 1
            return 0.0
        return (1 - self.tokens) / self.per_second


@dataclass
class RouterState:
    """The live objects of one router process."""

    config: RouterConfig
    challenger_percent: int
    stats: dict[str, ArmStats]
    samples: SampleLog
    shadow: Ring[ShadowPair]
    writer: FeedbackWriter
    ids: RequestIds
    flagged_ids: SeenKeys
    flagged_users: dict[str, SeenKeys]
    buckets: dict[str, TokenBucket]
    clients: dict[str, httpx.AsyncClient] = field(default_factory=dict)
    last_change: dict[str, Any] | None = None
    lease: Lease | None = None
    burst: ErrorBurst | None = None
    rollbacks: int = 0
    shadow_percent: int = 0
    shadow_skipped: int = 0  # requests not mirrored because `shadow.concurrency` were in flight
    mirrors: set[asyncio.Task[None]] = field(default_factory=set)
    backend_failures: Counter[tuple[str, str]] = field(default_factory=Counter)
    backend_warned: dict[tuple[str, str], float] = field(default_factory=dict)
    refused: Counter[tuple[str, int]] = field(default_factory=Counter)
    admin_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    background: set[asyncio.Task[None]] = field(default_factory=set)

    def versions(self) -> dict[str, str]:
        return {arm: self.config.arms[arm].model_version for arm in ARMS}


class _Body(BaseModel):
    # Strict: "10" is not a percent; a wrong type is the caller's bug, said at once.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class WeightsRequest(_Body):
    challenger_percent: int = Field(ge=0, le=100)
    reason: str = Field(default="", max_length=1000)
    operator: str | None = Field(default=None, min_length=1, max_length=100)


class RollbackRequest(_Body):
    reason: str = Field(
        min_length=1, max_length=1000, description="why; logged and kept in the state file"
    )
    operator: str | None = Field(
        default=None, min_length=1, max_length=100, description="who; kept beside the reason"
    )


class FastFailRule(_Body):
    window: int = Field(ge=1, le=10_000)
    max_errors: int = Field(ge=1, le=10_000)


class ShadowRequest(_Body):
    percent: int = Field(ge=0, le=100, description="share of users whose requests are mirrored")
    reason: str = Field(default="", max_length=1000)


class LeaseRequest(_Body):
    holder: str = Field(min_length=1, max_length=200, description="the release (flow run) id")
    ttl_s: float = Field(ge=1, le=7 * 24 * 3600, description="lapses this long after the call")
    fast_fail: FastFailRule | None = None


class LeaseEnd(_Body):
    holder: str = Field(min_length=1, max_length=200)
    reason: str = Field(default="", max_length=1000)


def openai_error(status: int, message: str, kind: str, code: str | None = None) -> JSONResponse:
    """An error body shaped as the OpenAI API's, which client libraries know how to raise."""
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": None, "code": code}},
        status_code=status,
    )


def _validation_reason(error: ValidationError) -> str:
    # Without the input: it may be large, and it is the client's own anyway.
    return "; ".join(
        f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}"
        for e in error.errors(include_input=False, include_url=False)
    )


def _new_client(config: RouterConfig) -> httpx.AsyncClient:
    t = config.timeouts
    return httpx.AsyncClient(
        timeout=httpx.Timeout(connect=t.connect, read=t.read, write=t.write, pool=t.pool),
        limits=httpx.Limits(
            max_connections=config.max_connections_per_arm,
            max_keepalive_connections=config.max_connections_per_arm,
        ),
        # Proxy settings from the environment must not divert backend traffic.
        trust_env=False,
    )


def _now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def create_app(config: RouterConfig) -> FastAPI:
    """The router as an ASGI app; its backend connection pools open and close with the app."""
    limits = config.limits
    secret = os.environ.get(config.request_id_secret_env, "")
    if not secret:
        logger.warning(
            "$%s is not set: request ids are unsigned and no feedback is attributed to an arm "
            "(the canary analysis sees no badcases); set it, the same on every replica",
            config.request_id_secret_env,
        )
    now = time.time()
    ticking = time.monotonic()
    state = RouterState(
        config=config,
        challenger_percent=config.challenger_percent,
        stats=new_stats(ARMS, config.stats_window),
        samples=SampleLog(config.sample_memory),
        shadow=Ring(config.shadow.memory),
        writer=FeedbackWriter(config.feedback_dir),
        ids=RequestIds(secret or None, config.request_id_max_age_s),
        flagged_ids=SeenKeys(config.flag_memory),
        flagged_users={arm: SeenKeys(config.flag_memory) for arm in ARMS},
        buckets={
            p.name: TokenBucket(p.rate_per_minute / 60, p.burst, float(p.burst), ticking)
            for p in config.feedback_producers
        },
    )

    def saved(percent: int, lease: Lease | None, why: dict[str, Any] | None = None) -> SavedState:
        """The state file's content for this weight and lease, with the (last) change's why."""
        why = why or state.last_change or {}
        return SavedState(
            challenger_percent=percent,
            arms=state.versions(),
            action=str(why.get("action", "config")),
            reason=str(why.get("reason", "")),
            operator=why.get("operator"),
            lease=lease,
            changed_at=str(why.get("at") or ""),
            changed_from=why.get("from"),
        )

    def change(
        action: str, before: int | None, after: int, reason: str, operator: str | None = None
    ) -> dict[str, Any]:
        return {
            "action": action,
            "from": before,
            "to": after,
            "reason": reason,
            "operator": operator,
            "at": _now_iso(),
        }

    def record_change(
        action: str, before: int | None, after: int, reason: str, operator: str | None = None
    ) -> None:
        state.last_change = change(action, before, after, reason, operator)

    def set_lease(lease: Lease | None) -> None:
        """The lease, and a fresh fast-fail window whenever its holder or rule changes."""
        held = state.lease
        state.lease = lease
        if lease is None or lease.fast_fail is None:
            state.burst = None
        elif held is None or held.holder != lease.holder or held.fast_fail != lease.fast_fail:
            state.burst = ErrorBurst(lease.fast_fail)

    # --- where the weight starts: config, or the state file when it was saved for these arms ---
    if config.state_file is not None:
        found = load_state(config.state_file)
        start = starting_state(config.challenger_percent, state.versions(), found, now)
        state.challenger_percent = start.challenger_percent
        set_lease(start.lease)
        if found is not None:
            state.last_change = change(
                found.action,
                found.changed_from,
                found.challenger_percent,
                found.reason,
                found.operator,
            )
            state.last_change["at"] = found.changed_at
        if start.note is not None and not start.save:
            logger.warning("%s (%s)", start.note, config.state_file)
        if found is not None and dict(found.arms) != state.versions():
            record_change(
                "arms_changed", found.challenger_percent, start.challenger_percent, start.note or ""
            )
        if start.save and found is not None:
            record_change("lease_lapsed", found.challenger_percent, 0, start.note or "")
            logger.warning("ROLLBACK [lease_lapsed] %s (%s)", start.note, config.state_file)
            try:
                save_state(config.state_file, saved(0, None))
            except OSError:
                logger.exception("rolled back, but cannot record it in %s", config.state_file)

    # --- background: the lease watch, and saves started from the request path ---

    def spawn(coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        state.background.add(task)  # keep a reference until it is done
        task.add_done_callback(state.background.discard)

    def roll_back_now(action: str, reason: str, operator: str | None = None) -> None:
        """Challenger to 0 at once, lease and burst watch dropped; the caller saves it."""
        before = state.challenger_percent
        state.challenger_percent = 0
        state.shadow_percent = 0
        state.rollbacks += 1
        set_lease(None)
        record_change(action, before, 0, reason, operator)
        by = f" (by {operator})" if operator else ""
        logger.warning("ROLLBACK [%s] challenger_percent %d -> 0: %s%s", action, before, reason, by)

    async def persist(content: SavedState) -> None:
        if config.state_file is not None:
            await run_in_threadpool(save_state, config.state_file, content)

    async def save_rollback() -> None:
        async with state.admin_lock:
            try:
                await persist(saved(0, None))
            except OSError:
                logger.exception(
                    "the rollback is in effect but not saved to %s; fix it before the router "
                    "restarts",
                    config.state_file,
                )

    async def watch_lease() -> None:
        while True:
            lease = state.lease
            now = time.time()
            if lease is not None and now >= lease.expires_at:
                roll_back_now(
                    "lease_lapsed",
                    f"the lease held by {lease.holder} lapsed at {utc_iso(lease.expires_at)}: "
                    f"not renewed within {lease.ttl_s:g} s (the release stopped or lost the "
                    "router)",
                )
                await save_rollback()
                continue
            wait = LEASE_TICK_S if lease is None else min(LEASE_TICK_S, lease.expires_at - now)
            await asyncio.sleep(max(0.01, wait))

    def observe_challenger(failed: bool) -> None:
        """One challenger outcome into the fast-fail window; a burst rolls back here and now."""
        burst = state.burst
        if burst is None or state.challenger_percent == 0:
            return
        if burst.observe(failed):
            roll_back_now("fast_fail", burst.describe())
            spawn(save_rollback())

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # One pool per arm, so a slow or stuck challenger cannot use up the
        # connections the champion needs.
        state.clients = {arm: _new_client(config) for arm in ARMS}
        watcher = asyncio.get_running_loop().create_task(watch_lease())
        try:
            yield
        finally:
            watcher.cancel()
            # Mirrors are answers nobody waits for: not worth a slow shutdown.
            for mirror in list(state.mirrors):
                mirror.cancel()
            for task in list(state.background):
                await task
            for client in state.clients.values():
                await client.aclose()
            state.clients = {}

    # Absolute URLs parsed once: httpx joining base_url and path costs ~50 us a request.
    urls = {
        (arm, path): httpx.URL(config.arms[arm].base_url.rstrip("/") + path)
        for arm in ARMS
        for path in PROXIED
    }

    app = FastAPI(title="tuneloop canary router", lifespan=lifespan)
    app.state.router = state

    @app.exception_handler(Refused)
    async def refused(request: Request, error: Refused) -> Response:
        path = request.url.path
        state.refused[path if path in (*PROXIED, FEEDBACK) else "/admin", error.status] += 1
        if path in PROXIED:
            response: Response = openai_error(
                error.status, error.reason, "invalid_request_error", error.kind
            )
        else:
            response = JSONResponse(
                {"detail": error.reason, "kind": error.kind}, status_code=error.status
            )
        response.headers.update(error.headers)
        return response

    async def body_of(request: Request, model: type[Body], limit: int) -> Body:
        data = parse_json(await read_body(request, limit), limits.json_depth)
        if not isinstance(data, dict):
            raise Refused(400, "request body must be a JSON object", "bad_json")
        try:
            return model.model_validate(data)
        except ValidationError as error:
            raise Refused(400, _validation_reason(error), "invalid_body") from None

    def require_admin(authorization: Annotated[str | None, Header()] = None) -> None:
        # Read per request: the token is rotated by restarting with a new env var,
        # and an unset or empty variable must lock the admin API, never open it.
        expected = os.environ.get(config.admin_token_env, "")
        scheme, _, given = (authorization or "").partition(" ")
        if (
            not expected
            or scheme.lower() != "bearer"
            or not hmac.compare_digest(given.strip().encode(), expected.encode())
        ):
            raise Refused(
                401,
                f"admin endpoints need 'Authorization: Bearer <${config.admin_token_env}>'",
                "unauthorized",
                headers={"WWW-Authenticate": "Bearer"},
            )

    admin = [Depends(require_admin)]

    def producer_of(authorization: str | None) -> str:
        """The feedback producer a bearer token belongs to; ``Refused(401)`` for any other."""
        scheme, _, given = (authorization or "").partition(" ")
        token = given.strip().encode()
        found = None
        if scheme.lower() == "bearer" and token:
            for producer in config.feedback_producers:
                expected = os.environ.get(producer.token_env, "")
                if expected and hmac.compare_digest(token, expected.encode()):
                    found = producer.name
            admin_token = os.environ.get(config.admin_token_env, "")
            if admin_token and hmac.compare_digest(token, admin_token.encode()):
                found = None  # the admin token is not a feedback credential, even if reused
        if found is None:
            raise Refused(
                401,
                "feedback needs 'Authorization: Bearer <producer token>' of a producer in the "
                "router config's feedback_producers",
                "unauthorized",
                headers={"WWW-Authenticate": "Bearer"},
            )
        return found

    def throttle(producer: str) -> None:
        wait = state.buckets[producer].take(time.monotonic())
        if wait > 0:
            spec = next(p for p in config.feedback_producers if p.name == producer)
            raise Refused(
                429,
                f"producer {producer!r} is over its rate limit ({spec.rate_per_minute:g} flags a "
                f"minute, bursts of {spec.burst}); retry in {wait:.1f} s",
                "rate_limited",
                headers={"Retry-After": str(max(1, round(wait + 0.5)))},
            )

    # --- the proxied OpenAI endpoints ---

    async def proxy(request: Request, path: str) -> Response:
        body = parse_json(await read_body(request, limits.request_bytes), limits.json_depth)
        if not isinstance(body, dict):
            raise Refused(400, "request body must be a JSON object", "bad_json")
        asked = body.get("model")
        if asked is not None and asked != config.public_model:
            return openai_error(
                404,
                f"model {asked!r} is not served here; ask for {config.public_model!r}",
                "invalid_request_error",
                "model_not_found",
            )
        # The header first: an authenticating gateway sets it, while the body's
        # `user` is whatever the client chose to send.
        user = request.headers.get("x-user-id") or body.get("user")
        if user is not None and not isinstance(user, str):
            raise Refused(400, "'user' must be a string", "invalid_body")
        # Anonymous requests spread by weight too, just without stickiness.
        user_bucket = bucket(user or uuid.uuid4().hex)
        arm = arm_for_bucket(user_bucket, state.challenger_percent)
        arm_config = config.arms[arm]
        # Buckets [0, shadow %) are mirrored: the users the first canary step will serve.
        pair = None
        if arm == "champion" and user_bucket < state.shadow_percent:
            pair = start_mirror(body, path)
        body["model"] = arm_config.model
        request_id = state.ids.issue(arm, arm_config.model_version, user)
        stats = state.stats[arm]
        stats.requests += 1
        sample = state.samples.open(request_id, arm, state.ids.user_key(user))

        client = state.clients[arm]
        upstream = client.build_request(
            "POST",
            urls[arm, path],
            content=json.dumps(body).encode("utf-8"),
            headers={"content-type": "application/json", "x-request-id": request_id},
        )
        reply_headers = {"x-request-id": request_id, "x-tuneloop-arm": arm}
        stream = body.get("stream") is True
        start = time.perf_counter()
        try:
            response = await client.send(upstream, stream=stream)
        except httpx.TransportError as error:
            kind: ErrorKind = "timeout" if isinstance(error, httpx.TimeoutException) else "connect"
            status = 504 if kind == "timeout" else 502
            backend_failed(arm, kind, error)
            finish(sample, request_id, path, status, None, kind)
            if pair is not None:
                settle(pair, "champion", Answer(error=kind, status=status))
            reply = openai_error(status, f"{arm} backend {kind}: {error}", "backend_error", kind)
            reply.headers.update(reply_headers)
            return reply

        failed = response.status_code >= 500
        if failed:
            stats.errors["http_5xx"] += 1
        media_type = response.headers.get("content-type")
        if not stream or response.status_code != 200:
            # Error bodies of a streaming request are plain JSON, not SSE.
            payload = response.content if not stream else await response.aread()
            if stream:
                await response.aclose()
            elapsed = time.perf_counter() - start
            stats.latency.observe(elapsed)
            if arm == "challenger":
                observe_challenger(failed)
            error_kind: ErrorKind | None = "http_5xx" if failed else None
            finish(sample, request_id, path, response.status_code, elapsed, error_kind)
            if pair is not None:
                ok = response.status_code == 200
                text = completion_text(payload) if ok else None
                settle(
                    pair,
                    "champion",
                    Answer(capped(text), elapsed if ok else None, error_kind, response.status_code),
                )
            return Response(
                payload, response.status_code, headers=reply_headers, media_type=media_type
            )
        return StreamingResponse(
            _relay(response, stats, arm, start, sample, request_id, path, pair),
            status_code=response.status_code,
            headers=reply_headers,
            media_type=media_type,
        )

    def finish(
        sample: Sample,
        request_id: str,
        path: str,
        status: int,
        elapsed: float | None,
        error: ErrorKind | None,
    ) -> None:
        """The request's sample into the ring; latency only for an answer (errors are counted)."""
        sample.latency_s = elapsed if error is None else None
        sample.error = error
        state.samples.close(sample)
        if not logger.isEnabledFor(logging.DEBUG):
            return
        logger.debug(
            "%s %s -> %s %d %s%s",
            path,
            request_id,
            sample.arm,
            status,
            "-" if elapsed is None else f"{elapsed * 1000:.1f} ms",
            f" {error}" if error else "",
        )

    def backend_failed(arm: str, kind: ErrorKind, error: Exception) -> None:
        state.stats[arm].errors[kind] += 1
        if arm == "challenger":
            observe_challenger(True)
        # Once per arm and kind every BACKEND_WARN_EVERY_S, with a count: a dead
        # backend under load must not write a line per request.
        key = (arm, kind)
        state.backend_failures[key] += 1
        now = time.monotonic()
        if now - state.backend_warned.get(key, -math.inf) >= BACKEND_WARN_EVERY_S:
            count = state.backend_failures.pop(key)
            state.backend_warned[key] = now
            logger.warning(
                "%s backend %s: %s (%d such failure(s) since the last warning)",
                arm,
                kind,
                error,
                count,
            )

    # --- shadow: a copy of the request to the challenger, its answer seen by nobody ---

    def capped(text: str | None) -> str | None:
        return None if text is None else text[: config.shadow.text_chars]

    def start_mirror(body: dict[str, Any], path: str) -> ShadowPair | None:
        if len(state.mirrors) >= config.shadow.concurrency:
            state.shadow_skipped += 1
            return None
        pair = ShadowPair(prompt_text(body)[: config.shadow.text_chars])
        # Not streamed: the whole answer is what gets scored, and nobody reads it as it comes.
        copy = {**body, "model": config.arms["challenger"].model, "stream": False}
        copy.pop("stream_options", None)
        task = asyncio.get_running_loop().create_task(mirror(pair, copy, path))
        state.mirrors.add(task)
        task.add_done_callback(state.mirrors.discard)
        return pair

    async def mirror(pair: ShadowPair, body: dict[str, Any], path: str) -> None:
        answer = Answer()
        start = time.perf_counter()
        try:
            response = await state.clients["challenger"].post(
                urls["challenger", path],
                content=json.dumps(body).encode("utf-8"),
                headers={"content-type": "application/json", "x-tuneloop-shadow": "1"},
            )
        except httpx.TransportError as error:
            answer.error = "timeout" if isinstance(error, httpx.TimeoutException) else "connect"
            logger.debug("shadow request to the challenger: %s: %s", answer.error, error)
        else:
            answer.status = response.status_code
            if response.status_code >= 500:
                answer.error = "http_5xx"
            elif response.status_code == 200:
                answer.text = capped(completion_text(response.content))
                answer.latency_s = time.perf_counter() - start
        settle(pair, "challenger", answer)

    def settle(pair: ShadowPair, arm: str, answer: Answer) -> None:
        setattr(pair, arm, answer)
        pair.pending -= 1
        if pair.pending == 0:
            state.shadow.append(pair)

    async def _relay(
        response: httpx.Response,
        stats: ArmStats,
        arm: str,
        start: float,
        sample: Sample,
        request_id: str,
        path: str,
        pair: ShadowPair | None,
    ) -> AsyncIterator[bytes]:
        first = True
        finished = False
        error_kind: ErrorKind | None = None
        kept = bytearray()
        keep = config.shadow.text_chars * SSE_BYTES_PER_CHAR if pair is not None else 0
        try:
            async for chunk in response.aiter_bytes():
                if first:
                    sample.ttft_s = time.perf_counter() - start
                    stats.ttft.observe(sample.ttft_s)
                    first = False
                if len(kept) < keep:
                    kept += chunk
                yield chunk
            finished = True
        except httpx.TransportError as error:
            # Headers are already sent, so the status cannot change any more: end
            # the stream with an OpenAI-style error event, which clients raise.
            error_kind = "timeout" if isinstance(error, httpx.TimeoutException) else "connect"
            backend_failed(arm, error_kind, error)
            message = f"{arm} backend {error_kind}: {error}"
            event = {"error": {"message": message, "type": error_kind}}
            yield f"data: {json.dumps(event)}\n\n".encode()
        finally:
            await response.aclose()
            elapsed = time.perf_counter() - start if finished else None
            if elapsed is not None:
                stats.latency.observe(elapsed)
                if arm == "challenger":
                    observe_challenger(False)
            # A client that hung up leaves a sample with neither latency nor error.
            finish(sample, request_id, path, 200, elapsed, error_kind)
            if pair is not None:
                text = capped(stream_text(bytes(kept))) if finished else None
                settle(pair, "champion", Answer(text, elapsed, error_kind, 200))

    @app.post(PROXIED[0])
    async def chat_completions(request: Request) -> Response:
        return await proxy(request, PROXIED[0])

    @app.post(PROXIED[1])
    async def completions(request: Request) -> Response:
        return await proxy(request, PROXIED[1])

    @app.get("/v1/models")
    async def models() -> dict[str, object]:
        return {
            "object": "list",
            "data": [{"id": config.public_model, "object": "model", "owned_by": "tuneloop"}],
        }

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    # --- feedback: credential, rate, size, JSON, scrub, then write ---

    @app.post(FEEDBACK, status_code=201)
    async def feedback(request: Request) -> JSONResponse:
        producer = producer_of(request.headers.get("authorization"))
        throttle(producer)
        flag = await body_of(request, FeedbackRequest, limits.feedback_bytes)
        check_sizes(flag, limits)
        attribution: Attribution | None = None
        why = "no request_id given"
        if flag.request_id is not None:
            attribution, why = state.ids.verify(flag.request_id)
        if attribution is not None and attribution.arm not in ARMS:
            why = f"request id names no arm of this router ({attribution.arm})"
            attribution = None
        # Claimed before any await, so two concurrent flags of one id cannot both count.
        if attribution is not None and not state.flagged_ids.add(attribution.nonce):
            attribution, why = None, "this request id was already flagged; it counts once"
        created_at = datetime.now(UTC)
        arm, version = (attribution.arm, attribution.model_version) if attribution else (None, None)

        def scrub_and_write() -> tuple[dict[str, object], Counter[str], Path]:
            # Off the event loop: scrubbing a flag at the size limits takes tens of ms.
            record, found = badcase_record(flag, producer, arm, version, created_at)
            return record, found, state.writer.append(encode_line(record, limits), created_at)

        written = False
        try:
            record, found, path = await run_in_threadpool(scrub_and_write)
            written = True
        except InvalidRecord as error:
            # Ingest would quarantine it next month; say why now, while it can be fixed.
            raise Refused(422, str(error), error.kind) from None
        finally:
            if attribution is not None and not written:
                state.flagged_ids.discard(attribution.nonce)  # not written: it may come again
        counted = False
        if attribution is not None:
            arm = attribution.arm
            # A flag on an older model version is still its training data, but
            # not evidence against the version this arm serves now.
            if attribution.model_version == config.arms[arm].model_version:
                counted = True
                state.stats[arm].badcases += 1
                if state.flagged_users[arm].add(attribution.user_key):
                    state.stats[arm].badcase_users += 1
                # The request's own sample too, so its interval's analysis sees it. The
                # analysis counts flagged users among the interval's users, per arm: a user
                # counted once "ever" instead made the champion's users, flagged before the
                # canary began, count for nothing in it, and a challenger as wrong as the
                # champion looked three times worse (the demo's first release rolled back).
                state.samples.flag(str(flag.request_id))
        else:
            logger.info("feedback from %s written unattributed: %s", producer, why)
        return JSONResponse(
            {
                "arm": record["arm"],
                "model_version": record["model_version"],
                "attributed": attribution is not None,
                "counted": counted,
                "why_not": None if attribution is not None else why,
                "source": producer,
                "pii_scrubbed": dict(found),
                "file": path.name,
            },
            status_code=201,
        )

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        text = render_prometheus(
            state.stats, state.versions(), state.challenger_percent, state.refused
        )
        return PlainTextResponse(text, media_type=PROMETHEUS_CONTENT_TYPE)

    # --- admin ---

    def status() -> dict[str, object]:
        p = state.challenger_percent
        return {
            "public_model": config.public_model,
            "challenger_percent": p,
            "weights": {"champion": 100 - p, "challenger": p},
            "arms": {
                arm: {
                    "base_url": config.arms[arm].base_url,
                    "model": config.arms[arm].model,
                    "model_version": config.arms[arm].model_version,
                }
                for arm in ARMS
            },
            "shadow_percent": state.shadow_percent,
            "last_change": state.last_change,
            "lease": None if state.lease is None else state.lease.as_json(time.time()),
            "request_ids_signed": state.ids.signing,
            "feedback_producers": [p.name for p in config.feedback_producers],
        }

    @app.get("/admin/status", dependencies=admin)
    async def admin_status() -> dict[str, object]:
        return status()

    @app.get("/admin/stats", dependencies=admin)
    async def admin_stats() -> dict[str, object]:
        return {
            "challenger_percent": state.challenger_percent,
            "stats_window": config.stats_window,
            "arms": {
                arm: {"model_version": config.arms[arm].model_version, **s.as_json()}
                for arm, s in state.stats.items()
            },
            "refused": [
                {"endpoint": endpoint, "status": code, "count": n}
                for (endpoint, code), n in sorted(state.refused.items())
            ],
        }

    @app.get("/admin/samples", dependencies=admin)
    async def admin_samples(
        since: Annotated[int, Query(ge=0)] = 0,
        limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = MAX_PAGE,
    ) -> dict[str, object]:
        """Finished requests numbered above ``since`` (a cursor), for one analysis interval."""
        page = state.samples.ring.read(since, limit)
        return {"challenger_percent": state.challenger_percent, **page}

    @app.get("/admin/shadow", dependencies=admin)
    async def admin_shadow_pairs(
        since: Annotated[int, Query(ge=0)] = 0,
        limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = MAX_PAGE,
    ) -> dict[str, object]:
        """Mirrored requests' answer pairs numbered above ``since``."""
        page = state.shadow.read(since, limit)
        return {
            "shadow_percent": state.shadow_percent,
            "challenger_percent": state.challenger_percent,
            "skipped": state.shadow_skipped,
            **page,
        }

    @app.post("/admin/shadow", dependencies=admin)
    async def set_shadow(request: Request) -> JSONResponse:
        """Mirror a share of users' requests to the challenger (0: stop). Not saved: a
        restarted router mirrors nothing until the release sets it again."""
        order = await body_of(request, ShadowRequest, limits.admin_bytes)
        before = state.shadow_percent
        state.shadow_percent = order.percent
        logger.info("shadow_percent %d -> %d (%s)", before, order.percent, order.reason)
        return JSONResponse(status())

    def not_saved(what: str, error: OSError) -> JSONResponse:
        logger.exception("could not save the router state to %s", config.state_file)
        return JSONResponse(
            {"detail": f"{what}: cannot write {config.state_file}: {error}"}, status_code=500
        )

    def overtaken() -> JSONResponse:
        # A rollback landed while this change was being saved; it wins (its own
        # save runs after this one, under the same lock).
        return JSONResponse(
            {"detail": "a rollback happened meanwhile; this change was not applied"},
            status_code=409,
        )

    @app.post("/admin/weights", dependencies=admin)
    async def set_weights(request: Request) -> JSONResponse:
        update = await body_of(request, WeightsRequest, limits.admin_bytes)
        async with state.admin_lock:
            before = state.challenger_percent
            rollbacks = state.rollbacks
            done = change(
                "weights", before, update.challenger_percent, update.reason, update.operator
            )
            # Saved before it applies: a weight the router could not keep across
            # a restart is refused now rather than silently lost later.
            try:
                await persist(saved(update.challenger_percent, state.lease, done))
            except OSError as error:
                return not_saved("weight unchanged", error)
            if state.rollbacks != rollbacks:
                return overtaken()
            state.challenger_percent = update.challenger_percent
            state.last_change = done
            logger.info(
                "challenger_percent %d -> %d (%s)", before, update.challenger_percent, update.reason
            )
            return JSONResponse(status())

    @app.post("/admin/rollback", dependencies=admin)
    async def rollback(request: Request) -> JSONResponse:
        order = await body_of(request, RollbackRequest, limits.admin_bytes)
        # Applied first and without waiting for the admin lock: the next request
        # must reach the champion even while a weight change or a slow disk holds it.
        roll_back_now("rollback", order.reason, order.operator)
        async with state.admin_lock:
            try:
                await persist(saved(0, None))
            except OSError as error:
                logger.exception("rollback is in effect but not saved to %s", config.state_file)
                return JSONResponse(
                    {
                        "detail": f"rolled back (in effect now) but cannot write "
                        f"{config.state_file}: {error}; fix it before the router restarts",
                        **status(),
                    },
                    status_code=500,
                )
        return JSONResponse(status())

    @app.post("/admin/lease", dependencies=admin)
    async def take_lease(request: Request) -> JSONResponse:
        """Take or renew the release's lease on the canary weight."""
        claim = await body_of(request, LeaseRequest, limits.admin_bytes)
        rule = claim.fast_fail
        if rule is not None and rule.max_errors > rule.window:
            raise Refused(400, "fast_fail.max_errors is more than fast_fail.window", "invalid_body")
        async with state.admin_lock:
            now = time.time()
            held = state.lease
            if held is not None and held.holder != claim.holder and held.expires_at > now:
                raise Refused(
                    409,
                    f"the lease is held by {held.holder} until {utc_iso(held.expires_at)}: one "
                    "release at a time (roll back, or wait for it to end or lapse)",
                    "lease_held",
                )
            lease = Lease(
                claim.holder,
                claim.ttl_s,
                now + claim.ttl_s,
                None if rule is None else FastFail(rule.window, rule.max_errors),
            )
            rollbacks = state.rollbacks
            try:
                await persist(saved(state.challenger_percent, lease))
            except OSError as error:
                return not_saved("lease not taken", error)
            if state.rollbacks != rollbacks:
                return overtaken()
            if held is None or held.holder != lease.holder:
                logger.info(
                    "lease taken by %s for %g s (fast fail: %s)", lease.holder, lease.ttl_s, rule
                )
            set_lease(lease)
            return JSONResponse(status())

    @app.post("/admin/lease/release", dependencies=admin)
    async def end_lease(request: Request) -> JSONResponse:
        """The holder ends its lease; the weight stays where it is (e.g. 100 % after a promote)."""
        end = await body_of(request, LeaseEnd, limits.admin_bytes)
        async with state.admin_lock:
            held = state.lease
            if held is None:
                return JSONResponse(status())
            if held.holder != end.holder:
                raise Refused(
                    409, f"the lease is held by {held.holder}, not {end.holder}", "lease_held"
                )
            try:
                await persist(saved(state.challenger_percent, None))
            except OSError as error:
                return not_saved("lease kept", error)
            set_lease(None)
            logger.info("lease of %s ended: %s", held.holder, end.reason or "no reason given")
            return JSONResponse(status())

    return app


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m serving.router",
        description="Run the canary router in front of the champion and challenger backends.",
    )
    parser.add_argument("--config", type=Path, required=True, help="router config YAML")
    parser.add_argument("--host", default="127.0.0.1", help="listen address")
    parser.add_argument("--port", type=int, default=8080, help="listen port")
    parser.add_argument("--log-level", default="info", help="logging level of the router")
    parser.add_argument(
        "--access-log", action="store_true", help="log every request (costs latency)"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    args = _parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    config = load_router_config(args.config)
    uvicorn.run(
        create_app(config),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=args.access_log,
    )


if __name__ == "__main__":
    main()
