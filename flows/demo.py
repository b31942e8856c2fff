"""The loop, end to end on one machine: N monthly cycles of retrain -> release -> feedback.

``tuneloop demo --months 2`` (``make demo`` runs it with two tasks: ``configs/demo-tasks.yaml``,
the support desk and the order intake on one base; every step below is then per task, the
releases at once on one router of both tasks, ``release_tasks``). Each month:

1. the month's exports are seeded into ``incoming/`` (``tuneloop.demo.domain``: month 2 launches a
   product the champion does not know);
2. the ``retrain`` flow runs ingest -> evaluate on everything in ``incoming/``, the router's
   feedback from last month's release included; training starts from the champion
   (``train.init_from``), and the gate compares with it;
3. a candidate that passed is released by the ``release`` flow, for real: the champion and the
   challenger are served by ``transformers serve``, behind the canary router, while demo
   customers (``tuneloop.demo.customers``) ask questions and flag wrong answers through the router's
   feedback API, as a support tool does; those flags land in ``incoming/``, attributed to the
   arm and model version that answered, for next month;
4. at each approval pause the demo prints the ``tuneloop approve`` command for a person in
   another terminal; when nobody answers within ``--approval-wait`` seconds it approves as
   ``demo-operator``, and the release records that name like any approver's.

Before the first month the base model is registered as the first champion (the model a first
release is compared with). The release runs with ``configs/demo.yaml``'s short intervals,
passed as the flow's ``overrides`` parameter: the same code path as a real release.

Flows orchestrate: this module starts services and calls the two flows; every decision is the
flows' own. It needs a Prefect server that another terminal can reach (for ``tuneloop
approve``): ``PREFECT_API_URL`` if set, else it starts ``prefect server start`` on
127.0.0.1:4200 for the length of the demo. Likewise an MLflow server over the project's store
(``tuneloop.tracking.server``), which the stages log to without importing MLflow.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml
from mlflow.tracking import MlflowClient

from tuneloop.demo import customers, domain, orders, reviewers
from tuneloop.demo.report import (
    DemoMonth,
    DemoRelease,
    DemoReview,
    TaskMonth,
    Traffic,
)
from tuneloop.net import free_port
from tuneloop.orchestration import forkserver
from tuneloop.orchestration.flow_results import (
    PipelineRun,
    ReleaseOutcome,
    TaskFailed,
    TaskOutcome,
    TasksRun,
    TaskUnchanged,
)
from tuneloop.params import DemoParams, Params, load_params
from tuneloop.release import approval, signoff
from tuneloop.release.backends import Backend, start_transformers_serve, wait_healthy
from tuneloop.review.store import ReviewStore
from tuneloop.tracking import registry, runs, server

log = logging.getLogger("tuneloop.demo")

DEMO_OVERRIDES = Path("configs/demo.yaml")
DEMO_APPROVER = "demo-operator"
PREFECT_PORT = 4200
SECRET_ENV = "TUNELOOP_ROUTER_SECRET"
FEEDBACK_TOKEN_ENV = "TUNELOOP_DEMO_FEEDBACK_TOKEN"
# Demo customers: ids the router buckets by, how many requests a burst sends, and how many
# wait for an answer at once (enough that the 10 % arm sees a few per analysis interval).
USERS = 300
BURST = 24
CONCURRENCY = 4
# The customers' questions: BURSTS different bursts (1,536 questions, about what one release
# sees on 2 cores), then the same ones again. What they flag is next month's training data, so
# it must not depend on how long the release ran: a slower machine or a longer approval wait
# repeats questions (clean keeps each correction once) instead of teaching month 2 more.
BURSTS = 64


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@contextlib.contextmanager
def _use_api(url: str) -> Iterator[str]:
    """This process's Prefect client (settings are read once, so not through os.environ alone)
    and its children (``os.environ``) talk to ``url``."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    previous = os.environ.get("PREFECT_API_URL")
    os.environ["PREFECT_API_URL"] = url
    try:
        with temporary_settings(updates={PREFECT_API_URL: url}):
            yield url
    finally:
        if previous is None:
            os.environ.pop("PREFECT_API_URL", None)
        else:
            os.environ["PREFECT_API_URL"] = previous


