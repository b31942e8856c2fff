"""The manual's release by hand, two router replicas: one restarted mid-release, one release killed.

The page's block runs as written (``tests/byhand_helpers.py``: free ports, the session's
Prefect server), the one run of it in the suite (a run of it alone would repeat each step
of this one), on CPU ``transformers serve`` backends, with a second router replica beside
the block's, started as the page's second block says: the same command and secrets, a
config that differs only in its state file, both listed in ``release.routers``. The test
acts at checkpoints put into the block (the shell waits at each until the test lets it go):

1. before the block's release, a first ``tuneloop release`` (the block's own line, its log
   elsewhere) reaches 10 % and pauses for approval; the test SIGKILLs that process. Nothing
   of it runs any more, so every replica must set the challenger to 0 % by itself when the
   lease lapses (``lease_lapsed``, which only a router's own lease watch records), within
   the lease time (a shorter lease than the block's release takes: no router restarts
   under it), and ``tuneloop status`` shows it;
2. the block's release then reaches 10 % and pauses; the test SIGKILLs the second replica
   and starts it again: it comes back at 10 % with the release's lease from its state file
   (saved for these arms), routes its users by it, and the release renews it;
3. the block approves twice and the release promotes; both replicas agree at 10, 50 and
   100 %, by their admin API and by ``tuneloop status``.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import yaml
from mlflow.tracking import MlflowClient

from serving.routing import arm_for_bucket, bucket, load_state
from tests.byhand_helpers import (
    MODEL,
    OVERLAY,
    block_env,
    localised_block,
    make_project,
    page_block,
)
from tests.helpers import wait_until, write_params
from tuneloop.demo.customers import ARM_HEADER, USER_HEADER
from tuneloop.net import free_port
from tuneloop.release import approval

# The whole suite (`make test`): router replicas, transformers serve
pytestmark = pytest.mark.slow

# The block's release: longer than a router takes to restart on a busy 2-core machine beside
# two CPU backends (3 to 11 s seen), short for a test; the flow renews every third of it.
TTL = 30.0
# The first release, killed before any router restarts: the routers wait out its lease alone,
# so a shorter one, still renewed every few seconds, keeps the test short.
KILLED_TTL = 12.0


def overrides(ttl: float) -> dict[str, dict[str, Any]]:
    """configs/demo.yaml for a release whose lease lasts ``ttl`` seconds."""
    return {"release": {**OVERLAY["release"], "lease_ttl_s": ttl}}


VERSIONS = {"champion": "1", "challenger": "2"}


class Checkpoints:
    """Places in the block where the shell stops until the test has done its part."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir()

    def line(self, name: str) -> str:
        # The environment too: the block made the secrets, the second replica needs them.
        at, go, env = (self.folder / f"{name}.{kind}" for kind in ("at", "go", "env"))
        return f'env -0 > "{env}"; touch "{at}"; while [ ! -e "{go}" ]; do sleep 0.2; done'

    def reached(self, name: str, shell: subprocess.Popen[bytes], output: Callable[[], str]) -> None:
        deadline = time.monotonic() + 420
        while not (self.folder / f"{name}.at").exists():
            assert shell.poll() is None, f"the block ended before {name}:\n{output()}"
            assert time.monotonic() < deadline, f"the block did not reach {name}:\n{output()}"
            time.sleep(0.2)

    def env(self, name: str) -> dict[str, str]:
        pairs = (self.folder / f"{name}.env").read_bytes().split(b"\0")
        return dict(p.decode().split("=", 1) for p in pairs if b"=" in p)

    def go(self, name: str) -> None:
        (self.folder / f"{name}.go").touch()


def around(script: str, line_start: str, before: str = "", after: str = "") -> str:
    """``script`` with lines put before and after its one line that starts with ``line_start``."""
    lines = script.splitlines()
    found = [i for i, line in enumerate(lines) if line.startswith(line_start)]
    assert len(found) == 1, f"the page's block has {len(found)} lines starting {line_start!r}"
    i = found[0]
    added = [*before.splitlines(), lines[i], *after.splitlines()]
    return "\n".join([*lines[:i], *added, *lines[i + 1 :]])


