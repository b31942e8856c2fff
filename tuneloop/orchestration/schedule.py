"""Prefect deployments from params.yaml's ``schedule`` group: ``tuneloop deploy``.

``prefect.yaml`` holds the deployments (which flow, which work queue, the release trigger);
the values a team tunes live in params.yaml with every other knob:

- ``schedule.cron`` and ``schedule.timezone``: prefect.yaml's build step
  ``tuneloop.orchestration.schedule.prefect_values`` reads them, so ``prefect deploy`` templates the
  monthly schedule from them (``{{ params.cron }}``);
- ``schedule.pools``: the process work pools, their work queues, priorities and concurrency
  limits (a GPU pool with a ``night`` queue for the monthly run and a ``day`` queue for
  pilots and sweeps, sharing one run at a time; a CPU pool for releases).
  ``prefect deploy`` does not create pools or limits, so ``tuneloop deploy`` does;
- ``schedule.heartbeat_s`` and ``schedule.crash_after_s``: every deployment's runs heartbeat
  (``PREFECT_FLOWS_HEARTBEAT_FREQUENCY`` in its job variables), and an automation marks a
  run Crashed when its heartbeats stop. A run whose worker and process were killed (a
  machine lost, ``systemctl stop`` running out of time) would otherwise stay Running and
  hold its pool's only slot, the monthly run's included. Prefect's own recipe
  (docs: "detect zombie flows"), scoped to the deployments tagged ``tuneloop``.

Where a run executes is the worker's business: the pull step :func:`enter_checkout` runs on
the worker for each flow run and enters ``TUNELOOP_HOME`` as that worker has it (a
``{{ $TUNELOOP_HOME }}`` in prefect.yaml would be resolved once, on the deploying machine).

``tuneloop deploy`` (``tuneloop/cli/deploy.py``) runs :func:`deploy`: check prefect.yaml
against params, create or update the pools and queues, ``prefect --no-prompt deploy --all``,
the heartbeat automation, then print each deployment's queue, schedule and next run times,
as the server has them.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from tuneloop.params import Params, ParamsError, ScheduleParams, load_params

if TYPE_CHECKING:
    from prefect.automations import AutomationCore

PREFECT_YAML = Path("prefect.yaml")
# Every deployment in prefect.yaml carries this tag; the heartbeat automation watches its runs.
TAG = "tuneloop"
AUTOMATION = "tuneloop: crash flow runs whose heartbeats stopped"
HEARTBEAT_ENV = "PREFECT_FLOWS_HEARTBEAT_FREQUENCY"
HOME_ENV = "TUNELOOP_HOME"
# What a checkout has; a worker pointed anywhere else is told so before a flow loads.
CHECKOUT_FILES = ("params.yaml", "dvc.yaml")


def prefect_values(params_file: str = "params.yaml") -> dict[str, str]:
    """prefect.yaml build step: the schedule's values, for ``{{ params.cron }}`` and such."""
    schedule = load_params(Path(params_file)).schedule
    return {
        "cron": schedule.cron,
        "timezone": schedule.timezone,
        "heartbeat": str(schedule.heartbeat_s),
    }


def enter_checkout() -> dict[str, str]:
    """prefect.yaml pull step, on the worker at each run: enter the worker's checkout.

    ``TUNELOOP_HOME`` as the worker has it, else the folder the worker was started in.
    """
    home = os.environ.get(HOME_ENV)
    folder = (Path(home).expanduser() if home else Path.cwd()).resolve()
    missing = [name for name in CHECKOUT_FILES if not (folder / name).is_file()]
    if missing:
        said = f"{HOME_ENV}={home}" if home else f"the worker's folder ({HOME_ENV} unset)"
        raise FileNotFoundError(
            f"{said}: {folder} is not a tuneloop checkout (no {', '.join(missing)}); start the "
            f"worker with {HOME_ENV} set to the checkout its flows run in"
        )
    os.chdir(folder)
    return {"directory": str(folder)}


