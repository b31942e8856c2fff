"""What the router tests share: fake OpenAI-compatible backends on loopback ports, a
router in a uvicorn thread, the tests' tokens and secrets.

Two small FastAPI apps stand in for vLLM: they speak the OpenAI chat and completions
protocol (SSE streaming included) and say which arm served. The fixtures here are used by
importing them into a test module.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from serving.app import create_app
from serving.clock import SYSTEM, Clock
from serving.config import RouterConfig
from serving.router_state import RouterState

TOKEN = "s3cret-admin-token"
MODELS = {"champion": "champ-model", "challenger": "chall-model"}
VERSIONS = {"champion": "7", "challenger": "8"}
# Router secrets of the tests: the request-id key and one feedback producer's token.
SECRET_ENV, SECRET = "TUNELOOP_ROUTER_SECRET", "router-test-secret"
PRODUCER_ENV, PRODUCER_TOKEN = "TUNELOOP_FEEDBACK_SUPPORT", "support-tool-token"
PRODUCERS = [{"name": "support-tool", "token_env": PRODUCER_ENV}]
PRODUCER = {"Authorization": f"Bearer {PRODUCER_TOKEN}"}


# --- servers on loopback ports ----------------------------------------------------------------


@contextmanager
def serve(app: FastAPI, port: int = 0) -> Iterator[str]:
    """Run ``app`` with uvicorn in a thread on 127.0.0.1 (an ephemeral port unless given);
    yield its URL."""
    # proto=IPPROTO_TCP matters: asyncio sets TCP_NODELAY only on sockets that
    # say TCP, and without it every response waits ~40 ms for a delayed ACK.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("test server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


class StreamGate:
    """Lets a test hold a backend stream after its first chunk until the client has seen it."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.finished = threading.Event()


def fake_backend(arm: str, gate: StreamGate, text: str | None = None) -> FastAPI:
    """An OpenAI-compatible backend that reports the arm and the model name it was asked for.

    It answers ``text`` (default: "served by <arm>") to every request.

    Test knobs ride in the request body: ``x_status`` (reply with that status),
    ``x_sleep`` (seconds before replying), ``x_gate`` (hold the stream on ``gate``).
    """
    app = FastAPI()

    async def complete(request: Request, kind: str) -> Response:
        body: dict[str, Any] = await request.json()
        if body.get("x_sleep"):
            await asyncio.sleep(float(body["x_sleep"]))
        if body.get("x_status"):
            return JSONResponse({"error": {"message": "boom"}}, status_code=int(body["x_status"]))
        completion_id = f"cmpl-{arm}-{uuid.uuid4().hex[:12]}"
        answer = text or f"served by {arm}"
        if body.get("stream"):
            return StreamingResponse(
                stream_chunks(completion_id, arm, body, answer, kind),
                media_type="text/event-stream",
            )
        message = {"role": "assistant", "content": answer}
        choice = (
            {"index": 0, "message": message} if kind == "chat" else {"index": 0, "text": answer}
        )
        return JSONResponse(
            {
                "id": completion_id,
                "object": "chat.completion" if kind == "chat" else "text_completion",
                "model": body.get("model"),
                "choices": [choice],
                "arm": arm,
                "request_id": request.headers.get("x-request-id"),
            }
        )

    async def stream_chunks(
        completion_id: str, arm: str, body: dict[str, Any], text: str, kind: str
    ) -> AsyncIterator[bytes]:
        for index, word in enumerate(text.split()):
            delta = {"content": word + " "}
            chunk = {
                "id": completion_id,
                "object": "chat.completion.chunk",
                "model": body.get("model"),
                "arm": arm,
                "choices": [{"index": 0, "delta": delta} if kind == "chat" else {"text": word}],
            }
            yield f"data: {json.dumps(chunk)}\n\n".encode()
            if index == 0 and body.get("x_gate"):
                # Hold the rest until the client proves it has the first chunk (or 5 s).
                await asyncio.to_thread(gate.release.wait, 5)
        yield b"data: [DONE]\n\n"
        if body.get("x_gate"):
            gate.finished.set()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await complete(request, "chat")

    @app.post("/v1/completions")
    async def legacy(request: Request) -> Response:
        return await complete(request, "text")

    @app.get("/v1/models")
    async def models() -> dict[str, object]:
        return {"object": "list", "data": [{"id": MODELS[arm], "object": "model"}]}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    return app


@pytest.fixture(scope="module")
def gate() -> StreamGate:
    return StreamGate()


@pytest.fixture(scope="module")
def backends(gate: StreamGate) -> Iterator[dict[str, str]]:
    with (
        serve(fake_backend("champion", gate)) as champion,
        serve(fake_backend("challenger", gate)) as challenger,
    ):
        yield {"champion": champion, "challenger": challenger}


def make_config(
    backends: dict[str, str], feedback_dir: Path, percent: int = 0, **extra: Any
) -> RouterConfig:
    arms = {
        arm: {"base_url": url, "model": MODELS[arm], "model_version": VERSIONS[arm]}
        for arm, url in backends.items()
    }
    return RouterConfig.model_validate(
        {
            "arms": arms,
            "challenger_percent": percent,
            "feedback_dir": feedback_dir,
            "feedback_producers": PRODUCERS,
            **extra,
        }
    )


@contextmanager
def running_router(config: RouterConfig, clock: Clock = SYSTEM) -> Iterator[httpx.Client]:
    with running_state(config, clock) as (client, _):
        yield client


@contextmanager
def running_state(
    config: RouterConfig, clock: Clock = SYSTEM
) -> Iterator[tuple[httpx.Client, RouterState]]:
    """A running router's client and its live state, for a test that waits on the state."""
    app = create_app(config, clock)
    with serve(app) as url, httpx.Client(base_url=url, timeout=10) as client:
        yield client, app.state.router


def looked(*states: RouterState, timeout: float = 5) -> None:
    """Wait until each router's lease watch has looked at the lease again: twice, since a
    look under way when this was asked may have read the clock before the test moved it.
    The routers look side by side, so several are waited for at once."""
    seen = [state.lease_looks for state in states]
    deadline = time.monotonic() + timeout
    while any(state.lease_looks < n + 2 for state, n in zip(states, seen, strict=True)):
        if time.monotonic() > deadline:
            raise AssertionError(f"the lease watch did not look within {timeout} s")
        time.sleep(0.01)


class ManualClock:
    """A router clock that moves only when the test says: leases lapse and rates refill on
    ``advance``, not after a sleep. It starts at the real time, so ids and files look real."""

    def __init__(self) -> None:
        self.now = time.time()
        self.ticks = 1000.0

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.ticks

    def advance(self, seconds: float) -> None:
        self.now += seconds
        self.ticks += seconds


@pytest.fixture
def admin_token(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    monkeypatch.setenv("TUNELOOP_ADMIN_TOKEN", TOKEN)
    return {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(autouse=True)
def router_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    """The request-id key and the producer token, as a deployed router has them."""
    monkeypatch.setenv(SECRET_ENV, SECRET)
    monkeypatch.setenv(PRODUCER_ENV, PRODUCER_TOKEN)


def chat(client: httpx.Client, user: str | None = None, **body: Any) -> httpx.Response:
    payload: dict[str, Any] = {
        "model": "tuneloop",
        "messages": [{"role": "user", "content": "Can I return the Aurora kettle?"}],
        **body,
    }
    if user is not None:
        payload["user"] = user
    return client.post("/v1/chat/completions", json=payload)


def served_arm(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    arm: str = response.json()["arm"]
    assert response.headers["x-tuneloop-arm"] == arm
    return arm
