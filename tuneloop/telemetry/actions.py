"""What the watchdog does about a deadlock: stacks, MLflow, an alert (``processes`` ends the job).

Stacks come from ``py-spy dump --pid`` for every process of the job when py-spy
is installed (``pip install py-spy``; it needs ptrace rights over the job: same
user, and ``kernel.yama.ptrace_scope`` 0 or root/CAP_SYS_PTRACE in containers).
Without py-spy the watchdog sends SIGUSR1 to the ranks whose heartbeat says
they called ``Heartbeat.register_faulthandler()``, and their stacks go to their
own stderr (the job's log). It never sends SIGUSR1 elsewhere: its default
action kills the process.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from tuneloop.telemetry.heartbeat import HeartbeatRecord

log = logging.getLogger(__name__)

PY_SPY_TIMEOUT_S = 30.0
ALERT_TIMEOUT_S = 10.0
TAG_REASON = "tuneloop.watchdog.reason"
TAG_CALIBRATION = "tuneloop.watchdog.calibration_source"


def find_py_spy() -> str | None:
    """py-spy on PATH, or beside this interpreter (a virtual environment not activated)."""
    beside = Path(sys.executable).parent / "py-spy"
    return shutil.which("py-spy") or (str(beside) if beside.exists() else None)


def py_spy_dump(py_spy: str, pid: int, native: bool = False) -> str:
    """One process's stacks, or why py-spy gave none; ``native`` adds C/C++ frames."""
    try:
        done = subprocess.run(
            [py_spy, "dump", "--pid", str(pid), *(["--native"] if native else [])],
            capture_output=True,
            text=True,
            timeout=PY_SPY_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return f"=== pid {pid}: py-spy timed out after {PY_SPY_TIMEOUT_S:.0f} s\n"
    if done.returncode != 0:
        return f"=== pid {pid}: py-spy failed ({done.returncode}): {done.stderr.strip()}\n"
    return f"=== pid {pid}\n{done.stdout}"


def _is_python(proc: psutil.Process) -> bool:
    try:
        return "python" in Path(proc.exe()).name or any(
            "python" in Path(part).name for part in proc.cmdline()[:1]
        )
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def dump_stacks(
    processes: Sequence[psutil.Process],
    heartbeats: Sequence[HeartbeatRecord],
    out: Path,
    py_spy: str | None = None,
) -> str:
    """Dump every Python process's stacks into ``out``; returns how it was done.

    ``py_spy`` defaults to the one ``find_py_spy`` finds; pass "" to use the
    faulthandler signal instead.
    """
    py_spy = find_py_spy() if py_spy is None else py_spy or None
    if py_spy is not None:
        pythons = [p for p in processes if _is_python(p)]
        with ThreadPoolExecutor(max_workers=max(1, min(8, len(pythons)))) as pool:
            dumps = list(pool.map(lambda p: py_spy_dump(py_spy, p.pid), pythons))
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("".join(dumps), encoding="utf-8")
        return f"py-spy dump of {len(pythons)} Python process(es) written to {out}"
    pids = {p.pid for p in processes}
    signalled = []
    for record in heartbeats:
        if record.stack_signal is not None and record.pid in pids:
            try:
                os.kill(record.pid, record.stack_signal)
                signalled.append(record.pid)
            except ProcessLookupError:
                continue
    if signalled:
        # faulthandler writes from a signal handler; give it a moment before the SIGTERM.
        time.sleep(1.0)
        return (
            f"py-spy not installed; sent the faulthandler signal to pids {signalled} "
            "(stacks in their stderr)"
        )
    return (
        "no stacks: py-spy is not installed (pip install py-spy) and no rank registered "
        "faulthandler (Heartbeat.register_faulthandler)"
    )


def _log_watch(
    client: Any, run_id: str, summary: Mapping[str, Any], artifacts: Sequence[Path]
) -> None:
    # The bands behind the per-state figures are estimates unless a calibration measured them;
    # the tag says which beside the figures.
    client.set_tag(run_id, TAG_CALIBRATION, str(summary["calibration_source"]))
    client.log_dict(run_id, dict(summary), "watchdog/accounting.json")
    for path in artifacts:
        if path.exists():
            client.log_artifact(run_id, str(path), "watchdog")


def mark_mlflow_failed(
    run_id: str,
    reason: str,
    timeline: str,
    summary: Mapping[str, Any],
    artifacts: Sequence[Path],
    tracking_uri: str | None = None,
) -> None:
    """Tag the run with the reason, attach the timeline, summary and artifacts, end it FAILED.

    ``summary``: GPU-hours per state (``Accounting.to_dict``) and ``calibration_source``.
    """
    from mlflow.tracking import MlflowClient  # heavy; only when a run is given

    client = MlflowClient(tracking_uri)
    client.set_tag(run_id, TAG_REASON, reason[:5000])
    client.log_text(run_id, reason + "\n", "watchdog/reason.txt")
    client.log_text(run_id, timeline, "watchdog/timeline.tsv")
    _log_watch(client, run_id, summary, artifacts)
    client.set_terminated(run_id, "FAILED")


def log_mlflow_summary(
    run_id: str,
    summary: Mapping[str, Any],
    artifacts: Sequence[Path],
    tracking_uri: str | None = None,
) -> None:
    """GPU-hours per state, the trace and the timeline plot, for a run that ended on its own."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    for state, hours in summary["gpu_hours"].items():
        client.log_metric(run_id, f"gpu_hours.{state}", hours)
    _log_watch(client, run_id, summary, artifacts)


@dataclass(frozen=True)
class AlertHook:
    """Where to say a job hung: a webhook (JSON POST) and/or a shell command."""

    webhook_url: str | None = None
    command: str | None = None

    @property
    def configured(self) -> bool:
        return bool(self.webhook_url or self.command)


def send_alert(hook: AlertHook, payload: Mapping[str, Any]) -> None:
    """POST ``payload`` as JSON to the webhook; run the command with it in the environment.

    The command gets ``TUNELOOP_ALERT_REASON`` and ``TUNELOOP_ALERT_JSON``. Failures
    raise: the caller logs them beside the other actions' outcomes.
    """
    if hook.webhook_url:
        request = urllib.request.Request(
            hook.webhook_url,
            data=json.dumps(payload).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=ALERT_TIMEOUT_S) as response:
            response.read()
    if hook.command:
        env = {
            **os.environ,
            "TUNELOOP_ALERT_REASON": str(payload.get("reason", "")),
            "TUNELOOP_ALERT_JSON": json.dumps(payload),
        }
        subprocess.run(["/bin/sh", "-c", hook.command], env=env, check=True, timeout=60)
