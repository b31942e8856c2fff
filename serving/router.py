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
- **feedback capture**: the router remembers which arm and model version served
  each request and user, so ``/v1/feedback`` turns a flagged response into a
  badcase record charged to the right model and written where next month's
  ingest reads it;
- per-arm errors, latency, time to first token and badcases for the release
  controller's analysis, and a rollback that holds from the very next request.

Run it with ``python -m serving.router --config router.yaml``; tests and the
benchmark build it with ``create_app(config)``.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated

import httpx
from fastapi import Depends, FastAPI, Header, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from serving.config import RouterConfig, load_router_config
from serving.feedback import FeedbackRequest, FeedbackWriter, badcase_record
from serving.metrics import ArmStats, ErrorKind, new_stats, render_prometheus
from serving.state import (
    Served,
    ServedLog,
    arm_for_bucket,
    bucket,
    load_weight,
    save_weight,
)
from tuneloop.records import InvalidRecord
from tuneloop.release import ARMS

logger = logging.getLogger(__name__)

PROXIED = ("/v1/chat/completions", "/v1/completions")
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# How far into a stream the router looks for the completion id (it is in the
# first event); past this it stops looking so a stream costs no extra copying.
_ID_SCAN_BYTES = 8192


@dataclass
class RouterState:
    """The live objects of one router process."""

    config: RouterConfig
    challenger_percent: int
    stats: dict[str, ArmStats]
    by_request: ServedLog
    by_user: ServedLog
    writer: FeedbackWriter
    clients: dict[str, httpx.AsyncClient] = field(default_factory=dict)
    last_change: dict[str, object] | None = None
    rollbacks: int = 0
    admin_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def versions(self) -> dict[str, str]:
        return {arm: self.config.arms[arm].model_version for arm in ARMS}


class WeightsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    challenger_percent: int = Field(ge=0, le=100)
    reason: str = ""


class RollbackRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    reason: str = Field(min_length=1, description="why; logged and kept in the state file")


def openai_error(status: int, message: str, kind: str, code: str | None = None) -> JSONResponse:
    """An error body shaped as the OpenAI API's, which client libraries know how to raise."""
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": None, "code": code}},
        status_code=status,
    )


def _completion_id(payload: bytes) -> str | None:
    """The ``id`` of an OpenAI completion body, or None when it is not one."""
    try:
        parsed = json.loads(payload)
    except ValueError:
        return None
    value = parsed.get("id") if isinstance(parsed, dict) else None
    return value if isinstance(value, str) and value else None


def _first_event_id(prefix: bytes) -> str | None:
    """The completion id from the first complete ``data:`` event of an SSE stream."""
    for line in prefix.split(b"\n"):
        if line.startswith(b"data:"):
            return _completion_id(line[5:].strip())
    return None


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


