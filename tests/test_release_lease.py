"""A release killed mid-canary is rolled back by the routers themselves; a restarted router resumes.

Everything runs as it would in production, each in its own process: two router
replicas (``python -m serving.router``) in front of two stub OpenAI-compatible
backends, and the release flow (``flows/release.py``) against the shared Prefect
test server and a temp MLflow registry. The test:

1. waits until the flow has put the challenger at 10 % and paused for approval,
   and keeps it paused for longer than the lease (the renewals must hold it);
2. meanwhile, within that lease, SIGKILLs one router replica and starts it again: it
   comes back at 10 % with the release's lease, from its state file;
3. SIGKILLs the release process (no handler, no hook can run): every replica
   sets the challenger to 0 % within the lease time, and records why.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from serving.routing import load_state
from tests.helpers import wait_until, write_params
from tests.registry_helpers import register_champion_and_challenger
from tests.router_helpers import (
    PRODUCER_ENV,
    PRODUCER_TOKEN,
    PRODUCERS,
    SECRET,
    SECRET_ENV,
    StreamGate,
    fake_backend,
    serve,
)
from tuneloop.net import free_port
from tuneloop.release import approval

# The whole suite (`make test`): routers and releases in subprocesses
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "lease-test-token"
MODEL = "tuneloop-support"
# Longer than a router takes to restart on a busy 2-core machine (3 to 11 s seen), short for a test.
TTL = 20.0
# A replica restarting answers nothing for a moment: a check against it is tried again.
RETRY: dict[str, Any] = {"retry_on": (httpx.HTTPError,)}
HEADERS = {"Authorization": f"Bearer {TOKEN}"}
RELEASE = {
    "admin_token_env": "TUNELOOP_ADMIN_TOKEN",
    "steps": [10, 50, 100],
    "analysis_interval": 1.0,
    "analyses_per_step": 1,
    "failure_limit": 1000,  # the flow must not roll back by itself here: the routers must
    "min_requests": 1,
    "min_latency_samples": 1,
    "min_ttft_samples": 1,
    "max_error_rate_increase": 1.0,
    "max_badcase_rate_increase": 1.0,
    "max_latency_p99_ratio": 1000.0,
    "max_ttft_p99_ratio": 1000.0,
    "approval_timeout": 600,
    "lease_ttl_s": TTL,
    "fast_fail": {"window": 20, "max_errors": 20},
    # Skipped here (the stub backends have no speed to compare), and the release says so.
    "loadtest": {
        "enabled": False,
        "requests": 2,
        "concurrency": 1,
        "max_tokens": 4,
        "max_ttft_ratio": 1000.0,
        "max_tpot_ratio": 1000.0,
    },
}


class Replica:
    """One router process on a fixed port, restartable with the same config and state file."""

    def __init__(self, folder: Path, backends: dict[str, str], env: dict[str, str]) -> None:
        self.folder = folder
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = env
        self.config = folder / "router.yaml"
        self.state_file = folder / "state.json"
        arms = {
            arm: {"base_url": url, "model": f"{arm}-model", "model_version": version}
            for (arm, url), version in zip(backends.items(), ("1", "2"), strict=True)
        }
        config = {
            "arms": arms,
            "feedback_dir": str(folder / "feedback"),
            "state_file": str(self.state_file),
            "feedback_producers": PRODUCERS,
        }
        self.config.write_text(yaml.safe_dump(config))
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        log = (self.folder / f"router-{self.starts}.log").open("wb")
        command = [sys.executable, "-m", "serving.router", "--config", str(self.config)]
        command += ["--port", str(self.port), "--log-level", "info"]
        self.process = subprocess.Popen(
            command, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT
        )
        log.close()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log()
            try:
                if httpx.get(f"{self.url}/health", timeout=1, trust_env=False).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"router did not start: {self.log()}")

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()

    def status(self) -> dict[str, Any]:
        reply = httpx.get(f"{self.url}/admin/status", headers=HEADERS, timeout=5, trust_env=False)
        reply.raise_for_status()
        result: dict[str, Any] = reply.json()
        return result

    def log(self) -> str:
        """The router's own lines (not its per-request ones), last start last."""
        lines = [
            line
            for path in sorted(self.folder.glob("router-*.log"))
            for line in path.read_text(errors="replace").splitlines()
            if "HTTP Request:" not in line
        ]
        return "\n".join(lines[-60:])


@contextmanager
def traffic(urls: list[str]) -> Iterator[None]:
    """Chat requests as 100 named users over every replica, so the analyses have data."""
    stop = threading.Event()

    def run() -> None:
        with httpx.Client(timeout=5, trust_env=False) as client:
            sent = 0
            while not stop.is_set():
                body = {"messages": [{"role": "user", "content": "hi"}], "user": f"u{sent % 100}"}
                with contextlib.suppress(httpx.TransportError):  # a replica restarting
                    client.post(f"{urls[sent % len(urls)]}/v1/chat/completions", json=body)
                sent += 1
                time.sleep(0.02)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=10)