class Replica:
    """The second router replica as the page starts one, on a free port, restartable."""

    def __init__(self, project: Path, port: str, env: dict[str, str]) -> None:
        block = page_block(1).splitlines()
        make_config = next(line for line in block if line.startswith("sed "))
        command, log = next(line for line in block if "-m serving.router" in line).split(" > ")
        subprocess.run(["bash", "-e", "-c", make_config], cwd=project, env=env, check=True)
        self.project = project
        self.url = f"http://127.0.0.1:{port}"
        self.state_file = project / "run" / "router-state-2.json"
        config = yaml.safe_load((project / "router-2.yaml").read_text())
        assert project / config["state_file"] == self.state_file, config
        self.command = [port if word == "8081" else word for word in shlex.split(command)]
        assert port in self.command, command
        self.env = env
        self.log_file = project / log.split()[0]
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log_file.open("ab") as log:
            self.process = subprocess.Popen(
                self.command, cwd=self.project, env=self.env, stdout=log, stderr=subprocess.STDOUT
            )
        wait_until(lambda: get(self.url, "/health") is not None, 90, f"{self.url} starting")

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()

    def log(self) -> str:
        lines = self.log_file.read_text(errors="replace").splitlines()
        return "\n".join(line for line in lines if "HTTP Request:" not in line)


def get(url: str, path: str, token: str | None = None) -> dict[str, Any] | None:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        reply = httpx.get(url + path, headers=headers, timeout=15, trust_env=False)
    except httpx.TransportError:
        return None
    reply.raise_for_status()
    result: dict[str, Any] = reply.json()
    return result


def percent(url: str, token: str) -> int | None:
    status = get(url, "/admin/status", token)
    return None if status is None else int(status["challenger_percent"])


def crash_waiting_runs() -> None:
    """Mark paused release runs Crashed, as a worker would for a dead process: none lingers."""
    from uuid import UUID

    from prefect import get_client
    from prefect.states import Crashed

    with get_client(sync_client=True) as client:
        for run in approval.waiting_releases():
            client.set_flow_run_state(UUID(run["id"]), Crashed(message="killed"), force=True)


