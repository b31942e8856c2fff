"""The team stack as the manual sets it up (docs/how-to/team-stack.md), on one machine: every
piece real, on loopback.

One stack for the module, torn down even when a test fails:

- PostgreSQL from Debian's ``postgresql`` package (CI installs it; the module skips only
  when its binaries are absent), started here as the ``postgres`` user on 127.0.0.1 with a
  free port and a temporary socket folder, with two databases;
- ``prefect server start`` on one (``postgresql+asyncpg://``) and ``mlflow server`` on the
  other (``postgresql://``: psycopg 3, the ``server`` extra), artifacts in a temp folder;
- ``tuneloop deploy`` from a tiny project copy, the heartbeat at Prefect's minimum.

Then a short retrain runs through a GPU-pool worker started elsewhere with
``TUNELOOP_HOME`` naming the checkout, and its runs, tags, artifacts and registered version
are read back through the MLflow server. Last, a worker is stopped the hard way mid-run:
the heartbeat automation crashes the silent run and the pool takes the next one.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from tests.helpers import (
    INITDB,
    PASSING_TRAIN,
    ROOT,
    TASK,
    copy_project,
    dvc_name,
    postgres_bin,
    seed_demo_month,
    stage_runs,
    wait_until,
    write_params,
)
from tuneloop.net import free_port
from tuneloop.pipeline import stage_order

# The whole suite (`make test`): PostgreSQL, MLflow and Prefect servers
pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
# Short enough for a test; the manual's values are params.yaml's (60 s, 300 s).
HEARTBEAT = {"heartbeat_s": 30, "crash_after_s": 60}
# Settings under which the tiny candidate passes the gate: it learns the reply format in full
# training (helpers.PASSING_TRAIN, as tests/test_loop.py). The base's general skill after the
# tests' 10 pre-training steps is near chance and is lost on the way (tests/test_evaluate.py
# measures forgetting on a base pre-trained for real); this test is about the servers, so the
# forgetting budget is opened.
PASSING = {
    "train": PASSING_TRAIN,
    "gate": {"primary_metric": "format_compliance", "min_gain": 0.05, "max_forgetting": 1.0},
}
# Trust on loopback: a throwaway cluster with no password to leak.
STAGES = [dvc_name(stage) for stage in stage_order(ROOT)]


def tail(path: Path, lines: int = 60) -> str:
    if not path.exists():
        return f"({path} was not written)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


@dataclass
class Service:
    """A server process in its own session, so its children stop with it."""

    name: str
    process: subprocess.Popen[bytes]
    log: Path

    @classmethod
    def start(cls, name: str, command: list[str], log: Path, **kwargs: Any) -> Service:
        with log.open("wb") as out:
            process = subprocess.Popen(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                **kwargs,
            )
        return cls(name, process, log)

    def wait_http(self, url: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"{self.name} exited ({self.process.returncode}):\n{tail(self.log)}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url, timeout=5).status_code == 200:
                    return
            time.sleep(0.25)
        pytest.fail(f"{self.name}: no answer from {url} in {timeout:.0f} s:\n{tail(self.log)}")

    def stop(self) -> None:
        """SIGTERM the process group, then SIGKILL what is left of it and of its children.

        The children too: a worker starts each flow run in a session of its own.
        """
        children: list[psutil.Process] = []
        if self.process.poll() is None:
            with contextlib.suppress(psutil.NoSuchProcess):
                children = psutil.Process(self.process.pid).children(recursive=True)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=20)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        for child in children:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=10)


@dataclass
class Stack:
    root: Path
    env: dict[str, str]
    prefect_api: str
    mlflow_uri: str
    artifacts: Path

    def cli(self, *command: str, timeout: float = 300, **kwargs: Any) -> str:
        """Run a command as a user of the stack would; its output, or the test fails."""
        done = subprocess.run(
            list(command),
            env=self.env | kwargs.pop("env", {}),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            **kwargs,
        )
        if done.returncode != 0:
            pytest.fail(
                f"{' '.join(command)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
            )
        return done.stdout + done.stderr

    def api(self, call: Callable[[Any], Any]) -> Any:
        """``await call(client)`` against the stack's Prefect server."""
        from prefect.client.orchestration import get_client
        from prefect.settings import PREFECT_API_URL, temporary_settings

        async def run() -> Any:
            async with get_client() as client:
                return await call(client)

        with temporary_settings(updates={PREFECT_API_URL: self.prefect_api}):
            return asyncio.run(run())

    def state(self, flow_run_id: str) -> Any:
        async def read(client: Any) -> Any:
            return (await client.read_flow_run(flow_run_id)).state

        return self.api(read)

    def heartbeats(self, flow_run_id: str) -> int:
        """How many heartbeats of ``flow_run_id`` the Prefect server has recorded."""
        query = {
            "event": {"name": ["prefect.flow-run.heartbeat"]},
            "resource": {"id": [f"prefect.flow-run.{flow_run_id}"]},
        }
        reply = httpx.post(
            f"{self.prefect_api}/events/filter", json={"filter": query, "limit": 1}, timeout=10
        )
        reply.raise_for_status()
        return int(reply.json()["total"])

    def mlflow(self) -> Any:
        from mlflow.tracking import MlflowClient

        return MlflowClient(tracking_uri=self.mlflow_uri)