def _stop(process: subprocess.Popen[Any]) -> None:
    """Terminate a child the demo started, then kill it if 20 s were not enough."""
    process.terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=20)
    if process.poll() is None:
        process.kill()


def _send_queued_logs() -> None:
    """Flow-run logs still queued for the API, sent before the server stops (else they fail
    at exit, as 'Error logging to API', after the summary)."""
    from prefect.logging.handlers import APILogWorker

    try:
        APILogWorker.drain_all(timeout=10, at_exit=False)
    except Exception as error:  # the logs are in the terminal and logs/ either way
        log.debug("sending queued flow-run logs: %s", error)


@contextlib.contextmanager
def prefect_server(logs: Path) -> Iterator[str]:
    """A Prefect API other terminals can reach: ``PREFECT_API_URL``, or one started here."""
    url = os.environ.get("PREFECT_API_URL")
    if url:
        yield url
        return
    url = f"http://127.0.0.1:{PREFECT_PORT}/api"
    if _healthy(f"{url}/health"):  # the user's own `prefect server start`
        with _use_api(url):
            yield url
        return
    logs.mkdir(parents=True, exist_ok=True)
    command = [
        str(Path(sys.executable).with_name("prefect")),
        *("server", "start", "--host", "127.0.0.1", "--port", str(PREFECT_PORT)),
    ]
    with (logs / "prefect-server.log").open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300  # 5-15 s on an idle machine; minutes on a busy one
        while not _healthy(f"{url}/health"):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"prefect server did not start (see {logs / 'prefect-server.log'}); start "
                    "one yourself and set PREFECT_API_URL"
                )
            time.sleep(1)
        with _use_api(url):
            try:
                yield url
            finally:
                _send_queued_logs()
    finally:
        _stop(process)


@dataclass
class Stack:
    """The two backends and the router of one release."""

    router_url: str
    feedback_token: str
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    backends: list[Backend] = field(default_factory=list)
    stream: bool = False  # customers ask for streamed answers (TTFT in the analysis)

    def stop(self) -> None:
        for process in self.processes:
            process.terminate()
        for process in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=20)
            if process.poll() is None:
                process.kill()
        for backend in self.backends:
            backend.stop()


