"""``tuneloop register-base``, ``release``, ``approve``, ``reject``, ``serve``, ``wait``,
``traffic``, ``rollback`` and ``status``: a model in front of users, and the people who decide
how much traffic it gets."""

from __future__ import annotations

import argparse
import getpass
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tuneloop.params import Params

# Seconds a release started just before `tuneloop approve --wait-for-pause` may take to show up.
STARTUP_S = 60.0


def _register_base(args: argparse.Namespace) -> int:
    from tuneloop.params import load_params
    from tuneloop.tracking import registry

    done = registry.register_base(load_params())
    print(done.reasons[0])
    return 0


def _the_waiting_release(flow_run: str | None, wait: float) -> str:
    """The flow run to answer: the one given, or the only release waiting (for up to wait s)."""
    import time

    from tuneloop.release import approval

    if flow_run:
        return flow_run
    started = time.monotonic()
    deadline = started + wait
    while True:
        waiting = approval.waiting_releases()
        if len(waiting) > 1:
            shown = ", ".join(f"{w['name']} ({w['id']})" for w in waiting)
            raise approval.ApprovalError(f"several releases are waiting ({shown}); name one")
        if waiting:
            return waiting[0]["id"]
        # Waiting only makes sense while a release runs that may still pause (after a minute:
        # a release started just now may not have reached the server yet).
        running = ("RUNNING", "PENDING", "SCHEDULED")
        if time.monotonic() - started > STARTUP_S and not approval.waiting_releases(running):
            deadline = 0.0
        if time.monotonic() >= deadline:
            raise approval.ApprovalError(
                "no release is waiting for approval (nor running); `tuneloop status` shows "
                "where it stands"
            )
        time.sleep(1.0)


def _approve(args: argparse.Namespace) -> int:
    from tuneloop.release import approval

    try:
        run = _the_waiting_release(args.flow_run, args.wait)
        done = approval.approve(
            run, args.approver, args.percent, args.comment, args.acknowledge_inconclusive
        )
    except approval.ApprovalError as error:
        print(f"tuneloop approve: {error}", file=sys.stderr)
        return 1
    if done.decision == "review done":  # it waited for its blind review, not for a step
        print(f"{done.flow_run}: its blind review is judged again ({args.approver})")
    else:
        shown = f"challenger -> {done.next_percent} % by {args.approver}"
        print(f"approved {done.flow_run}: {shown}")
    return 0


def _reject(args: argparse.Namespace) -> int:
    from tuneloop.params import load_params
    from tuneloop.release import approval
    from tuneloop.release.admin import AdminError

    try:
        run = _the_waiting_release(args.flow_run, args.wait)
        done = approval.reject(run, args.approver, args.comment)
    except approval.ApprovalError as error:
        print(f"tuneloop reject: {error}", file=sys.stderr)
        return 1
    print(
        f"rejected {done.flow_run} by {args.approver}: rollback requested; the release rolls "
        "the challenger back to 0 % when it reads the answer (within seconds)",
        flush=True,
    )
    if args.watch <= 0:
        return 0
    try:
        change = approval.wait_rollback(load_params(), args.approver, args.watch)
    except AdminError as error:
        print(f"tuneloop reject: cannot watch the routers ({error}); see `tuneloop status`")
        return 0
    if change is None:
        print(
            f"not rolled back yet after {args.watch:g} s: the release acts on the answer at its "
            "next poll; `tuneloop status` shows the last change"
        )
    else:
        print(f"rolled back: the challenger gets 0 % since {change['at']} ({change['reason']})")
    return 0


def _release(args: argparse.Namespace) -> int:
    import yaml

    from flows.release import release, release_outcome

    overrides = None
    if args.overrides:
        overrides = yaml.safe_load(Path(args.overrides).read_text(encoding="utf-8")) or {}
    state = release(repo=Path(args.repo), overrides=overrides, task=args.task, return_state=True)
    outcome = release_outcome(state)
    print(f"release {outcome.outcome}: {outcome.reason}")
    if args.json:
        print(outcome.model_dump_json(indent=2))
    return 0 if state.is_completed() else 1


