"""`tuneloop deploy` on a Prefect server: the monthly schedule, the pools and queues, the trigger.

The deployment runs once (module fixture) against the session's test server, exactly as a
user runs it: pools and queues from params.yaml, then `prefect --no-prompt deploy --all`
with prefect.yaml's build step templating the schedule from params.yaml.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest
import yaml

from tuneloop.orchestration.schedule import (
    AUTOMATION,
    apply_pools,
    check_deployments,
    deploy,
    enter_checkout,
    prefect_values,
)
from tuneloop.params import ParamsError, load_params

# The whole suite (`make test`): the Prefect test server
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SPEC = yaml.safe_load((ROOT / "prefect.yaml").read_text())


@pytest.fixture(scope="module")
def deployed(prefect_harness: None) -> Iterator[None]:
    from prefect.settings import PREFECT_API_URL

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PREFECT_API_URL", str(PREFECT_API_URL.value()))
        assert deploy(ROOT, load_params(ROOT / "params.yaml")) == 0
        yield


def read(coroutine_fn: Any) -> Any:
    async def run() -> Any:
        from prefect.client.orchestration import get_client

        async with get_client() as client:
            return await coroutine_fn(client)

    return asyncio.run(run())


def test_the_monthly_retrain_runs_at_2_on_the_1st_in_shanghai(deployed: None) -> None:
    from prefect.server.schemas.schedules import CronSchedule

    async def schedule(client: Any) -> tuple[str, str, str, str]:
        deployment = await client.read_deployment_by_name("retrain/retrain-monthly")
        cron = deployment.schedules[0].schedule
        return cron.cron, cron.timezone, deployment.work_pool_name, deployment.work_queue_name

    cron, timezone, pool, queue = read(schedule)
    assert (cron, timezone) == ("0 2 1 * *", "Asia/Shanghai")  # params.yaml's schedule group
    assert (pool, queue) == ("tuneloop-gpu", "night")
    start = dt.datetime(2026, 11, 29, tzinfo=ZoneInfo(timezone))
    dates = asyncio.run(CronSchedule(cron=cron, timezone=timezone).get_dates(3, start=start))
    local = [d.astimezone(ZoneInfo(timezone)).replace(tzinfo=None) for d in dates]
    assert local == [
        dt.datetime(2026, 12, 1, 2, 0),
        dt.datetime(2027, 1, 1, 2, 0),
        dt.datetime(2027, 2, 1, 2, 0),
    ]


def test_pools_and_queues_carry_the_params_limits(deployed: None) -> None:
    schedule = load_params(ROOT / "params.yaml").schedule

    async def pools(client: Any) -> dict[str, Any]:
        found: dict[str, Any] = {}
        for name in schedule.pools:
            pool = await client.read_work_pool(name)
            queues = await client.read_work_queues(work_pool_name=name)
            found[name] = (pool, {q.name: q for q in queues})
        return found

    found = read(pools)
    for name, wanted in schedule.pools.items():
        pool, queues = found[name]
        assert pool.type == "process" and pool.concurrency_limit == wanted.concurrency
        for queue_name, queue in wanted.queues.items():
            assert queues[queue_name].concurrency_limit == queue.concurrency
            assert queues[queue_name].priority == queue.priority
    # The night run is served before the day's experiments, and they never share the GPUs.
    gpu, queues = found["tuneloop-gpu"]
    assert gpu.concurrency_limit == 1
    assert queues["night"].priority < queues["day"].priority


def test_pilot_and_sweep_run_on_the_day_queue(deployed: None) -> None:
    async def both(client: Any) -> dict[str, Any]:
        return {
            name: await client.read_deployment_by_name(f"experiment/{name}")
            for name in ("pilot", "sweep")
        }

    found = read(both)
    assert {d.work_queue_name for d in found.values()} == {"day"}
    assert found["pilot"].parameters["pilot_fraction"] == 0.05
    assert [set(s) for s in found["sweep"].parameters["sets"]] == [{"train.learning_rate"}] * 2
    assert not found["pilot"].schedules and not found["sweep"].schedules


def test_a_registered_challenger_starts_the_release(deployed: None) -> None:
    """The retrain flow's event, emitted as its register task does, starts a release run."""
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    from flows.retrain import announce_challenger

    async def release(client: Any) -> Any:
        return await client.read_deployment_by_name("release/release")

    deployment = read(release)
    assert (deployment.work_pool_name, deployment.work_queue_name) == ("tuneloop-cpu", "release")

    async def runs(client: Any) -> list[Any]:
        return list(
            await client.read_flow_runs(
                deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment.id]))
            )
        )

    assert read(runs) == []
    announce_challenger("tuneloop-copy", "7", {"registered": True, "version": "7", "task": "copy"})
    deadline = time.monotonic() + 90
    started: list[Any] = []
    while not started and time.monotonic() < deadline:
        time.sleep(1)
        started = read(runs)
    assert len(started) == 1, "no release run within 90 s of the event"
    # The release of the task whose challenger it is (with several tasks, one task's alone).
    assert started[0].parameters == {"repo": ".", "task": "copy"}