@pytest.fixture(scope="module")
def postgres() -> Iterator[str]:
    """A throwaway PostgreSQL cluster on 127.0.0.1; yields ``user@host:port``."""
    bin_dir = postgres_bin()
    if bin_dir is None:
        pytest.skip("PostgreSQL is not installed (Debian: apt-get install postgresql)")
    as_user: list[str] = []
    folder = Path(tempfile.mkdtemp(prefix="tuneloop-pg-"))
    if os.geteuid() == 0:  # initdb refuses root; run the server as Debian's postgres user
        try:
            owner = pwd.getpwnam("postgres")
        except KeyError:
            shutil.rmtree(folder)
            pytest.skip("running as root and there is no 'postgres' user to run PostgreSQL as")
        os.chown(folder, owner.pw_uid, owner.pw_gid)
        as_user = ["runuser", "-u", "postgres", "--"]
    data, port = folder / "data", free_port()

    def run(*command: str) -> None:
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            pytest.fail(f"{' '.join(command)}:\n{done.stdout}{done.stderr}{tail(folder / 'log')}")

    started = False
    try:
        run(*as_user, str(bin_dir / "initdb"), "-D", str(data), *INITDB)
        # Loopback only, its socket in the temp folder; durability is not this test's business.
        options = (
            f"-c listen_addresses=127.0.0.1 -p {port} -k {folder} "
            "-c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        )
        pg_ctl = [*as_user, str(bin_dir / "pg_ctl"), "-D", str(data)]
        run(*pg_ctl, "-l", str(folder / "log"), "-w", "-t", "60", "-o", options, "start")
        started = True
        for database in ("prefect", "mlflow"):
            run(str(bin_dir / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "postgres",
                database)  # fmt: skip
        yield f"postgres@127.0.0.1:{port}"
    finally:
        if started:
            subprocess.run([*pg_ctl, "-m", "immediate", "stop"], capture_output=True, check=False)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def stack(postgres: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A Prefect server and an MLflow server on the PostgreSQL cluster, both on loopback."""
    root = tmp_path_factory.mktemp("stack")
    prefect_port, mlflow_port = free_port(), free_port()
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("PREFECT_", "MLFLOW_", "TUNELOOP_"))
    }
    env |= {
        "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}",
        # This checkout's code, wherever a process starts.
        "PYTHONPATH": str(ROOT),
        "PREFECT_HOME": str(root / "prefect-home"),  # never the user's profile
        "PREFECT_API_URL": f"http://127.0.0.1:{prefect_port}/api",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        # Workers ask for runs every second (Prefect's default: 10 s), so a run the test
        # starts or a slot a crash frees is taken at once, not at the next poll.
        "PREFECT_WORKER_QUERY_SECONDS": "1",
    }
    artifacts = root / "artifacts"
    servers = [
        Service.start(
            "prefect server",
            [str(BIN / "prefect"), *f"server start --host 127.0.0.1 --port {prefect_port}".split()],
            root / "prefect-server.log",
            env=env
            | {
                "PREFECT_SERVER_DATABASE_CONNECTION_URL": f"postgresql+asyncpg://{postgres}/prefect",
                "PREFECT_UI_ENABLED": "false",
                # No monthly runs appear while the test runs, whatever the date.
                "PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED": "false",
                # The heartbeat automation is looked at every second (Prefect's default: 5 s):
                # a silent run is crashed when its window ends, not up to 5 s later.
                "PREFECT_SERVER_EVENTS_PROACTIVE_GRANULARITY": "PT1S",
            },
        ),
        Service.start(
            "mlflow server",
            [
                str(BIN / "mlflow"),
                *f"server --host 127.0.0.1 --port {mlflow_port} --workers 1".split(),
                *["--backend-store-uri", f"postgresql://{postgres}/mlflow"],
                *["--artifacts-destination", artifacts.as_uri()],
            ],
            root / "mlflow-server.log",
            env=env | {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
        ),
    ]
    try:
        servers[0].wait_http(f"http://127.0.0.1:{prefect_port}/api/health", timeout=240)
        servers[1].wait_http(f"http://127.0.0.1:{mlflow_port}/health", timeout=240)
        yield Stack(
            root=root,
            env=env | {"MLFLOW_TRACKING_URI": f"http://127.0.0.1:{mlflow_port}"},
            prefect_api=env["PREFECT_API_URL"],
            mlflow_uri=f"http://127.0.0.1:{mlflow_port}",
            artifacts=artifacts,
        )
    finally:
        for server in servers:
            server.stop()


@pytest.fixture(scope="module")
def project(stack: Stack) -> Path:
    """A checkout with tiny params and a month of data, deployed as the manual says."""
    (stack.root / "checkout").mkdir()
    folder = copy_project(stack.root / "checkout")
    shutil.copy(ROOT / "prefect.yaml", folder / "prefect.yaml")
    write_params(folder, {**PASSING, "schedule": HEARTBEAT})
    git = ["git", "-c", "user.name=test", "-c", "user.email=test@example.com"]
    subprocess.run([*git, "add", "-A"], cwd=folder, check=True)
    subprocess.run([*git, "commit", "-qm", "deployable"], cwd=folder, check=True)
    seed_demo_month(folder)
    said = stack.cli(str(BIN / "tuneloop"), "deploy", "--project", str(folder))
    assert "automation 'tuneloop: crash flow runs whose heartbeats stopped': created" in said
    assert "queue tuneloop-gpu/default: the pool's default queue" in said
    return folder


def run_deployment(stack: Stack, name: str, *params: str) -> str:
    said = stack.cli(str(BIN / "prefect"), "deployment", "run", name, *params)
    found = re.search(r"UUID: ([0-9a-f-]{36})", said)
    assert found, said
    return found.group(1)


@pytest.fixture(scope="module")
def retrained(stack: Stack, project: Path) -> str:
    """The monthly deployment run by hand, on a GPU-pool worker started in another folder."""
    flow_run_id = run_deployment(stack, "retrain/retrain-monthly")
    elsewhere = stack.root / "worker-folder"
    elsewhere.mkdir()
    log = stack.root / "retrain-worker.log"
    worker = Service.start(
        "worker",
        [str(BIN / "prefect"), "worker", "start", "--pool", "tuneloop-gpu", "--run-once"],
        log,
        cwd=elsewhere,
        env=stack.env | {"TUNELOOP_HOME": str(project)},
    )
    try:
        worker.process.wait(timeout=1500)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the worker did not finish the retrain in 25 minutes:\n{tail(log)}")
    finally:
        worker.stop()
    state = stack.state(flow_run_id)
    assert state.type.value == "COMPLETED", f"{state.name}: {state.message}\n{tail(log, 120)}"
    return flow_run_id


def test_the_retrain_ran_in_the_workers_checkout(
    stack: Stack, project: Path, retrained: str
) -> None:
    async def deployment(client: Any) -> Any:
        return await client.read_deployment_by_name("retrain/retrain-monthly")

    # The deployment names no folder; the worker's TUNELOOP_HOME chose the checkout.
    assert stack.api(deployment).pull_steps == [
        {"tuneloop.orchestration.schedule.enter_checkout": {}}
    ]
    assert (project / "metrics" / "evaluate.json").is_file()
    assert not (stack.root / "worker-folder" / "metrics").exists()
    # Tracking went to the server: no local store beside the checkout.
    assert not (project / "mlflow.db").exists() and not (project / "mlruns").exists()


def test_runs_tags_and_artifacts_read_back_through_the_mlflow_server(
    stack: Stack, project: Path, retrained: str
) -> None:
    client = stack.mlflow()
    experiment = client.get_experiment_by_name("tuneloop")
    assert experiment is not None
    assert experiment.artifact_location.startswith("mlflow-artifacts:")  # served, not local
    found = client.search_runs([experiment.experiment_id])
    (parent,) = [
        r
        for r in found
        if r.data.tags.get("tuneloop.pipeline") == "retrain" and "task" not in r.data.tags
    ]
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["prefect.flow_run_id"] == retrained
    # The one task's run in it holds its pipeline's verdict.
    (task_run,) = [
        r
        for r in found
        if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id
        and r.data.tags.get("task") == TASK
    ]
    assert task_run.info.status == "FINISHED"
    assert task_run.data.tags["gate.passed"] == "true"
    children = stage_runs(found, parent.info.run_id)
    assert sorted(children) == sorted(STAGES)
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=project, capture_output=True, text=True, check=True
    ).stdout.strip()
    for stage, run in children.items():
        assert run.info.status == "FINISHED", stage
        assert run.data.tags["git.commit"] == commit
        assert run.data.tags["prefect.flow_run_id"] == retrained
        assert len(run.data.tags["params.hash"]) == 16
    assert client.get_metric_history(children[dvc_name("train")].info.run_id, "loss")

    # The evaluate stage's report: uploaded through the server into its artifact folder,
    # and downloaded back the same.
    evaluate = children[dvc_name("evaluate")].info.run_id
    assert {a.path for a in client.list_artifacts(evaluate)} >= {"eval.md", "decision.json"}
    local = Path(client.download_artifacts(evaluate, "decision.json", str(stack.root)))
    assert local.read_bytes() == (project / "metrics" / "decision.json").read_bytes()
    stored = list(stack.artifacts.rglob("decision.json"))
    assert stored and all(p.read_bytes() == local.read_bytes() for p in stored)


def test_the_registered_version_reads_back_through_the_server(
    stack: Stack, project: Path, retrained: str
) -> None:
    client = stack.mlflow()
    version = client.get_model_version_by_alias("tuneloop-support", "challenger")
    assert str(version.version) == "1"
    assert version.tags["prefect.flow_run_id"] == retrained
    assert version.tags["gate.passed"] == "true"
    assert version.description == (project / "reports" / "eval.md").read_text()
    from mlflow.artifacts import download_artifacts

    # Where the server keeps the version (a `models:/` URI would be resolved against the
    # process-wide registry, not this client's).
    source = client.get_model_version_download_uri("tuneloop-support", str(version.version))
    folder = Path(
        download_artifacts(
            artifact_uri=source,
            dst_path=str(stack.root / "challenger"),
            tracking_uri=stack.mlflow_uri,
        )
    )
    merged = project / "models" / "merged" / "model.safetensors"
    assert [p.read_bytes() for p in folder.rglob("model.safetensors")][:1] == [merged.read_bytes()]

    # The registration's event started exactly one release (no CPU worker here: it waits).
    async def releases(client: Any) -> list[Any]:
        from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

        deployment = await client.read_deployment_by_name("release/release")
        return list(
            await client.read_flow_runs(
                deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment.id]))
            )
        )

    wait_until(lambda: stack.api(releases), 60, "a release started by the event", step=0.5)
    assert len(stack.api(releases)) == 1


NAP = '''"""A flow that sleeps: a run to stop a worker under."""
import time

from prefect import flow


@flow(name="nap")
def nap(seconds: float) -> float:
    time.sleep(seconds)
    return seconds
'''


def test_a_worker_stopped_mid_run_does_not_block_the_pool(stack: Stack, project: Path) -> None:
    """Stopped the hard way (SIGTERM, then SIGKILL of it and its run, as systemd does when
    TimeoutStopSec runs out): nobody reports the run, its heartbeats stop, the automation
    `tuneloop deploy` made crashes it, and the pool's one slot goes to the next run."""
    folder = stack.root / "nap"
    folder.mkdir()
    (folder / "nap.py").write_text(NAP)
    # A deployment like prefect.yaml's: the GPU pool's night queue, tagged, heartbeating.
    (folder / "prefect.yaml").write_text(
        f"""name: nap
prefect-version: 3.9.1
pull:
  - prefect.deployments.steps.set_working_directory:
      directory: {folder}
deployments:
  - name: nap
    tags: [tuneloop]
    entrypoint: nap.py:nap
    work_pool:
      name: tuneloop-gpu
      work_queue_name: night
      job_variables:
        env:
          PREFECT_FLOWS_HEARTBEAT_FREQUENCY: "{HEARTBEAT["heartbeat_s"]}"
"""
    )
    stack.cli(str(BIN / "prefect"), "--no-prompt", "deploy", "--all", cwd=folder)
    stuck = run_deployment(stack, "nap/nap", "--param", "seconds=3600")
    waiting = run_deployment(stack, "nap/nap", "--param", "seconds=1")

    first = Service.start(
        "worker",
        [str(BIN / "prefect"), "worker", "start", "--pool", "tuneloop-gpu"],
        stack.root / "nap-worker-1.log",
        cwd=folder,
        env=stack.env,
    )
    second: Service | None = None
    try:

        def running() -> bool:
            assert first.process.poll() is None, tail(first.log)
            return bool(stack.state(stuck).type.value == "RUNNING")

        wait_until(running, 180, "the first run starting", step=0.5)
        # Its first heartbeat, sent as it starts: the automation's window opens there.
        wait_until(lambda: stack.heartbeats(stuck), 60, "the first heartbeat", step=0.5)
        run = psutil.Process(first.process.pid).children(recursive=True)
        os.kill(first.process.pid, signal.SIGTERM)  # `systemctl stop`
        time.sleep(2)
        for process in [*run, psutil.Process(first.process.pid)]:  # ... TimeoutStopSec later
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        killed = time.monotonic()
        first.stop()

        second = Service.start(
            "worker",
            [str(BIN / "prefect"), "worker", "start", "--pool", "tuneloop-gpu"],
            stack.root / "nap-worker-2.log",
            cwd=folder,
            env=stack.env,
        )
        while (state := stack.state(stuck)).type.value == "RUNNING":
            # The dead run holds the pool's only slot: the next one waits.
            assert stack.state(waiting).type.value == "SCHEDULED"
            assert time.monotonic() - killed < HEARTBEAT["crash_after_s"] + 60, "never crashed"
            time.sleep(0.5)
        assert state.type.value == "CRASHED"
        assert "no heartbeat for 60 s" in state.message
        assert "tuneloop: crash flow runs whose heartbeats stopped" in state.message

        deadline = time.monotonic() + 180
        while (after := stack.state(waiting)).type.value != "COMPLETED":
            assert not after.is_final(), f"{after.name}: {after.message}\n{tail(second.log)}"
            assert time.monotonic() < deadline, tail(second.log)
            time.sleep(0.5)
    finally:
        first.stop()
        if second is not None:
            second.stop()
