"""The OpenAI-compatible endpoints: each request proxied to one arm, some mirrored.

A request goes to the arm of its user's bucket, with ``model`` rewritten to the arm's;
a stream is relayed chunk by chunk as it arrives. The answer carries the router's own
signed ``X-Request-Id`` and ``X-Tuneloop-Arm``. Each finished request leaves a sample
(arm, latency, time to first token, error) for the release analysis.

During a release's shadow step, a champion request of a user in the shadow share is
also sent to the challenger in the background: nobody sees that answer, and both
answers are kept side by side for the analysis to score (``/admin/shadow``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from serving.config import RouterConfig
from serving.limits import Refused, read_object
from serving.metrics import ArmStats, ErrorKind
from serving.router_state import Live, RouterState, logger, state_of
from serving.routing import arm_for_bucket, bucket
from serving.samples import (
    Answer,
    Sample,
    ShadowPair,
    completion_text,
    holds_token,
    prompt_text,
    stream_text,
)
from tuneloop.release import ARMS

PROXIED = ("/v1/chat/completions", "/v1/completions")
# A failing backend is reported at most this often (with a count), not once per request.
BACKEND_WARN_EVERY_S = 10.0
# Bytes of a streamed champion answer kept to assemble its text: SSE costs ~50x the text.
SSE_BYTES_PER_CHAR = 64
# How much of a stream is read for its first token before TTFT is taken at its first bytes.
TTFT_SCAN_BYTES = 16 * 1024

router = APIRouter()


def openai_error(status: int, message: str, kind: str, code: str | None = None) -> JSONResponse:
    """An error body shaped as the OpenAI API's, which client libraries know how to raise."""
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": None, "code": code}},
        status_code=status,
    )


def backend_client(config: RouterConfig) -> httpx.AsyncClient:
    """One arm's connection pool: a slow or stuck challenger cannot use up the connections
    the champion needs."""
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


def backend_urls(config: RouterConfig) -> dict[tuple[str, str], httpx.URL]:
    # Absolute URLs parsed once: httpx joining base_url and path costs ~50 us a request.
    return {
        (arm, path): httpx.URL(config.arms[arm].base_url.rstrip("/") + path)
        for arm in ARMS
        for path in PROXIED
    }


# The proxied endpoints take the state with state_of, not the Live dependency: resolving
# a dependency costs ~15 us a request, a tenth of the router's own code on this path.


@router.post(PROXIED[0])
async def chat_completions(request: Request) -> Response:
    return await proxy(state_of(request), request, PROXIED[0])


@router.post(PROXIED[1])
async def completions(request: Request) -> Response:
    return await proxy(state_of(request), request, PROXIED[1])


@router.get("/v1/models")
async def models(state: Live) -> dict[str, object]:
    return {
        "object": "list",
        "data": [{"id": state.config.public_model, "object": "model", "owned_by": "tuneloop"}],
    }


@router.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


async def proxy(state: RouterState, request: Request, path: str) -> Response:
    config = state.config
    body = await read_object(request, config.limits.request_bytes, config.limits.json_depth)
    return await forward(state, request, path, body)