def test_runs_heartbeat_and_the_automation_crashes_silent_ones(deployed: None) -> None:
    """Every deployment's runs heartbeat; the automation waits schedule.crash_after_s."""
    schedule = load_params(ROOT / "params.yaml").schedule

    async def both(client: Any) -> tuple[list[Any], list[Any]]:
        deployments = [
            await client.read_deployment_by_name(name)
            for name in ("retrain/retrain-monthly", "experiment/pilot", "experiment/sweep")
        ]
        deployments.append(await client.read_deployment_by_name("release/release"))
        return deployments, await client.read_automations_by_name(AUTOMATION)

    deployments, automations = read(both)
    for deployment in deployments:
        assert "tuneloop" in deployment.tags, deployment.name
        env = deployment.job_variables["env"]
        assert env == {"PREFECT_FLOWS_HEARTBEAT_FREQUENCY": str(schedule.heartbeat_s)}
    assert len(automations) == 1 and automations[0].enabled
    trigger = automations[0].trigger
    assert trigger.posture == "Proactive" and trigger.after == {"prefect.flow-run.heartbeat"}
    assert "prefect.flow-run.heartbeat" in trigger.expect
    assert trigger.within == dt.timedelta(seconds=schedule.crash_after_s)
    assert trigger.for_each == {"prefect.resource.id"}
    # Only tuneloop's runs: other teams' flows on a shared server heartbeat at their own pace.
    assert trigger.match_related.model_dump() == {
        "prefect.resource.role": "tag",
        "prefect.resource.id": "prefect.tag.tuneloop",
    }
    (action,) = automations[0].actions
    assert (action.type, action.state) == ("change-flow-run-state", "CRASHED")


def test_the_checkout_is_the_workers_not_the_deploying_machines(deployed: None) -> None:
    async def pull(client: Any) -> list[Any]:
        return [
            (await client.read_deployment_by_name(name)).pull_steps
            for name in ("retrain/retrain-monthly", "release/release")
        ]

    for steps in read(pull):
        assert steps == [{"tuneloop.orchestration.schedule.enter_checkout": {}}]
        assert str(ROOT) not in str(steps)


def test_a_pools_other_queues_are_shown(deployed: None) -> None:
    """Prefect's own `default` queue of each pool is named, after the declared ones."""
    schedule = load_params(ROOT / "params.yaml").schedule
    lines = asyncio.run(apply_pools(schedule))
    default = [line for line in lines if line.startswith("queue tuneloop-gpu/default:")]
    assert len(default) == 1
    assert "the pool's default queue, for runs that name none (priority 3," in default[0]
    assert "queue tuneloop-gpu/night: updated (priority 1, concurrency 1)" in lines


def test_the_pull_step_enters_the_workers_checkout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    for name in ("params.yaml", "dvc.yaml"):
        (checkout / name).write_text("")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.setenv("TUNELOOP_HOME", str(checkout))
    assert enter_checkout() == {"directory": str(checkout.resolve())}
    assert Path.cwd() == checkout.resolve()

    # Unset: the folder the worker started in.
    monkeypatch.delenv("TUNELOOP_HOME")
    assert enter_checkout() == {"directory": str(checkout.resolve())}

    monkeypatch.setenv("TUNELOOP_HOME", str(elsewhere))
    with pytest.raises(FileNotFoundError, match=r"TUNELOOP_HOME=.*elsewhere.*no params\.yaml"):
        enter_checkout()


def test_a_crash_window_shorter_than_two_heartbeats_is_refused(tmp_path: Path) -> None:
    data = yaml.safe_load((ROOT / "params.yaml").read_text())
    data["schedule"] |= {"heartbeat_s": 60, "crash_after_s": 90}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(ParamsError, match=r"crash_after_s \(90\) must be at least 2 x heartbeat_s"):
        load_params(tmp_path / "params.yaml")


def test_the_schedule_values_come_from_params(tmp_path: Path) -> None:
    data = yaml.safe_load((ROOT / "params.yaml").read_text())
    data["schedule"] |= {"cron": "30 3 1 * *", "timezone": "Europe/Berlin"}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(data))
    assert prefect_values(str(tmp_path / "params.yaml")) == {
        "cron": "30 3 1 * *",
        "timezone": "Europe/Berlin",
        "heartbeat": str(data["schedule"]["heartbeat_s"]),
    }
    schedules = [d.get("schedules") for d in SPEC["deployments"]]
    assert {"cron": "{{ params.cron }}", "timezone": "{{ params.timezone }}", "active": True} in [
        s[0] for s in schedules if s
    ]


def test_a_queue_prefect_yaml_names_but_params_lacks_is_refused() -> None:
    schedule = load_params(ROOT / "params.yaml").schedule
    assert len(check_deployments(SPEC, schedule)) == len(SPEC["deployments"])
    heartbeat = {"env": {"PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "60"}}
    wrong = {
        "deployments": [
            {
                "name": "x",
                "tags": ["tuneloop"],
                "work_pool": {
                    "name": "tuneloop-gpu",
                    "work_queue_name": "weekend",
                    "job_variables": heartbeat,
                },
            }
        ]
    }
    with pytest.raises(ParamsError, match=r"queue 'weekend' is not in schedule\.pools"):
        check_deployments(wrong, schedule)
    unwatched = {
        "deployments": [
            {"name": "y", "work_pool": {"name": "tuneloop-gpu", "work_queue_name": "night"}}
        ]
    }
    with pytest.raises(ParamsError) as refused:
        check_deployments(unwatched, schedule)
    assert "deployment 'y': tags lack 'tuneloop'" in str(refused.value)
    assert "lacks PREFECT_FLOWS_HEARTBEAT_FREQUENCY" in str(refused.value)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"timezone": "Asia/Shangai"}, "not an IANA time zone"),
        ({"cron": "0 2 1 *"}, "five fields"),
    ],
)
def test_a_bad_schedule_is_refused_naming_the_key(
    tmp_path: Path, change: dict[str, str], message: str
) -> None:
    data = yaml.safe_load((ROOT / "params.yaml").read_text())
    data["schedule"] |= change
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(ParamsError, match=message) as refused:
        load_params(tmp_path / "params.yaml")
    assert f"schedule.{next(iter(change))}" in str(refused.value)