def check_deployments(spec: dict[str, Any], schedule: ScheduleParams) -> list[tuple[str, str]]:
    """Every (pool, queue) prefect.yaml names, each one declared in ``schedule.pools``.

    And every deployment tagged and heartbeating, or the heartbeat automation cannot free
    its pool when its worker dies.
    """
    used: list[tuple[str, str]] = []
    problems: list[str] = []
    for deployment in spec.get("deployments") or []:
        pool = (deployment.get("work_pool") or {}).get("name")
        queue = (deployment.get("work_pool") or {}).get("work_queue_name")
        name = deployment.get("name")
        if TAG not in (deployment.get("tags") or []):
            problems.append(f"deployment {name!r}: tags lack {TAG!r} (the heartbeat automation)")
        env = ((deployment.get("work_pool") or {}).get("job_variables") or {}).get("env") or {}
        if HEARTBEAT_ENV not in env:
            problems.append(
                f"deployment {name!r}: work_pool.job_variables.env lacks {HEARTBEAT_ENV}"
            )
        if pool not in schedule.pools:
            problems.append(f"deployment {name!r}: work pool {pool!r} is not in schedule.pools")
        elif queue not in schedule.pools[pool].queues:
            problems.append(
                f"deployment {name!r}: queue {queue!r} is not in schedule.pools.{pool}.queues"
            )
        else:
            used.append((pool, queue))
    if problems:
        raise ParamsError("prefect.yaml and params.yaml disagree:\n  " + "\n  ".join(problems))
    return used


