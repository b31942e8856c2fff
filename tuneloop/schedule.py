"""Prefect deployments from params.yaml's ``schedule`` group: ``tuneloop deploy``.

``prefect.yaml`` holds the deployments (which flow, which work queue, the release trigger);
the values a team tunes live in params.yaml with every other knob:

- ``schedule.cron`` and ``schedule.timezone``: prefect.yaml's build step
  ``tuneloop.schedule.prefect_values`` reads them, so ``prefect deploy`` templates the
  monthly schedule from them (``{{ params.cron }}``);
- ``schedule.pools``: the process work pools, their work queues, priorities and concurrency
  limits (a GPU pool with a ``night`` queue for the monthly run and a ``day`` queue for
  pilots and sweeps, sharing one run at a time; a CPU pool for releases).
  ``prefect deploy`` does not create pools or limits, so ``tuneloop deploy`` does.

``tuneloop deploy`` = check prefect.yaml against params, create or update the pools and
queues, ``prefect --no-prompt deploy --all``, then print each deployment's queue, schedule
and next run times, as the server has them.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from tuneloop.params import Params, ParamsError, ScheduleParams, load_params

PREFECT_YAML = Path("prefect.yaml")


def prefect_values(params_file: str = "params.yaml") -> dict[str, str]:
    """prefect.yaml build step: the schedule's values, for ``{{ params.cron }}`` and such."""
    schedule = load_params(Path(params_file)).schedule
    return {"cron": schedule.cron, "timezone": schedule.timezone}


def check_deployments(spec: dict[str, Any], schedule: ScheduleParams) -> list[tuple[str, str]]:
    """Every (pool, queue) prefect.yaml names, each one declared in ``schedule.pools``."""
    used: list[tuple[str, str]] = []
    problems: list[str] = []
    for deployment in spec.get("deployments") or []:
        pool = (deployment.get("work_pool") or {}).get("name")
        queue = (deployment.get("work_pool") or {}).get("work_queue_name")
        name = deployment.get("name")
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
    return done


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
    env = os.environ | {"TUNELOOP_HOME": os.environ.get("TUNELOOP_HOME", str(project))}
    done = subprocess.run(
        [sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--all", *extra],
        cwd=project,
        env=env,
    )
    if done.returncode != 0:
        return done.returncode
    names = [item["name"] for item in spec.get("deployments") or []]
    for line in asyncio.run(deployed_schedules(names)):
        print(line)
    print("start a worker per pool: prefect worker start --pool NAME (see README, Operating it)")
    return 0


def deploy_main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tuneloop deploy",
        description="Create or update the work pools and queues in params.yaml's schedule "
        "group, then register prefect.yaml's deployments (`prefect deploy --all`) on the "
        "server PREFECT_API_URL names.",
    )
    parser.add_argument("--project", type=Path, default=Path(), help="project folder")
    args, extra = parser.parse_known_args(argv)
    from prefect.settings import PREFECT_API_URL

    if not PREFECT_API_URL.value():  # the environment or the active Prefect profile
        print(
            "tuneloop deploy: set PREFECT_API_URL to your Prefect server, e.g. "
            "http://127.0.0.1:4200/api after `prefect server start`; deployments on a "
            "temporary server would vanish with it",
            file=sys.stderr,
        )
        return 2
    project = args.project.resolve()
    try:
        params = load_params(project / "params.yaml")
        return deploy(project, params, extra)
    except ParamsError as error:
        print(f"tuneloop deploy: {error}", file=sys.stderr)
        return 2