def _threads(params: Params, backends: int) -> int:
    """Each backend's share of the host's cores. With every core each (torch's default), the
    champion busy with the demo's customers starved the idle challenger: on 2 cores the load
    test measured the challenger's time per token at 4-8x the champion's; at one thread each,
    they measured the same."""
    return params.serve.cpu_threads or max(1, (os.cpu_count() or 1) // backends)


def _serve_arms(
    params: Params, wanted: tuple[str, ...], served: Path, threads: int, stack: Stack
) -> dict[str, dict[str, Any]]:
    """Each of ``wanted``'s registry aliases behind its own ``transformers serve``, added to
    ``stack``; the router's arms naming them."""
    client = MlflowClient(runs.tracking_uri())
    name = params.tracking.registered_model
    arms: dict[str, dict[str, Any]] = {}
    for arm in wanted:
        version = registry.find_alias(name, arm, client)
        if version is None:
            raise RuntimeError(f"{name} has no {arm!r} version to serve")
        folder = registry.download_folder(version, registry.MERGED, served / arm)
        backend = start_transformers_serve(folder, free_port(), served / f"{arm}.log", threads)
        stack.backends.append(backend)
        arms[arm] = {
            "base_url": backend.url,
            "model": backend.model,
            "model_version": str(version.version),
        }
    return arms


def serve_release(params: Params, repo: Path, month: int) -> Stack:
    """Champion and challenger from the registry, and the canary router in front of them, with
    the admin and feedback tokens in this process's env.

    ``serve.engine: vllm``: one vLLM of the base with both arms as LoRA adapters loaded at run
    time (``serve_on_vllm``), customers streaming. Otherwise (auto too) each arm behind its own
    ``transformers serve``: up in 16 s here against vLLM's 2 minutes, which keeps the tiny
    demo quick.
    """
    served = repo / "run" / f"month-{month}"
    if params.serve.engine == "vllm":
        return serve_on_vllm(params, repo, served)
    stack = Stack("", "")
    try:
        wanted = (registry.CHAMPION, registry.CHALLENGER)
        arms = _serve_arms(params, wanted, served, _threads(params, 2), stack)
    except BaseException:
        stack.stop()
        raise
    return start_router(params, repo, served, {"arms": arms}, stack)


def serve_tasks(params: Params, repo: Path, month: int, releasing: list[str]) -> Stack:
    """One router of tasks (``serving.tasks``) over every task's champion, and the challenger
    of each task in ``releasing``; a task with no release has its champion in both arms, its
    challenger at 0 %, so its traffic stays where it is. Each model behind its own
    ``transformers serve`` (the tiny demo's engine, ``serve_release``)."""
    served = repo / "run" / f"month-{month}"
    stack = Stack("", "")
    threads = _threads(params, len(params.tasks) + len(releasing))
    routes: dict[str, Any] = {}
    try:
        for task in params.task_names():
            wanted = (registry.CHAMPION, registry.CHALLENGER)[: 2 if task in releasing else 1]
            arms = _serve_arms(params.for_task(task), wanted, served / task, threads, stack)
            arms.setdefault(registry.CHALLENGER, arms[registry.CHAMPION])
            routes[task] = {"arms": arms}
    except BaseException:
        stack.stop()
        raise
    return start_router(params, repo, served, {"tasks": routes}, stack)


def serve_on_vllm(params: Params, repo: Path, served: Path) -> Stack:
    """One vLLM of the base model, LoRA enabled (``tuneloop serve base``), champion and
    challenger loaded onto it as adapters (``tuneloop serve <alias> --on-base``; the registered
    base is the base's own model), and the router in front, its arms naming them."""
    from tuneloop.release import serve

    name = params.tracking.registered_model
    backend, base = serve.start_base(params, free_port(), served / "vllm.log", served / "serve")
    stack = Stack("", "", backends=[backend], stream=True)
    arms: dict[str, dict[str, Any]] = {}
    try:
        waited = backend.wait_healthy(timeout=900)  # 2-4 min on 2 cores
        print(f"vLLM ({base.engine_version}) of {base.base} at {base.base_url}: {waited:.0f} s")
        for arm in (registry.CHAMPION, registry.CHALLENGER):
            on_base, took = serve.load_version(params, arm, served / "serve")
            arms[arm] = on_base.arm()
            print(f"  {arm}: {name} v{on_base.version} as {on_base.model} ({took:.2f} s)")
    except BaseException:
        stack.stop()
        raise
    return start_router(params, repo, served, {"arms": arms}, stack)


def start_router(
    params: Params, repo: Path, served: Path, routes: dict[str, Any], stack: Stack
) -> Stack:
    """The canary router over ``routes`` (``{"arms": ...}``, or a router of tasks'
    ``{"tasks": ...}``), added to ``stack``; every backend and it healthy."""
    # Fresh secrets for the demo's router, in this process's env (the router and the release
    # flow read them from there): admin API, request-id signing, the demo support tool's token.
    os.environ.setdefault(params.release.admin_token_env, secrets.token_hex(16))
    os.environ.setdefault(SECRET_ENV, secrets.token_hex(32))
    feedback_token = os.environ.setdefault(FEEDBACK_TOKEN_ENV, secrets.token_hex(16))
    config = {
        **routes,
        "feedback_dir": str(repo / params.paths.incoming),
        "state_file": str(served / "router-state.json"),
        "admin_token_env": params.release.admin_token_env,
        "request_id_secret_env": SECRET_ENV,
        "feedback_producers": [
            {
                "name": "demo-support-tool",
                "token_env": FEEDBACK_TOKEN_ENV,
                "rate_per_minute": 600,
                "burst": 100,
            }
        ],
    }
    config_file = served / "router.yaml"
    config_file.write_text(yaml.safe_dump(config, sort_keys=False))
    port = free_port()
    stack.router_url, stack.feedback_token = f"http://127.0.0.1:{port}", feedback_token
    listen = ("--host", "127.0.0.1", "--port", str(port))
    with (served / "router.log").open("wb") as out:
        router = subprocess.Popen(
            [sys.executable, "-m", "serving.router", "--config", str(config_file), *listen],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=repo,
        )
    stack.processes.append(router)
    try:
        for backend in stack.backends:
            waited = backend.wait_healthy(timeout=300)
            log.info("backend %s healthy after %.0f s", backend.url, waited)
        wait_healthy(stack.router_url, timeout=60, process=router)
    except BaseException:
        stack.stop()
        raise
    return stack


def keep_customers_coming(
    stack: Stack,
    month: int,
    stop: threading.Event,
    task: str | None = None,
    rate: float | None = None,
) -> customers.TrafficReport:
    """Demo traffic in bursts until ``stop``; the sum of what every burst saw. ``task``: on a
    router of tasks, that task's customers (``customers.ASKS``), flagging wrong answers if its
    demo task has a feedback producer (``DEMO_TASKS``). ``rate``: requests a second
    (``demo.requests_per_s``)."""
    total = customers.TrafficReport()
    demo_task = DEMO_TASKS[task or "support"]  # a project of one task: the support desk
    burst = 0
    while not stop.is_set():
        seen = customers.run(
            stack.router_url,
            requests=BURST,
            users=USERS,
            seed=burst % BURSTS,
            month=month + 1,  # customers ask about what the shop sells now, next month's world
            feedback_token=stack.feedback_token if demo_task.flags else None,
            concurrency=CONCURRENCY,
            max_tokens=demo_task.max_tokens,
            stop=stop,
            stream=stack.stream,
            task=task or "support",
            model=task or "tuneloop",  # a router of tasks: the task's public name
            feedback_path="/v1/feedback" if task is None else f"/tasks/{task}/v1/feedback",
            rate=rate,
        )
        for arm, tally in seen.arms.items():
            mine = total.tally(arm)
            for key, value in vars(tally).items():
                setattr(mine, key, getattr(mine, key) + value)
        total.feedback_refused.update(seen.feedback_refused)
        total.seconds += seen.seconds
        burst += 1
    return total


def answer_for_nobody(
    wait_s: float, stop: threading.Event, answered: list[approval.Answered]
) -> None:
    """Print how to approve each paused release; approve as ``demo-operator`` after ``wait_s``."""
    seen: dict[str, float] = {}
    while not stop.wait(1.0):
        try:
            waiting = approval.waiting_releases()
        except Exception as error:  # the server restarting: try again next second
            log.debug("waiting_releases: %s", error)
            continue
        for run in waiting:
            key = f"{run['id']}@{run['since']}"
            if key not in seen:
                seen[key] = time.monotonic()
                print(
                    f"\n>>> The release {run['name']} waits for a person. From another terminal:\n"
                    f"      PREFECT_API_URL={os.environ.get('PREFECT_API_URL')} "
                    f".venv/bin/tuneloop approve {run['id']} --approver YOUR_NAME\n"
                    f"    (or reject it with --comment WHY; the Prefect UI at "
                    f"http://127.0.0.1:{PREFECT_PORT} shows the form). The demo answers as "
                    f"{DEMO_APPROVER!r} in {wait_s:.0f} s.\n",
                    flush=True,
                )
            elif time.monotonic() - seen[key] >= wait_s:
                try:
                    done = approval.approve(
                        run["id"],
                        DEMO_APPROVER,
                        comment=f"nobody answered within {wait_s:.0f} s; the demo approved",
                    )
                except approval.ApprovalError as error:  # a person answered meanwhile
                    log.info("demo approval not needed: %s", error)
                else:
                    answered.append(done)
                    print(f">>> {DEMO_APPROVER} approved {run['name']}", flush=True)
                seen[key] = float("inf")


def demo_overrides(repo: Path, router_url: str, file: Path = DEMO_OVERRIDES) -> dict[str, Any]:
    """The release flow's ``overrides``: ``file``'s ``release`` group, and the demo's router."""
    release: dict[str, Any] = yaml.safe_load((repo / file).read_text()).get("release") or {}
    return {"release": release | {"routers": [router_url]}}


def release_month(
    repo: Path,
    params: Params,
    month: int,
    approval_wait_s: float,
    overrides_file: Path = DEMO_OVERRIDES,
    releasing: list[str] | None = None,
) -> dict[str, DemoRelease]:
    """Serve, release (with demo traffic and feedback), tear down; what happened.

    ``releasing``: in a project of tasks, the tasks whose challenger is released, all at once
    on one router of every task (``serve_tasks``), each task's customers asking all along.
    What happened to each, by task (a project of one task: its one, on the router's own arms).
    """
    from flows.release import release, release_outcome

    tasks = tuple(params.tasks) if params.several_tasks else ()  # none: one task
    if tasks:
        stack = serve_tasks(params, repo, month, releasing or [])
    else:
        stack = serve_release(params, repo, month)
    stop = threading.Event()
    answered: list[approval.Answered] = []
    seen: dict[str | None, customers.TrafficReport] = {}
    askers = [
        threading.Thread(
            target=lambda t=task: seen.__setitem__(
                t, keep_customers_coming(stack, month, stop, t, params.demo.requests_per_s)
            ),
            daemon=True,
        )
        for task in (tasks or (None,))
    ]
    # The operator talks to Prefect: it needs this thread's settings, which live in contextvars.
    operator = threading.Thread(
        target=contextvars.copy_context().run,
        args=(answer_for_nobody, approval_wait_s, stop, answered),
        daemon=True,
    )
    for thread in (*askers, operator):
        thread.start()
    states: dict[str | None, Any] = {}
    try:
        overrides = demo_overrides(repo, stack.router_url, overrides_file)

        def release_task(task: str | None) -> None:
            states[task] = release(repo=repo, overrides=overrides, task=task, return_state=True)

        # Every task's release at once, each its own flow run holding its task's lease on the
        # router (serving.tasks): what a team does, and one release's time for all of them.
        releases = [
            threading.Thread(target=contextvars.copy_context().run, args=(release_task, task))
            for task in ((releasing or []) if tasks else (None,))
        ]
        for thread in releases:
            thread.start()
        for thread in releases:
            thread.join()
    finally:
        stop.set()
        for thread in askers:
            thread.join(timeout=120)
        operator.join(timeout=10)
        stack.stop()
    outcomes: dict[str, DemoRelease] = {}
    for task, state in states.items():
        run_id = str(state.state_details.flow_run_id)
        outcomes[task or params.task_names()[0]] = DemoRelease(
            **release_outcome(state).model_dump(),
            state=state.name,
            message=state.message,
            demo_approvals=[a for a in answered if a.flow_run_id == run_id],
            traffic=Traffic.model_validate(seen[task].as_dict()) if task in seen else None,
        )
    return outcomes


@dataclass(frozen=True)
class DemoTask:
    """A task the demo has data for: its month's exports, the months they come in, whether
    its customers flag wrong answers through the router, and how long their answers run."""

    seed: Callable[[Path, DemoParams, int], list[Path]]
    months: tuple[int, ...]
    flags: bool
    max_tokens: int


# The two-task demo's tasks (configs/demo-tasks.yaml; the one-task demo is the support desk).
# The order intake exports once: in month 2 its data does not change, so its pipeline does not
# rerun and its champion stays; its callers are a batch job, which flags nothing. The desk's
# answers are one short sentence (~15 tokens; the random base would run on), an order's JSON
# about 30 tokens of the tiny model's.
DEMO_TASKS = {
    "support": DemoTask(domain.seed_month, tuple(domain.MONTH_LABELS), flags=True, max_tokens=24),
    "orders": DemoTask(orders.seed_month, (1,), flags=False, max_tokens=48),
}


# The month whose candidate a simulated panel reviews blind before its release.
REVIEWED_MONTH = 1


def review_month(repo: Path, params: Params, logs: Path) -> DemoReview:
    """The challenger's blind review by the demo's panel, through ``tuneloop review serve``.

    The review is made from the candidate's evaluated answers (``signoff.ensure_review``, as
    the release would), served on a port of its own, voted on by ``tuneloop.demo.reviewers`` over
    HTTP; its results are what the release's approval form and the summary show.
    """
    client = MlflowClient(runs.tracking_uri())
    name = params.tracking.registered_model
    candidate = registry.find_alias(name, registry.CHALLENGER, client)
    champion = registry.find_alias(name, registry.CHAMPION, client)
    if candidate is None or champion is None:
        raise RuntimeError(f"{name} has no challenger and champion to review")
    store = ReviewStore()
    try:
        review = signoff.ensure_review(store, client, candidate, champion)
        base_url = f"http://127.0.0.1:{free_port()}"
        logs.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "tuneloop.cli", "review", "serve"]
        command += ["--port", base_url.rsplit(":", 1)[1]]
        with (logs / "review-server.log").open("wb") as out:
            page = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 120
            while not _healthy(f"{base_url}/healthz"):
                if page.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the review page did not start; see {out.name}")
                time.sleep(0.5)
            suite = params.paths.eval_suites / params.evaluate.suites[0] / "test.jsonl"
            refs = reviewers.references(suite)
            cast = reviewers.run_panel(store, review, base_url, refs, params.demo.seed)
        finally:
            _stop(page)
        judged = signoff.judge_review(store, review, params.gate)
    finally:
        store.close()
    print(f"review {judged.summary()}", flush=True)
    return DemoReview(
        review=review,
        votes_by_reviewer=cast,
        summary=judged.summary(),
        table=judged.results.table(),
        results=judged.results,
        check=judged.check,
    )