def test_replicas_outlive_a_router_restart_and_a_killed_release(
    prefect_harness: None, tmp_path: Path
) -> None:
    project = make_project(tmp_path, overrides(KILLED_TTL))
    script, ports = localised_block()
    second_port = str(free_port())
    urls = [f"http://127.0.0.1:{ports['8080']}", f"http://127.0.0.1:{second_port}"]
    write_params(project, {"release": {"routers": urls}})

    marks = Checkpoints(tmp_path / "checkpoints")
    release_line = next(x for x in script.splitlines() if x.startswith("tuneloop release "))
    assert "logs/release.log" in release_line, release_line
    killed_log = project / "logs" / "release-killed.log"
    first_release = release_line.replace("logs/release.log", "logs/release-killed.log")
    script = around(script, f"tuneloop wait {urls[0]}", after=marks.line("routers"))
    script = around(
        script,
        "tuneloop release ",
        before=f'{first_release}\necho $! > "{marks.folder}/killed.pid"\n' + marks.line("killed"),
    )
    script = around(script, "tuneloop approve --approver alice", before=marks.line("at10"))
    script = around(script, "tuneloop approve --approver bob", before=marks.line("at50"))
    script = around(script, "wait $release", after=marks.line("promoted"))

    out_file = tmp_path / "block.out"

    def output() -> str:
        logs = sorted((project / "logs").glob("*.log"))
        shown = [out_file.read_text(errors="replace")[-5000:]]
        shown += [f"--- {p.name}\n{p.read_text(errors='replace')[-2500:]}" for p in logs]
        return "\n".join(shown)

    with ExitStack() as stack:
        stack.callback(crash_waiting_runs)
        with out_file.open("wb") as out:
            shell = subprocess.Popen(
                ["bash", "-e", "-c", script],
                cwd=project,
                env=block_env(),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

        @stack.callback
        def _stop_the_block() -> None:
            # Whatever the block left running (a failed step stops it before its `kill`).
            with contextlib.suppress(ProcessLookupError):
                os.killpg(shell.pid, signal.SIGKILL)
            shell.wait()

        # The block's router answers: the operator starts the second replica beside it.
        marks.reached("routers", shell, output)
        env = marks.env("routers")
        token = env["TUNELOOP_ADMIN_TOKEN"]
        replica = Replica(project, second_port, env)
        stack.callback(replica.kill)
        replica.start()
        marks.go("routers")

        def statuses() -> list[dict[str, Any]]:
            found = [get(url, "/admin/status", token) for url in urls]
            assert all(found), f"a replica does not answer: {found}"
            return [s for s in found if s is not None]

        def weights() -> list[int]:
            return [s["challenger_percent"] for s in statuses()]

        def tuneloop_status() -> str:
            done = subprocess.run(
                ["tuneloop", "status"], cwd=project, env=env, capture_output=True, text=True
            )
            assert done.returncode == 0, done.stdout + done.stderr
            return done.stdout

        def paused_at(at: int) -> Callable[[], bool]:
            def check() -> bool:
                assert shell.poll() is None, output()
                return bool(approval.waiting_releases()) and weights() == [at, at]

            return check

        # 1. A first release pauses at 10 % and is SIGKILLed: the routers roll back alone.
        marks.reached("killed", shell, output)
        wait_until(paused_at(10), 300, "the first release pausing at 10 %", step=0.2)
        holder = approval.waiting_releases()[0]["id"]
        assert [s["lease"]["holder"] for s in statuses()] == [holder, holder]
        release = psutil.Process(int((marks.folder / "killed.pid").read_text()))
        assert "release" in release.cmdline(), release.cmdline()
        for process in [*release.children(recursive=True), release]:
            process.send_signal(signal.SIGKILL)
        release.wait(10)
        killed = time.monotonic()
        for url in urls:
            wait_until(lambda u=url: percent(u, token) == 0, KILLED_TTL + 3, f"{url} rolling back")
        took = time.monotonic() - killed
        for status in statuses():
            assert status["lease"] is None, status
            assert status["last_change"]["action"] == "lease_lapsed", status
            assert holder in status["last_change"]["reason"]
        # The rollback takes effect in memory at once and is saved when the admin lock is
        # free (serving/live.py, save_rollback): each replica's file follows within moments.
        for state_file in (project / "run" / "router-state.json", replica.state_file):

            def saved_rollback(path: Path = state_file) -> bool:
                saved = load_state(path)
                assert saved is not None
                return (saved.challenger_percent, saved.action, saved.lease) == (
                    0,
                    "lease_lapsed",
                    None,
                )

            wait_until(saved_rollback, 10, f"{state_file} recording the rollback")
        shown = tuneloop_status()
        for url in urls:
            assert f"router    {url}: champion v1 at 100 %, challenger v2 at 0 %" in shown, shown
        assert shown.count("last change: lease_lapsed 10 -> 0 %") == 2, shown
        assert shown.count("lease: none") == 2, shown
        crash_waiting_runs()  # what a worker does with a run whose process died
        # The block's release reads its overrides as it starts: a lease a restart outlasts.
        (project / "configs" / "demo.yaml").write_text(yaml.safe_dump(overrides(TTL)))
        marks.go("killed")

        # 2. The block's release pauses at 10 %; the second replica dies and comes back.
        marks.reached("at10", shell, output)
        wait_until(paused_at(10), 300, "the release pausing at 10 %", step=0.2)
        holder = approval.waiting_releases()[0]["id"]
        before = statuses()
        assert [s["lease"]["holder"] for s in before] == [holder, holder]
        assert [s["last_change"]["action"] for s in before] == ["weights", "weights"], before
        replica.kill()
        replica.start()
        restored = statuses()[1]
        assert restored["last_change"] == before[1]["last_change"]
        assert restored["challenger_percent"] == 10, replica.log()
        assert restored["lease"]["holder"] == holder, restored
        assert {a: v["model_version"] for a, v in restored["arms"].items()} == VERSIONS
        saved = load_state(replica.state_file)
        assert saved is not None and saved.lease is not None
        assert (saved.challenger_percent, dict(saved.arms), saved.lease.holder) == (
            10,
            VERSIONS,
            holder,
        )
        assert "challenger_percent 10 from the state file" in replica.log()
        # It routes by the restored weight: the users of buckets [0, 10) get the challenger.
        for arm in VERSIONS:
            user = next(f"u{i}" for i in range(1000) if arm_for_bucket(bucket(f"u{i}"), 10) == arm)
            answer = httpx.post(
                f"{replica.url}/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                headers={USER_HEADER: user},
                timeout=60,
                trust_env=False,
            )
            assert answer.status_code == 200, answer.text
            assert answer.headers[ARM_HEADER] == arm
        # ... the release, still paused, renews the restarted replica's lease ...
        wait_until(
            lambda: statuses()[1]["lease"]["expires_at"] != restored["lease"]["expires_at"],
            TTL / 3 + 5,
            "the restarted replica's lease being renewed",
        )
        shown = tuneloop_status()
        for url in urls:
            assert f"router    {url}: champion v1 at 90 %, challenger v2 at 10 %" in shown, shown
        marks.go("at10")

        # 3. Approved to 50 %: both replicas there.
        marks.reached("at50", shell, output)
        wait_until(paused_at(50), 300, "the release pausing at 50 %", step=0.2)
        assert [s["lease"]["holder"] for s in statuses()] == [holder, holder]
        shown = tuneloop_status()
        for url in urls:
            assert f"router    {url}: champion v1 at 50 %, challenger v2 at 50 %" in shown, shown
        marks.go("at50")

        # ... and promoted: both at 100 %, the lease ended.
        marks.reached("promoted", shell, output)
        final = statuses()
        assert [s["challenger_percent"] for s in final] == [100, 100], final
        assert [s["lease"] for s in final] == [None, None], final
        marks.go("promoted")
        shell.wait(120)
        shown = output()
        assert shell.returncode == 0, shown

    release_log = (project / "logs" / "release.log").read_text()
    assert "release promoted: v2 promoted at 100 %" in release_log, shown
    block_out = out_file.read_text()
    for url in urls:
        assert f"router    {url}: champion v1 at 0 %, challenger v2 at 100 %" in block_out
    assert took <= KILLED_TTL + 3, took
    aliases = MlflowClient(f"sqlite:///{project / 'mlflow.db'}").get_registered_model(MODEL).aliases
    assert {k: str(v) for k, v in aliases.items()} == {"champion": "2", "previous-champion": "1"}
    assert not re.search(r"^release (promoted|rolled back)", killed_log.read_text(), re.M)

    # What the block shows a reader: the approvals, `tuneloop status` (a table of figures or
    # "-", never "n/a ms"), the backends serving the registry's versions from run/serve/, and
    # the demo customers' flags in the next month's incoming data.
    assert "TypeError" not in release_log
    assert "approved" in block_out and "by alice" in block_out and "by bob" in block_out
    table = r"^arm\s+requests\s+errors\s+badcases\s+p99 latency\s+p99 TTFT$"
    assert re.search(table, block_out, re.M), block_out
    assert "n/a" not in block_out and "challenger0" not in block_out
    assert "registry  champion v2, previous-champion v1" in block_out
    served = {
        arm: yaml.safe_load((project / "run/serve" / f"{arm}.json").read_text())
        for arm in ("champion", "challenger")
    }
    assert (served["champion"]["version"], served["challenger"]["version"]) == ("1", "2")
    assert list((project / "data/badcases/incoming").glob("router-feedback-*.jsonl"))