def _serve(args: argparse.Namespace) -> int:
    from tuneloop.params import load_params
    from tuneloop.release.backends import LoraModule
    from tuneloop.release.serve import NotServable, load_version, serve_base_main, serve_main
    from tuneloop.release.vllm_engine import AdapterRefused

    adapters = []
    for given in args.adapter:
        name, sep, folder = given.partition("=")
        if not sep or not name or not folder:
            print(f"tuneloop serve: --adapter {given!r}: give NAME=FOLDER", file=sys.stderr)
            return 2
        adapters.append(LoraModule(name, Path(folder).resolve()))
    try:
        params = load_params()
        if args.alias == "base":
            if adapters or args.on_base or args.backend == "transformers":
                print(
                    "tuneloop serve base: vLLM only, with no adapter at start (load them with "
                    "`tuneloop serve champion --on-base`)",
                    file=sys.stderr,
                )
                return 2
            serve_base_main(params, args.port, args.host)
        elif args.on_base:
            served, took = load_version(params, args.alias)
            print(
                f"loaded {args.alias} onto {served.base_url} as {served.model} in {took:.2f} s; "
                f"router arm: {json.dumps(served.arm())}"
            )
            return 0
        serve_main(
            params, args.alias, args.port, args.host, args.backend, adapters=adapters, fmt=args.fmt
        )
    except (NotServable, AdapterRefused) as error:
        print(f"tuneloop serve: {error}", file=sys.stderr)
        return 1
    return 0  # not reached: serve_main becomes the backend


def _wait(args: argparse.Namespace) -> int:
    from tuneloop.release.backends import wait_healthy

    for url in args.urls:
        try:
            waited = wait_healthy(url, timeout=args.timeout)
        except TimeoutError as error:
            print(f"tuneloop wait: {error}", file=sys.stderr)
            return 1
        print(f"{url} answers (after {waited:.1f} s)")
    return 0


def _traffic(args: argparse.Namespace) -> int:
    import os

    from tuneloop.demo import customers
    from tuneloop.release.backends import wait_healthy

    token = None
    if args.feedback_token_env:
        token = os.environ.get(args.feedback_token_env)
        if not token:
            print(f"tuneloop traffic: ${args.feedback_token_env} is not set", file=sys.stderr)
            return 1
    if args.rate is not None and not args.rate > 0:
        print(
            f"tuneloop traffic: --rate is requests a second, above 0 (got {args.rate})",
            file=sys.stderr,
        )
        return 2
    router = args.router.rstrip("/")
    wait_healthy(router, timeout=60)
    report = customers.run(
        router,
        requests=args.requests,
        users=args.users,
        seed=args.seed,
        month=args.month,
        feedback_token=token,
        concurrency=args.concurrency,
        max_tokens=args.max_tokens,
        rate=args.rate,
    )
    print(json.dumps(report.as_dict(), indent=2))
    return 0


def _for_task(params: Params, task: str | None) -> Params:
    """The params of ``task``; a project of several tasks must name one."""
    return params.the_task(task, "give --task")


def _rollback(args: argparse.Namespace) -> int:
    from tuneloop.params import ParamsError, load_params
    from tuneloop.release import approval

    try:
        done = approval.rollback(_for_task(load_params(), args.task), args.reason, args.operator)
    except (approval.ApprovalError, ParamsError) as error:
        print(f"tuneloop rollback: {error}", file=sys.stderr)
        return 1
    print(
        f"rolled back on {len(done['routers'])} router(s) in {done['seconds'] * 1000:.0f} ms "
        f"by {done['operator']}: the challenger gets 0 % ({done['reason']})"
    )
    if done["release_run"]:
        print(f"recorded on the release's MLflow run {done['release_run']}")
    return 0


def unreachable_scheduler() -> tuple[type[BaseException], ...]:
    """What asking Slurm or the Kubernetes API raises when it cannot answer: no client, no
    config, the API refusing or out of reach."""
    from kubernetes.client.exceptions import ApiException
    from kubernetes.config import ConfigException
    from urllib3.exceptions import HTTPError

    from tuneloop.cluster.slurm import SlurmError

    return (SlurmError, ApiException, ConfigException, HTTPError, OSError)