async def apply_pools(schedule: ScheduleParams) -> list[str]:
    """Create or update each process work pool and queue with its limits; say what changed."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate, WorkPoolUpdate
    from prefect.exceptions import ObjectNotFound
    from prefect.workers.utilities import get_default_base_job_template_for_infrastructure_type

    done: list[str] = []
    async with get_client() as client:
        for pool_name, pool in schedule.pools.items():
            try:
                await client.read_work_pool(pool_name)
                await client.update_work_pool(
                    pool_name, WorkPoolUpdate(concurrency_limit=pool.concurrency)
                )
                done.append(f"pool {pool_name}: updated (concurrency {pool.concurrency})")
            except ObjectNotFound:
                template = await get_default_base_job_template_for_infrastructure_type("process")
                await client.create_work_pool(
                    WorkPoolCreate(
                        name=pool_name,
                        type="process",
                        base_job_template=template or {},
                        concurrency_limit=pool.concurrency,
                    )
                )
                done.append(f"pool {pool_name}: created (concurrency {pool.concurrency})")
            for queue_name, queue in pool.queues.items():
                limits = {"concurrency_limit": queue.concurrency, "priority": queue.priority}
                try:
                    found = await client.read_work_queue_by_name(
                        queue_name, work_pool_name=pool_name
                    )
                    await client.update_work_queue(found.id, **limits)
                    verb = "updated"
                except ObjectNotFound:
                    await client.create_work_queue(
                        name=queue_name,
                        work_pool_name=pool_name,
                        concurrency_limit=queue.concurrency,
                        priority=queue.priority,
                    )
                    verb = "created"
                done.append(
                    f"queue {pool_name}/{queue_name}: {verb} "
                    f"(priority {queue.priority}, concurrency {queue.concurrency})"
                )
            done.extend(await _other_queues(client, pool_name, set(pool.queues)))
    return done


async def _other_queues(client: Any, pool_name: str, declared: set[str]) -> list[str]:
    """The pool's queues params.yaml does not declare: Prefect's ``default`` one, or a user's.

    Prefect gives every pool a ``default`` queue and refuses to delete it; it takes the
    runs that name no queue (no tuneloop deployment does), after the declared ones.
    """
    pool = await client.read_work_pool(pool_name)
    lines = []
    for queue in await client.read_work_queues(work_pool_name=pool_name):
        if queue.name in declared:
            continue
        what = (
            "the pool's default queue, for runs that name none"
            if queue.id == pool.default_queue_id
            else "not in params.yaml"
        )
        lines.append(
            f"queue {pool_name}/{queue.name}: {what} "
            f"(priority {queue.priority}, concurrency {queue.concurrency_limit})"
        )
    return lines


def heartbeat_automation(schedule: ScheduleParams) -> AutomationCore:
    """Prefect's zombie-run recipe: a tagged run silent for ``crash_after_s`` becomes Crashed.

    The trigger starts a window at each heartbeat of a run and expects another heartbeat or
    an end (or a pause, after which a suspended run stops heartbeating) within it.
    """
    from prefect.automations import AutomationCore
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import EventTrigger, Posture

    heartbeat = "prefect.flow-run.heartbeat"
    ends = ("Completed", "Failed", "Cancelled", "Crashed", "Paused", "Suspended")
    return AutomationCore(
        name=AUTOMATION,
        description=(
            f"Runs of deployments tagged {TAG!r} heartbeat every {schedule.heartbeat_s} s "
            f"(params.yaml schedule.heartbeat_s); one silent for {schedule.crash_after_s} s "
            "lost its process (worker stopped, machine gone) and is marked Crashed, which "
            "frees its work pool's concurrency slot. Made by `tuneloop deploy`."
        ),
        trigger=EventTrigger(
            after={heartbeat},
            expect={heartbeat, *(f"prefect.flow-run.{state}" for state in ends)},
            match={"prefect.resource.id": "prefect.flow-run.*"},
            match_related={
                "prefect.resource.role": "tag",
                "prefect.resource.id": f"prefect.tag.{TAG}",
            },
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=dt.timedelta(seconds=schedule.crash_after_s),
        ),
        actions=[
            ChangeFlowRunState(
                name="Crashed",
                state=StateType.CRASHED,
                # Not forced: a run that ended meanwhile keeps its own final state.
                force=False,
                message=(
                    f"no heartbeat for {schedule.crash_after_s} s: the run's process is gone "
                    f"(its worker stopped or its machine was lost); marked by {AUTOMATION!r}"
                ),
            )
        ],
    )


async def apply_automation(schedule: ScheduleParams) -> str:
    """Create or update the heartbeat automation; say which."""
    from prefect.client.orchestration import get_client

    automation = heartbeat_automation(schedule)
    async with get_client() as client:
        found = await client.read_automations_by_name(AUTOMATION)
        if found:
            await client.update_automation(found[0].id, automation)
            for duplicate in found[1:]:  # two concurrent first deploys
                await client.delete_automation(duplicate.id)
            verb = "updated"
        else:
            await client.create_automation(automation)
            verb = "created"
    return (
        f"automation {AUTOMATION!r}: {verb} (heartbeats every {schedule.heartbeat_s} s; "
        f"a run silent for {schedule.crash_after_s} s is marked Crashed)"
    )


async def describe(schedule: Any, count: int, now: dt.datetime) -> str:
    """A schedule and, for a cron, its next ``count`` run times in its own zone."""
    from prefect.client.schemas.schedules import CronSchedule
    from prefect.server.schemas.schedules import CronSchedule as ServerCron

    if not isinstance(schedule, CronSchedule):
        return str(schedule)
    zone = schedule.timezone or "UTC"
    dates = await ServerCron(cron=schedule.cron, timezone=zone).get_dates(count, start=now)
    shown = ", ".join(d.isoformat(timespec="minutes") for d in dates)
    return f"cron {schedule.cron!r} ({zone}); next: {shown}"


async def deployed_schedules(names: Sequence[str], count: int = 3) -> list[str]:
    """Each named deployment as the server has it: queue, schedule, next runs, triggers."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName

    lines: list[str] = []
    now = dt.datetime.now(dt.UTC)
    async with get_client() as client:
        found = await client.read_deployments(
            deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=list(names)))
        )
        for deployment in sorted(found, key=lambda d: d.name):
            flow = await client.read_flow(deployment.flow_id)
            line = (
                f"{flow.name}/{deployment.name}: "
                f"{deployment.work_pool_name}/{deployment.work_queue_name}"
            )
            for entry in deployment.schedules:
                line += "\n    " + await describe(entry.schedule, count, now)
            for automation in await client.read_resource_related_automations(
                f"prefect.deployment.{deployment.id}"
            ):
                line += f"\n    started by automation {automation.name!r}"
            lines.append(line)
    return lines


def deploy(project: Path, params: Params, extra: Sequence[str] = ()) -> int:
    spec = yaml.safe_load((project / PREFECT_YAML).read_text(encoding="utf-8"))
    check_deployments(spec, params.schedule)
    for line in asyncio.run(apply_pools(params.schedule)):
        print(line)
    done = subprocess.run(
        [sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--all", *extra], cwd=project
    )
    if done.returncode != 0:
        return done.returncode
    print(asyncio.run(apply_automation(params.schedule)))
    names = [item["name"] for item in spec.get("deployments") or []]
    for line in asyncio.run(deployed_schedules(names)):
        print(line)
    print(
        f"start a worker per pool, in the checkout its runs use: {HOME_ENV}=/path/to/checkout "
        "prefect worker start --pool NAME (docs/how-to/team-stack.md)"
    )
    return 0
