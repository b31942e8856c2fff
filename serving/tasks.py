"""One router for several tasks on one base: each task's requests go to that task's arms.

A team that serves a support desk and product copy from one base model keeps one vLLM
server with each task's adapters (``--enable-lora``), and one router in front of it.
Clients ask for a task by its public model name, as they would ask any OpenAI server for a
model; the router picks that task's champion or challenger by the task's own weight.

Each task is a whole single-task router (``serving.router.create_app``), mounted at
``/tasks/<task>``: its weight, lease, state file, samples, shadow, feedback and metrics are
its own. So a release of one task is the release flow of today pointed at
``<router>/tasks/<task>``: its canary, analysis, ramp, promotion and rollback reach that
task's state only, and two tasks can be under release at once, each holding its own lease.

At the top, this app only dispatches:

- ``POST /v1/chat/completions`` and ``/v1/completions``: the body's ``model`` names the
  task (a body without one, or with a name no task has, is a 404 that lists the names);
- ``GET /v1/models``: every task's public name;
- ``GET /admin/status`` (admin token): every task's status, for ``tuneloop status``;
- ``POST /v1/feedback`` answers where to send it: ``/tasks/<task>/v1/feedback``, so a
  flag is written into that task's own incoming folder.

The config is the single-task one with a ``tasks:`` mapping; what a task does not set is
shared (timeouts, limits, tokens, producers)::

    feedback_dir: incoming          # each task's flags go to incoming/<task>/
    state_file: state/router.json   # each task's weight is kept in state/<task>.router.json
    tasks:
      support:
        arms: {champion: {...}, challenger: {...}}
      copy:
        public_model: product-copy
        arms: {champion: {...}, challenger: {...}}
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, FastAPI, Header, Request
from fastapi.responses import JSONResponse, Response

from serving import control, proxy
from serving.app import create_app, refusal
from serving.auth import check_admin
from serving.clock import SYSTEM, Clock
from serving.config import RouterConfig, RouterConfigError, read_config_file, router_config
from serving.feedback import FEEDBACK
from serving.limits import Refused, read_object
from serving.router_state import RouterState

TASK_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,39}$")
# What a task may set for itself; everything else is the router's, shared by every task.
PER_TASK = frozenset(
    {"public_model", "arms", "challenger_percent", "state_file", "feedback_dir", "serve_dir"}
)

router = APIRouter()


@dataclass(frozen=True)
class TasksConfig:
    """Each task's router config, in the order the file lists them."""

    tasks: Mapping[str, RouterConfig]

    def by_model(self) -> dict[str, str]:
        return {config.public_model: task for task, config in self.tasks.items()}


def tasks_config(data: Mapping[str, Any], where: str = "router config") -> TasksConfig:
    """A ``TasksConfig`` from a config's dict with a ``tasks:`` mapping; ``RouterConfigError``
    names the task and key that is wrong."""
    given = data.get("tasks")
    if not isinstance(given, dict) or not given:
        raise RouterConfigError(f"{where}: tasks must map each task's name to its settings")
    shared = {key: value for key, value in data.items() if key != "tasks"}
    if "arms" in shared:
        raise RouterConfigError(
            f"{where}: arms are per task when tasks are listed: move them under tasks.<task>.arms"
        )
    found: dict[str, RouterConfig] = {}
    for name, own in given.items():
        if not isinstance(name, str) or not TASK_NAME.match(name):
            raise RouterConfigError(
                f"{where}: task name {name!r} must match {TASK_NAME.pattern} (it is a URL part)"
            )
        if not isinstance(own, dict):
            raise RouterConfigError(f"{where}: tasks.{name} must be a mapping")
        shared_keys = sorted(set(own) - PER_TASK)
        if shared_keys:
            raise RouterConfigError(
                f"{where}: tasks.{name} sets {shared_keys}, which every task shares: set them "
                f"once at the top (a task may set {sorted(PER_TASK)})"
            )
        merged = {**shared, "public_model": name, **own, "request_id_scope": name}
        if "feedback_dir" not in own and "feedback_dir" in shared:
            merged["feedback_dir"] = Path(shared["feedback_dir"]) / name
        if "state_file" not in own and shared.get("state_file") is not None:
            state_file = Path(shared["state_file"])
            merged["state_file"] = state_file.with_name(f"{name}.{state_file.name}")
        found[name] = router_config(merged, f"{where}: tasks.{name}")
    for what in ("public_model", "state_file", "feedback_dir"):
        seen: dict[object, str] = {}
        for name, config in found.items():
            value = getattr(config, what)
            if value is not None and value in seen:
                raise RouterConfigError(
                    f"{where}: tasks {seen[value]} and {name} share {what} {str(value)!r}: "
                    "each task needs its own"
                )
            seen[value] = name
    return TasksConfig(found)