async def forward(
    state: RouterState, request: Request, path: str, body: dict[str, Any]
) -> Response:
    """One parsed request to the arm of its user's bucket (``serving.tasks`` picks the state
    by the body's ``model`` first, when one router serves several tasks)."""
    config = state.config
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
        pair = start_mirror(state, body, path)
    body["model"] = arm_config.model
    request_id = state.ids.issue(arm, arm_config.model_version, user)
    stats = state.stats[arm]
    stats.requests += 1
    sample = state.samples.open(request_id, arm, state.ids.user_key(user))

    client = state.clients[arm]
    upstream = client.build_request(
        "POST",
        state.urls[arm, path],
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
        backend_failed(state, arm, kind, error)
        finish(state, sample, request_id, path, status, None, kind)
        if pair is not None:
            settle(state, pair, "champion", Answer(error=kind, status=status))
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
            state.observe_challenger(failed)
        error_kind: ErrorKind | None = "http_5xx" if failed else None
        finish(state, sample, request_id, path, response.status_code, elapsed, error_kind)
        if pair is not None:
            ok = response.status_code == 200
            text = completion_text(payload) if ok else None
            answer = Answer(
                capped(state, text), elapsed if ok else None, error_kind, response.status_code
            )
            settle(state, pair, "champion", answer)
        return Response(payload, response.status_code, headers=reply_headers, media_type=media_type)
    return StreamingResponse(
        _relay(state, response, stats, arm, start, sample, request_id, path, pair),
        status_code=response.status_code,
        headers=reply_headers,
        media_type=media_type,
    )


def finish(
    state: RouterState,
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


def backend_failed(state: RouterState, arm: str, kind: ErrorKind, error: Exception) -> None:
    state.stats[arm].errors[kind] += 1
    if arm == "challenger":
        state.observe_challenger(True)
    # Once per arm and kind every BACKEND_WARN_EVERY_S, with a count: a dead
    # backend under load must not write a line per request.
    key = (arm, kind)
    state.backend_failures[key] += 1
    now = state.clock.monotonic()
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


async def _relay(
    state: RouterState,
    response: httpx.Response,
    stats: ArmStats,
    arm: str,
    start: float,
    sample: Sample,
    request_id: str,
    path: str,
    pair: ShadowPair | None,
) -> AsyncIterator[bytes]:
    # TTFT is the time to the first chunk that holds a token, not to the first bytes: vLLM
    # sends the assistant's role in a chunk of its own, with no text.
    head: bytearray | None = bytearray()
    finished = False
    error_kind: ErrorKind | None = None
    kept = bytearray()
    keep = state.config.shadow.text_chars * SSE_BYTES_PER_CHAR if pair is not None else 0
    try:
        async for chunk in response.aiter_bytes():
            if head is not None:
                head += chunk
                # A stream that is not SSE at all is timed at its first bytes past the limit.
                if holds_token(bytes(head)) or len(head) > TTFT_SCAN_BYTES:
                    sample.ttft_s = time.perf_counter() - start
                    stats.ttft.observe(sample.ttft_s)
                    head = None
            if len(kept) < keep:
                kept += chunk
            yield chunk
        finished = True
    except httpx.TransportError as error:
        # Headers are already sent, so the status cannot change any more: end
        # the stream with an OpenAI-style error event, which clients raise.
        error_kind = "timeout" if isinstance(error, httpx.TimeoutException) else "connect"
        backend_failed(state, arm, error_kind, error)
        message = f"{arm} backend {error_kind}: {error}"
        event = {"error": {"message": message, "type": error_kind}}
        yield f"data: {json.dumps(event)}\n\n".encode()
    finally:
        await response.aclose()
        elapsed = time.perf_counter() - start if finished else None
        if elapsed is not None:
            stats.latency.observe(elapsed)
            if arm == "challenger":
                state.observe_challenger(False)
        # A client that hung up leaves a sample with neither latency nor error.
        finish(state, sample, request_id, path, 200, elapsed, error_kind)
        if pair is not None:
            text = capped(state, stream_text(bytes(kept))) if finished else None
            settle(state, pair, "champion", Answer(text, elapsed, error_kind, 200))


# --- shadow: a copy of the request to the challenger, its answer seen by nobody ---


def capped(state: RouterState, text: str | None) -> str | None:
    return None if text is None else text[: state.config.shadow.text_chars]


def start_mirror(state: RouterState, body: dict[str, Any], path: str) -> ShadowPair | None:
    shadow = state.config.shadow
    if len(state.mirrors) >= shadow.concurrency:
        state.shadow_skipped += 1
        return None
    pair = ShadowPair(prompt_text(body)[: shadow.text_chars])
    # Not streamed: the whole answer is what gets scored, and nobody reads it as it comes.
    copy = {**body, "model": state.config.arms["challenger"].model, "stream": False}
    copy.pop("stream_options", None)
    task = asyncio.get_running_loop().create_task(mirror(state, pair, copy, path))
    state.mirrors.add(task)
    task.add_done_callback(state.mirrors.discard)
    return pair


async def mirror(state: RouterState, pair: ShadowPair, body: dict[str, Any], path: str) -> None:
    answer = Answer()
    start = time.perf_counter()
    try:
        response = await state.clients["challenger"].post(
            state.urls["challenger", path],
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
            answer.text = capped(state, completion_text(response.content))
            answer.latency_s = time.perf_counter() - start
    settle(state, pair, "challenger", answer)


def settle(state: RouterState, pair: ShadowPair, arm: str, answer: Answer) -> None:
    setattr(pair, arm, answer)
    pair.pending -= 1
    if pair.pending == 0:
        state.shadow.append(pair)