def create_app(config: RouterConfig) -> FastAPI:
    """The router as an ASGI app; its backend connection pools open and close with the app."""
    percent = config.challenger_percent
    if config.state_file is not None:
        saved = load_weight(config.state_file)
        if saved is not None and saved != percent:
            # The admin API's last word wins over the config: a restart must not undo a rollback.
            logger.warning(
                "challenger_percent %d from %s overrides %d from the config",
                saved,
                config.state_file,
                percent,
            )
            percent = saved
    state = RouterState(
        config=config,
        challenger_percent=percent,
        stats=new_stats(ARMS, config.stats_window),
        by_request=ServedLog(config.served_records),
        by_user=ServedLog(config.served_records),
        writer=FeedbackWriter(config.feedback_dir),
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # One pool per arm, so a slow or stuck challenger cannot use up the
        # connections the champion needs.
        state.clients = {arm: _new_client(config) for arm in ARMS}
        try:
            yield
        finally:
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
            raise HTTPException(
                status_code=401,
                detail=f"admin endpoints need 'Authorization: Bearer <${config.admin_token_env}>'",
                headers={"WWW-Authenticate": "Bearer"},
            )

    admin = [Depends(require_admin)]

    async def proxy(request: Request, path: str) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError:
            return openai_error(400, "request body is not valid JSON", "invalid_request_error")
        if not isinstance(body, dict):
            return openai_error(400, "request body must be a JSON object", "invalid_request_error")
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
            return openai_error(400, "'user' must be a string", "invalid_request_error")
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        # Anonymous requests spread by weight too, just without stickiness.
        arm = arm_for_bucket(bucket(user or uuid.uuid4().hex), state.challenger_percent)
        arm_config = config.arms[arm]
        body["model"] = arm_config.model
        served = Served(arm, arm_config.model_version)
        state.by_request.remember(request_id, served)
        if user:
            state.by_user.remember(user, served)
        stats = state.stats[arm]
        stats.requests += 1

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
        except httpx.TimeoutException as error:
            return _backend_failed(stats, arm, "timeout", error, 504)
        except httpx.TransportError as error:
            return _backend_failed(stats, arm, "connect", error, 502)

        if response.status_code >= 500:
            stats.errors["http_5xx"] += 1
        media_type = response.headers.get("content-type")
        if not stream or response.status_code != 200:
            # Error bodies of a streaming request are plain JSON, not SSE.
            payload = response.content if not stream else await response.aread()
            if stream:
                await response.aclose()
            stats.latency.observe(time.perf_counter() - start)
            if response.status_code == 200:
                completion_id = _completion_id(payload)
                if completion_id:
                    state.by_request.remember(completion_id, served)
            return Response(
                payload, response.status_code, headers=reply_headers, media_type=media_type
            )
        return StreamingResponse(
            _relay(response, stats, arm, served, start),
            status_code=response.status_code,
            headers=reply_headers,
            media_type=media_type,
        )

    def _backend_failed(
        stats: ArmStats, arm: str, kind: ErrorKind, error: Exception, status: int
    ) -> JSONResponse:
        stats.errors[kind] += 1
        logger.warning("%s backend %s: %s", arm, kind, error)
        return openai_error(status, f"{arm} backend {kind}: {error}", "backend_error", kind)

    async def _relay(
        response: httpx.Response, stats: ArmStats, arm: str, served: Served, start: float
    ) -> AsyncIterator[bytes]:
        prefix = b""
        scanning = True
        first = True
        finished = False
        try:
            async for chunk in response.aiter_bytes():
                if first:
                    stats.ttft.observe(time.perf_counter() - start)
                    first = False
                if scanning:
                    prefix += chunk
                    if b"\n\n" in prefix or len(prefix) > _ID_SCAN_BYTES:
                        scanning = False
                        completion_id = _first_event_id(prefix)
                        if completion_id:
                            state.by_request.remember(completion_id, served)
                yield chunk
            finished = True
        except httpx.TransportError as error:
            # Headers are already sent, so the status cannot change any more: end
            # the stream with an OpenAI-style error event, which clients raise.
            kind: ErrorKind = "timeout" if isinstance(error, httpx.TimeoutException) else "connect"
            stats.errors[kind] += 1
            logger.warning("%s backend %s mid-stream: %s", arm, kind, error)
            event = {"error": {"message": f"{arm} backend {kind}: {error}", "type": kind}}
            yield f"data: {json.dumps(event)}\n\n".encode()
        finally:
            await response.aclose()
            if finished:
                stats.latency.observe(time.perf_counter() - start)

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

    @app.post("/v1/feedback", status_code=201)
    async def feedback(flag: FeedbackRequest) -> dict[str, object]:
        served = None
        if flag.request_id:
            served = state.by_request.lookup(flag.request_id)
        if served is None and flag.user:
            served = state.by_user.lookup(flag.user)
        if served is None:
            logger.info(
                "feedback for request %r / user %r: serving arm unknown; written as unattributed",
                flag.request_id,
                flag.user,
            )
        created_at = datetime.now(UTC)
        try:
            record = badcase_record(
                flag,
                served.arm if served else None,
                served.model_version if served else None,
                created_at,
            )
        except InvalidRecord as error:
            # Ingest would quarantine it next month; say why now, while it can be fixed.
            raise HTTPException(
                status_code=422, detail={"kind": error.kind, "reason": str(error)}
            ) from None
        path = await run_in_threadpool(state.writer.append, record, created_at)
        if served is not None:
            state.stats[served.arm].badcases += 1
        return {
            "arm": record["arm"],
            "model_version": record["model_version"],
            "attributed": served is not None,
            "file": path.name,
        }

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        text = render_prometheus(state.stats, state.versions(), state.challenger_percent)
        return PlainTextResponse(text, media_type=PROMETHEUS_CONTENT_TYPE)

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
            "last_change": state.last_change,
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
        }

    async def persist(percent: int, reason: str) -> None:
        if config.state_file is not None:
            await run_in_threadpool(save_weight, config.state_file, percent, reason)

    def record_change(action: str, before: int, after: int, reason: str) -> None:
        state.last_change = {
            "action": action,
            "from": before,
            "to": after,
            "reason": reason,
            "at": datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z"),
        }

    @app.post("/admin/weights", dependencies=admin)
    async def set_weights(change: WeightsRequest) -> JSONResponse:
        async with state.admin_lock:
            before = state.challenger_percent
            rollbacks = state.rollbacks
            # Saved before it applies: a weight the router could not keep across
            # a restart is refused now rather than silently lost later.
            try:
                await persist(change.challenger_percent, change.reason)
            except OSError as error:
                logger.exception("could not save challenger_percent to %s", config.state_file)
                return JSONResponse(
                    {"detail": f"weight unchanged: cannot write {config.state_file}: {error}"},
                    status_code=500,
                )
            if state.rollbacks != rollbacks:
                # A rollback landed while this change was being saved; it wins
                # (its own save runs after this one, under the same lock).
                return JSONResponse(
                    {"detail": "a rollback happened meanwhile; this change was not applied"},
                    status_code=409,
                )
            state.challenger_percent = change.challenger_percent
            record_change("weights", before, change.challenger_percent, change.reason)
            logger.info(
                "challenger_percent %d -> %d (%s)", before, change.challenger_percent, change.reason
            )
            return JSONResponse(status())

    @app.post("/admin/rollback", dependencies=admin)
    async def rollback(change: RollbackRequest) -> JSONResponse:
        # Applied first and without waiting for the admin lock: the next request
        # must reach the champion even while a weight change or a slow disk holds it.
        before = state.challenger_percent
        state.challenger_percent = 0
        state.rollbacks += 1
        record_change("rollback", before, 0, change.reason)
        logger.warning("ROLLBACK challenger_percent %d -> 0: %s", before, change.reason)
        async with state.admin_lock:
            try:
                await persist(0, change.reason)
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