def load_config(path: Path) -> RouterConfig | TasksConfig:
    """A router config file: one task's (``arms:``), or several tasks' (``tasks:``)."""
    data = read_config_file(path)
    if isinstance(data, dict) and "tasks" in data:
        return tasks_config(data, str(path))
    return router_config(data, str(path))


def create_any_app(config: RouterConfig | TasksConfig) -> FastAPI:
    return create_tasks_app(config) if isinstance(config, TasksConfig) else create_app(config)


def create_tasks_app(config: TasksConfig, clock: Clock = SYSTEM) -> FastAPI:
    """The router for several tasks: each task's router at ``/tasks/<task>``, and the
    OpenAI endpoints at the top dispatching on the body's ``model``."""
    app = FastAPI(
        title="tuneloop canary router (tasks)",
        lifespan=_lifespan,
        exception_handlers={Refused: _refused},
    )
    apps = {task: create_app(own, clock) for task, own in config.tasks.items()}
    app.state.tasks = config
    app.state.apps = apps
    states: dict[str, RouterState] = {task: sub.state.router for task, sub in apps.items()}
    app.state.states = states
    for task, state in states.items():
        state.sibling_ids = {other: s.ids for other, s in states.items() if other != task}
    app.include_router(router)
    for task, sub in apps.items():
        app.mount(f"/tasks/{task}", sub)
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    # Starlette runs no lifespan of a mounted app: each task's pools and lease watch
    # open and close here.
    async with AsyncExitStack() as stack:
        for sub in app.state.apps.values():
            await stack.enter_async_context(sub.router.lifespan_context(sub))
        yield


def _states(request: Request) -> dict[str, RouterState]:
    states: dict[str, RouterState] = request.app.state.states
    return states


def _first(request: Request) -> RouterConfig:
    return next(iter(_states(request).values())).config


async def _refused(request: Request, error: Refused) -> Response:
    task = getattr(request.state, "task", None)
    if task is not None:
        _states(request)[task].refused[request.url.path, error.status] += 1
    return refusal(request.url.path, error)


async def _dispatch(request: Request, path: str) -> Response:
    limits = _first(request).limits
    body = await read_object(request, limits.request_bytes, limits.json_depth)
    config: TasksConfig = request.app.state.tasks
    by_model = config.by_model()
    asked = body.get("model")
    task = by_model.get(asked) if isinstance(asked, str) else None
    if task is None:
        said = "no model" if asked is None else f"model {asked!r}"
        return proxy.openai_error(
            404,
            f"{said}: this router serves one model per task; ask for one of {sorted(by_model)}",
            "invalid_request_error",
            "model_not_found",
        )
    request.state.task = task
    return await proxy.forward(_states(request)[task], request, path, body)


@router.post(proxy.PROXIED[0])
async def chat_completions(request: Request) -> Response:
    return await _dispatch(request, proxy.PROXIED[0])


@router.post(proxy.PROXIED[1])
async def completions(request: Request) -> Response:
    return await _dispatch(request, proxy.PROXIED[1])


@router.get("/v1/models")
async def models(request: Request) -> dict[str, object]:
    config: TasksConfig = request.app.state.tasks
    return {
        "object": "list",
        "data": [
            {"id": model, "object": "model", "owned_by": "tuneloop", "task": task}
            for model, task in config.by_model().items()
        ],
    }


@router.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@router.post(FEEDBACK)
async def feedback_where(request: Request) -> Response:
    tasks = sorted(_states(request))
    return JSONResponse(
        {
            "detail": f"this router serves several tasks: POST /tasks/<task>{FEEDBACK}, so the "
            f"flag lands in that task's incoming folder (tasks: {tasks})",
            "kind": "task_needed",
        },
        status_code=404,
    )


@router.get("/admin/status")
async def status(
    request: Request, authorization: Annotated[str | None, Header()] = None
) -> dict[str, object]:
    """Every task's ``/admin/status``, by task."""
    check_admin(_first(request).admin_token_env, authorization)
    return {
        "tasks": {task: control.status(state) for task, state in _states(request).items()},
    }
