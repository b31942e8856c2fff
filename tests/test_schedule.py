"""prefect.yaml's deployments register against a Prefect server with the monthly schedule."""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import subprocess
import sys
from pathlib import Path
from zoneinfo import ZoneInfo

import yaml

ROOT = Path(__file__).resolve().parents[1]


def test_prefect_yaml_deploys_the_monthly_retrain(prefect_harness: None, tmp_path: Path) -> None:
    from prefect.client.orchestration import get_client
    from prefect.server.schemas.schedules import CronSchedule
    from prefect.settings import PREFECT_API_URL

    api = PREFECT_API_URL.value()
    env = os.environ | {"PREFECT_API_URL": api, "TUNELOOP_HOME": str(ROOT)}
    prefect = [sys.executable, "-m", "prefect"]
    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    pools = {d["work_pool"]["name"] for d in spec["deployments"]}
    for pool in pools:
        subprocess.run(
            [*prefect, "work-pool", "create", pool, "--type", "process"],
            cwd=ROOT,
            env=env,
            check=True,
            capture_output=True,
        )
    deployed = subprocess.run(
        [*prefect, "--no-prompt", "deploy", "--all"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr

    async def read() -> tuple[str, str, list[dt.datetime]]:
        async with get_client() as client:
            deployment = await client.read_deployment_by_name("retrain/retrain-monthly")
            schedule = deployment.schedules[0].schedule
            cron, timezone = schedule.cron, schedule.timezone  # type: ignore[union-attr]
        start = dt.datetime(2026, 11, 29, tzinfo=ZoneInfo(timezone))
        dates = await CronSchedule(cron=cron, timezone=timezone).get_dates(3, start=start)
        return cron, timezone, dates

    cron, timezone, dates = asyncio.run(read())
    assert cron == "0 2 1 * *"
    assert timezone == "Asia/Shanghai"
    local = [d.astimezone(ZoneInfo(timezone)).replace(tzinfo=None) for d in dates]
    assert local == [
        dt.datetime(2026, 12, 1, 2, 0),
        dt.datetime(2027, 1, 1, 2, 0),
        dt.datetime(2027, 2, 1, 2, 0),
    ]