def training_job_line(params: Params, trainjobs: Any = None) -> str | None:
    """The newest cluster job the train stage submitted, as the scheduler sees it now.

    ``trainjobs``: the Kubernetes TrainJob API to ask (``TrainJobs``); by default the one the
    kube config or the pod's service account points at."""
    launcher = params.train.launcher
    if launcher == "local":
        return None
    from tuneloop.cluster.job import describe, latest_submitted

    scheduler = {"slurm": "Slurm", "kubernetes": "Kubernetes"}[launcher]
    submitted = latest_submitted(params.paths.watch)
    if submitted is None:
        return f"no {scheduler} job submitted from this project yet"
    try:
        if launcher == "slurm":
            from tuneloop.cluster import slurm

            now = slurm.status(submitted.job_id)
        else:
            from tuneloop.cluster.kubernetes import TrainJobs

            jobs = trainjobs or TrainJobs(params.cluster.namespace)
            now = jobs.status(submitted.job_id)
    except unreachable_scheduler() as error:
        return f"{scheduler} job {submitted.job_id}: cannot ask {scheduler} ({error})"
    if now is None:
        return f"{scheduler} job {submitted.job_id} has ended ({scheduler} no longer lists it)"
    return f"{scheduler} {describe(now)}"


def _status(args: argparse.Namespace) -> int:
    from tuneloop.params import load_params
    from tuneloop.release import approval

    params = load_params()
    if (training := training_job_line(params)) is not None:
        print(f"training: {training}")
    if not params.several_tasks:
        result = approval.status(params.the_task())
        if args.json:
            print(json.dumps(result, indent=2, ensure_ascii=False, default=str))
        else:
            print(approval.format_status(result))
        return 0
    # Every task: its router, its registry aliases, its figures.
    every = {task: approval.status(params.for_task(task)) for task in params.task_names()}
    if args.json:
        print(json.dumps({"tasks": every}, indent=2, ensure_ascii=False, default=str))
    else:
        print(
            "\n\n".join(
                f"task {task} ({params.public_model(task)})\n{approval.format_status(result)}"
                for task, result in every.items()
            )
        )
    return 0