def seed_month(params: Params, month: int) -> list[Path]:
    """The month's exports into incoming/: the support desk's, or each demo task's into its
    own folder (``DEMO_TASKS``: a task the demo has no data for is refused, naming them)."""
    incoming = params.paths.incoming
    if not params.several_tasks:
        return domain.seed_month(incoming, params.demo, month)
    unknown = sorted(set(params.tasks) - set(DEMO_TASKS))
    if unknown:
        raise ValueError(f"the demo has data for tasks {sorted(DEMO_TASKS)}, not {unknown}")
    written: list[Path] = []
    for task in params.task_names():
        demo_task = DEMO_TASKS[task]
        if month in demo_task.months:
            written += demo_task.seed(incoming / task, params.demo, month)
    return written


def _registered(retrained: TaskOutcome) -> bool:
    """Whether a retrain registered a new challenger (what a release needs)."""
    if not isinstance(retrained, PipelineRun) or retrained.registration is None:
        return False
    return retrained.registration.registered and retrained.registration.alias == "challenger"


def not_released(retrained: TaskOutcome) -> ReleaseOutcome:
    """Why there was no release, in a sentence a person reads: the registration's reasons
    (the gate's, or an error's), else the task's outcome."""
    if isinstance(retrained, TaskUnchanged):
        said = retrained.reason
    elif isinstance(retrained, TaskFailed):
        said = retrained.error
    elif retrained.registration is not None:
        said = "; ".join(retrained.registration.reasons or ["nothing was registered"])
    else:
        said = "judged, not registered: " + "; ".join(retrained.decision.reasons)
    return ReleaseOutcome(outcome="not released", reason=said)


