"""One task's canary router as an ASGI app: the endpoints of ``serving.proxy``,
``serving.feedback`` and ``serving.control`` over one ``RouterState``, and its refusals.

``serving.router`` runs it (``python -m serving.router``); ``serving.tasks`` mounts one per
task; tests and benchmarks build it with ``create_app(config)``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from serving import control, feedback, proxy
from serving.clock import SYSTEM, Clock
from serving.config import RouterConfig
from serving.limits import Refused
from serving.router_state import RouterState, new_state, state_of
from tuneloop.release import ARMS


def create_app(config: RouterConfig, clock: Clock = SYSTEM) -> FastAPI:
    """The router as an ASGI app; its backend connection pools open and close with the app."""
    app = FastAPI(
        title="tuneloop canary router",
        lifespan=_lifespan,
        exception_handlers={Refused: _refused},
    )
    state = new_state(config, clock)
    state.urls = proxy.backend_urls(config)
    app.state.router = state
    app.include_router(proxy.router)
    app.include_router(feedback.router)
    app.include_router(control.router)
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    state: RouterState = app.state.router
    state.clients = {arm: proxy.backend_client(state.config) for arm in ARMS}
    watcher = asyncio.get_running_loop().create_task(state.watch_lease())
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


async def _refused(request: Request, error: Refused) -> Response:
    """A refusal as the endpoint's clients expect it, counted per endpoint and status."""
    state = state_of(request)
    path = request.url.path
    state.refused[
        path if path in (*proxy.PROXIED, feedback.FEEDBACK) else "/admin", error.status
    ] += 1
    return refusal(path, error)


def refusal(path: str, error: Refused) -> Response:
    """A refusal as the endpoint's clients expect it: OpenAI's error shape on its endpoints."""
    if path in proxy.PROXIED:
        response: Response = proxy.openai_error(
            error.status, error.reason, "invalid_request_error", error.kind
        )
    else:
        response = JSONResponse(
            {"detail": error.reason, "kind": error.kind}, status_code=error.status
        )
    response.headers.update(error.headers)
    return response