def crash(flow_run_id: str) -> None:
    """Mark the killed run Crashed, as a worker would: a paused run must not linger."""
    from uuid import UUID

    from prefect import get_client
    from prefect.states import Crashed

    with get_client(sync_client=True) as client:
        client.set_flow_run_state(
            UUID(flow_run_id), Crashed(message="killed by the test"), force=True
        )


def test_a_release_killed_mid_canary_is_rolled_back_by_every_router(
    prefect_harness: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prefect.settings import PREFECT_API_URL

    api_url = PREFECT_API_URL.value()
    assert api_url, "the Prefect test harness gives an API URL"
    repo = tmp_path / "repo"
    repo.mkdir()
    register_champion_and_challenger(repo, MODEL)
    env = {
        **{k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"},
        "PYTHONPATH": str(ROOT),
        "PREFECT_API_URL": api_url,
        "TUNELOOP_ADMIN_TOKEN": TOKEN,
        SECRET_ENV: SECRET,
        PRODUCER_ENV: PRODUCER_TOKEN,
    }
    monkeypatch.setenv("TUNELOOP_ADMIN_TOKEN", TOKEN)
    gate = StreamGate()
    with ExitStack() as stack:
        backends = {
            arm: stack.enter_context(serve(fake_backend(arm, gate)))
            for arm in ("champion", "challenger")
        }
        replicas = []
        for i in range(2):
            folder = tmp_path / f"router{i}"
            folder.mkdir()
            replica = Replica(folder, backends, env)
            stack.callback(replica.kill)
            replica.start()
            replicas.append(replica)
        write_params(repo, {"release": {**RELEASE, "routers": [r.url for r in replicas]}})
        stack.enter_context(traffic([r.url for r in replicas]))

        flow_log = (tmp_path / "flow.log").open("wb")
        stack.callback(flow_log.close)
        script = (
            "import sys, pathlib; from flows.release import release; "
            "release(pathlib.Path(sys.argv[1]))"
        )
        flow = subprocess.Popen(
            [sys.executable, "-c", script, str(repo)],
            cwd=ROOT,
            env=env,
            stdout=flow_log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        stack.callback(lambda: flow.poll() is None and os.killpg(flow.pid, signal.SIGKILL))

        def flow_output() -> str:
            return (tmp_path / "flow.log").read_text(errors="replace")[-4000:]

        # 1. The canary is at 10 % and the flow waits for a person, renewing its lease.
        def paused() -> bool:
            assert flow.poll() is None, flow_output()
            return bool(approval.waiting_releases())

        wait_until(paused, 240, "the release pausing for approval", **RETRY)
        assert "loadtest: SKIPPED: release.loadtest.enabled is false" in flow_output()
        stack.callback(crash, approval.waiting_releases()[0]["id"])
        statuses = [r.status() for r in replicas]
        assert [s["challenger_percent"] for s in statuses] == [10, 10], statuses
        holder = statuses[0]["lease"]["holder"]
        assert holder == approval.waiting_releases()[0]["id"]
        # The lease as the routers hold it now: it must be outlived, renewed, at step 1's end.
        lapses_at = time.monotonic() + max(s["lease"]["seconds_left"] for s in statuses)

        # 2. One replica dies and comes back within that lease: its state file restores the
        # weight and lease.
        replicas[1].kill()
        replicas[1].start()
        restored = replicas[1].status()
        assert restored["challenger_percent"] == 10, replicas[1].log()
        assert restored["lease"]["holder"] == holder

        # ... and the release, still running, renews the restarted replica's lease.
        def renewed() -> bool:
            lease = replicas[1].status()["lease"]
            assert lease is not None, replicas[1].log() + flow_output()
            return bool(lease["expires_at"] != restored["lease"]["expires_at"])

        wait_until(renewed, TTL / 3 + 3, "the restarted replica's lease being renewed", **RETRY)

        # 1, continued. Past the lease seen at the pause (the routers' own wall clock, in
        # their processes): only the renewals hold it, on both replicas.
        time.sleep(max(0.0, lapses_at + 1 - time.monotonic()))
        statuses = [r.status() for r in replicas]
        assert [s["challenger_percent"] for s in statuses] == [10, 10], statuses
        assert {s["lease"]["holder"] for s in statuses} == {holder}

        # 3. The release process dies outright: nothing of it runs any more.
        os.killpg(flow.pid, signal.SIGKILL)
        flow.wait()
        killed = time.monotonic()
        for replica in replicas:
            wait_until(
                lambda r=replica: r.status()["challenger_percent"] == 0,
                TTL + 2,
                f"{replica.url} rolling back",
                **RETRY,
            )
        took = time.monotonic() - killed
        statuses = [r.status() for r in replicas]
        logs = [r.log() for r in replicas]

    assert took <= TTL + 2, took
    for status, replica, log in zip(statuses, replicas, logs, strict=True):
        assert status["lease"] is None
        assert status["last_change"]["action"] == "lease_lapsed", status
        assert holder in status["last_change"]["reason"]
        saved = load_state(replica.state_file)
        assert saved is not None and (saved.challenger_percent, saved.action) == (0, "lease_lapsed")
        assert "ROLLBACK [lease_lapsed]" in log