def release_tasks(
    repo: Path,
    params: Params,
    month: int,
    retrained: TasksRun,
    approval_wait_s: float,
    overrides_file: Path,
    started: float,
) -> DemoMonth:
    """A month after the retrain: each task with a new challenger reviewed (month 1) and
    released (several tasks: on one router of every task); the month's summary by task."""
    outcomes = retrained.tasks
    releasing = [task for task, outcome in outcomes.items() if _registered(outcome)]
    reviews: dict[str, DemoReview] = {}
    if month == REVIEWED_MONTH:
        for task in releasing:
            reviews[task] = review_month(repo, params.for_task(task), repo / "logs")
    released: dict[str, DemoRelease] = {}
    if releasing:
        released = release_month(
            repo, params, month, approval_wait_s, overrides_file, releasing=releasing
        )
    tasks = {
        task: TaskMonth(
            retrain=outcome,
            review=reviews.get(task),
            release=released.get(task) or not_released(outcome),
        )
        for task, outcome in outcomes.items()
    }
    return DemoMonth(
        month=month,
        label=domain.month_label(month),
        seconds=round(time.monotonic() - started, 1),
        tasks=tasks,
        report=retrained.report,
        report_text=retrained.report_text,
        failed=retrained.failed,
    )


def run(
    repo: Path, months: int, approval_wait_s: float, overrides_file: Path = DEMO_OVERRIDES
) -> list[DemoMonth]:
    """``months`` cycles of the loop; the summary of each. ``overrides_file``: the release's
    (its ``release`` group), relative to ``repo``."""
    from flows.retrain import TasksFailed, retrain

    repo = repo.resolve()
    params = load_params(repo / "params.yaml")
    history: list[DemoMonth] = []
    with (
        # One forkserver for every month's stages; it preloads while Prefect's server starts.
        forkserver.serving(repo, repo / "logs"),
        prefect_server(repo / "logs") as api,
        contextlib.chdir(repo),
        server.local_server(repo, repo / "logs") as tracking,
    ):
        print(f"Prefect API {api} (UI: http://127.0.0.1:{PREFECT_PORT})", flush=True)
        print(f"MLflow {tracking}", flush=True)
        runs.setup(params.tracking.experiment)
        # The first champion is the base model, so build it first (a no-op when it is there).
        env = {
            **os.environ,
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        }
        subprocess.run(
            [sys.executable, "-m", "dvc", "repro", "--single-item", "base"],
            cwd=repo,
            env=env,
            check=True,
        )
        for task in params.task_names():  # a project of one task: its own params
            first = registry.register_base(params.for_task(task))
            print(f"registry: {first.reasons[0]}", flush=True)
        for month in range(1, months + 1):
            started = time.monotonic()
            label = domain.month_label(month)
            written = seed_month(params, month)
            print(f"\n=== month {month} ({label}): {len(written)} export file(s) seeded ===")
            try:
                retrained = retrain(repo=repo, params=params)
            except TasksFailed as failed:  # the tasks that ran go on to their releases
                print(f"retrain: {failed}", flush=True)
                retrained = failed.result
            history.append(
                release_tasks(
                    repo, params, month, retrained, approval_wait_s, overrides_file, started
                )
            )
            (repo / "reports").mkdir(exist_ok=True)
            (repo / "reports" / "demo.json").write_text(
                json.dumps(
                    [m.model_dump(mode="json") for m in history], indent=2, ensure_ascii=False
                )
            )
    return history