def add_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    base = commands.add_parser(
        "register-base",
        help="register the base model as the first champion (once), for the first release",
    )
    base.set_defaults(run=_register_base)

    approve = commands.add_parser(
        "approve", help="approve the next traffic step of a release waiting for approval"
    )
    approve.add_argument("--approver", required=True, help="your name, kept with the release")
    approve.add_argument(
        "--percent", type=int, help="challenger percent to move to (default: the planned step)"
    )
    approve.add_argument("--comment", default="", help="why, kept with the release")
    approve.add_argument(
        "--acknowledge-inconclusive",
        action="store_true",
        help="I have read the rules the gate could not settle (`tuneloop status` lists them); "
        "required when there are any (gate.on_inconclusive: warn)",
    )
    approve.set_defaults(run=_approve)

    reject = commands.add_parser(
        "reject", help="reject a release waiting for approval: the challenger goes to 0 %%"
    )
    reject.add_argument("--approver", required=True, help="your name, kept with the release")
    reject.add_argument("--comment", required=True, help="why; recorded as the rollback reason")
    reject.add_argument(
        "--watch",
        type=float,
        default=30.0,
        help="seconds to watch the routers (release.routers) until the rollback happened "
        "(default 30; 0: do not wait)",
    )
    reject.set_defaults(run=_reject)
    for command in (approve, reject):
        command.add_argument(
            "flow_run",
            nargs="?",
            help="the paused release's flow-run id or name (default: the only one waiting)",
        )
        command.add_argument(
            "--wait-for-pause",
            dest="wait",
            type=float,
            default=0.0,
            help="without a flow run: seconds to wait for a release to pause (default 0)",
        )

    release = commands.add_parser(
        "release", help="run the release flow now: canary the challenger, approvals, promote"
    )
    release.add_argument("--repo", default=".", help="the tuneloop project folder")
    release.add_argument(
        "--overrides",
        help="a YAML file of params.yaml values for this release only (e.g. configs/demo.yaml)",
    )
    release.add_argument("--json", action="store_true", help="also print the outcome")
    release.add_argument(
        "--task", help="the task to release (the others stay); a project of one task: its one"
    )
    release.set_defaults(run=_release)

    serve = commands.add_parser(
        "serve",
        help="serve a registry alias with vLLM (its own environment: make serve-setup) or "
        "transformers serve, recorded in run/serve/ for the router",
    )
    serve.add_argument(
        "alias",
        choices=["champion", "challenger", "base"],
        help="base: the base model on vLLM with LoRA enabled and no adapter, recorded in "
        "run/serve/base.json, for --on-base",
    )
    serve.add_argument(
        "--on-base",
        action="store_true",
        help="load the alias's adapter version from the registry onto the running `tuneloop "
        "serve base` (no restart) and record it for the router, instead of starting a server",
    )
    serve.add_argument("--port", type=int, default=8001, help="listen port (default 8001)")
    serve.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    serve.add_argument(
        "--backend",
        choices=["auto", "transformers", "vllm"],
        default=None,
        help="the engine, instead of params.yaml's serve.engine (auto: vLLM where make "
        "serve-setup built it, else transformers)",
    )
    serve.add_argument(
        "--adapter",
        action="append",
        default=[],
        metavar="NAME=FOLDER",
        help="a LoRA adapter vLLM serves as model NAME on the alias's folder (repeatable); "
        "checked against vLLM's limits and the base first",
    )
    serve.add_argument(
        "--format",
        dest="fmt",
        choices=["merged", "fp8", "nvfp4", "nvfp4a16"],
        default=None,
        help="the version's folder to serve (default: fp8 where it has one, else merged); an "
        "FP4 export is checked against this host's GPU first (Blackwell runs nvfp4 natively)",
    )
    serve.set_defaults(run=_serve)

    wait = commands.add_parser(
        "wait", help="wait until each URL's /health answers (vLLM: once its model is loaded)"
    )
    wait.add_argument("urls", nargs="+", help="backend or router root URLs")
    # vLLM on 2 busy CPU cores was healthy after 289 s.
    wait.add_argument("--timeout", type=float, default=600.0, help="seconds (default 600)")
    wait.set_defaults(run=_wait)

    _add_traffic(commands)

    rollback = commands.add_parser(
        "rollback",
        help="challenger to 0 %% on every router now (an incident, with or without a release)",
    )
    rollback.add_argument("--reason", required=True, help="why; recorded by every router")
    rollback.add_argument(
        "--operator",
        default=getpass.getuser(),
        help="who; recorded beside the reason (default: your OS user name)",
    )
    rollback.add_argument(
        "--task", help="the task to roll back (the others stay); a project of one task: its one"
    )
    rollback.set_defaults(run=_rollback)

    status = commands.add_parser(
        "status", help="live weights and lease, per-arm figures, registry aliases, releases waiting"
    )
    status.add_argument("--json", action="store_true", help="print it as JSON")
    status.set_defaults(run=_status)


def _add_traffic(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``tuneloop traffic``: the demo's customers, by hand."""
    traffic = commands.add_parser(
        "traffic", help="demo customers through the router: sticky users, wrong answers flagged"
    )
    traffic.add_argument("--router", required=True, help="the router's root URL")
    traffic.add_argument("--requests", type=int, default=1000, help="requests (default 1000)")
    traffic.add_argument("--users", type=int, default=300, help="distinct user ids (default 300)")
    traffic.add_argument("--concurrency", type=int, default=4, help="in flight (default 4)")
    traffic.add_argument("--max-tokens", type=int, default=24, help="per answer (default 24)")
    traffic.add_argument(
        "--rate",
        type=float,
        default=None,
        help="requests a second, started evenly (default: the next as soon as an answer comes)",
    )
    traffic.add_argument(
        "--seed", type=int, default=0, help="of the customers' questions and user ids"
    )
    traffic.add_argument("--month", type=int, default=1, help="which month's questions (default 1)")
    traffic.add_argument(
        "--feedback-token-env",
        help="env var with a feedback producer's token: wrong answers are flagged with it",
    )
    traffic.set_defaults(run=_traffic)
