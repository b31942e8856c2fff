"""``tuneloop watch``: run any training command under the power watchdog.

    tuneloop watch [--deadlock-after S] [--heartbeat FILE] [--trace-out CSV]
                   [--replay CSV] [--heartbeat-only] ... -- torchrun ... train.py

The command runs in a session (process group) of its own, with
``TUNELOOP_HEARTBEAT`` pointing at the heartbeat file. Each tick the watcher
samples the GPUs (or a replayed trace), reads the heartbeat, appends both to
the CSV trace, remembers the job's processes (``processes``) and asks the
watchdog. On a deadlock it dumps every process's stacks, ends the job (SIGTERM,
then SIGKILL), marks the MLflow run FAILED with the reason, the trace and the
timeline, and calls the alert hook; it then exits with ``WATCHDOG_EXIT_CODE``
(86). Otherwise it exits with the command's own code (128 + N when a signal N
ended it), after ending any process the job left behind (a rank that called
``setsid()`` included). Signals sent to the watcher (Ctrl-C) are passed on to
the job.

Everything lands in ``--out-dir`` (a folder of its own per run: the job must not
write or clear there): trace.csv, heartbeat.json (one per rank), stacks.txt,
timeline.png and watch.json (what ran, the config, the verdict, GPU-hours per
state and ``calibration_source``: whether the power bands behind those figures
were measured or are the shipped estimates).

``watch(WatchOptions)`` is the whole of it; the command's flags become those options in
``tuneloop/cli/host.py``, and ``stages/train.py`` builds them from params.yaml.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from tuneloop.io import write_json
from tuneloop.orchestration import forkserver
from tuneloop.telemetry.actions import (
    AlertHook,
    dump_stacks,
    log_mlflow_summary,
    mark_mlflow_failed,
    send_alert,
)
from tuneloop.telemetry.calibration import Calibration, calibration_source, load_calibration
from tuneloop.telemetry.heartbeat import (
    HEARTBEAT_ENV,
    HeartbeatRecord,
    clear_heartbeats,
    job_run_id,
    merge,
    read_heartbeats,
)
from tuneloop.telemetry.peers import GRACE_S as PEER_GRACE_S
from tuneloop.telemetry.peers import Peers
from tuneloop.telemetry.processes import JOB_TOKENS_ENV, JobProcesses, job_tokens
from tuneloop.telemetry.sampler import Sampler, open_source
from tuneloop.telemetry.trace import DeviceInfo, HeartbeatView, Tick, TraceWriter
from tuneloop.telemetry.watchdog import Alarm, WatchConfig, Watchdog

log = logging.getLogger(__name__)

WATCHDOG_EXIT_CODE = 86
RUN_ID_ENV = "MLFLOW_RUN_ID"
ALERT_WEBHOOK_ENV = "TUNELOOP_ALERT_WEBHOOK"
ALERT_COMMAND_ENV = "TUNELOOP_ALERT_COMMAND"

# The job the watcher started: a process of its own, or a fork of a served stage.
Job = subprocess.Popen[bytes] | forkserver.Forked


class WatchError(RuntimeError):
    """The command could not be started; the message says why."""


@dataclass(frozen=True)
class WatchOptions:
    command: tuple[str, ...]
    out_dir: Path
    config: WatchConfig = field(default_factory=WatchConfig)
    heartbeat: Path | None = None  # default: out_dir/heartbeat.json
    trace_out: Path | None = None  # default: out_dir/trace.csv
    replay: Path | None = None  # power from a recorded trace instead of NVML
    heartbeat_only: bool = False
    gpus: tuple[int, ...] | None = None  # NVML indices; default all
    calibration: Path | None = None  # one file for every GPU; default: matched by name
    mlflow_run_id: str | None = None
    tracking_uri: str | None = None
    alert: AlertHook = field(default_factory=AlertHook)
    # The job's folder of peers on shared storage, and this node's name in it: a hang found on
    # any node has every node dump its stacks before the ranks are ended (telemetry/peers.py).
    peers: Path | None = None
    node: str = field(default_factory=lambda: os.uname().nodename)
    peer_grace_s: float = PEER_GRACE_S

    @property
    def heartbeat_path(self) -> Path:
        return self.heartbeat or self.out_dir / "heartbeat.json"

    @property
    def trace_path(self) -> Path:
        return self.trace_out or self.out_dir / "trace.csv"


@dataclass
class WatchOutcome:
    exit_code: int
    command_exit_code: int | None
    alarm: Alarm | None
    actions: dict[str, str]
    accounting: dict[str, Any]
    manifest: Path
    job_ended_at: float | None  # when the watchdog had ended the job (epoch seconds)


def new_out_dir(root: Path) -> Path:
    """``root/<UTC time>``, with a suffix when a run in the same second took that name."""
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S")
    candidate, n = root / stamp, 1
    while candidate.exists():
        n += 1
        candidate = root / f"{stamp}-{n}"
    return candidate


def _exit_code(returncode: int) -> int:
    # The shell's convention: a process ended by signal N exits 128 + N.
    return 128 - returncode if returncode < 0 else returncode


# What stops a run: Ctrl-C, a cancelled flow run (Prefect's SIGTERM), a closed terminal.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def handling_stop_signals(
    handler: Callable[[int, FrameType | None], None] | int,
) -> Iterator[None]:
    """``handler`` for ``STOP_SIGNALS`` inside the block; the previous handlers after it."""
    previous = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


@contextlib.contextmanager
def _forward_signals(job: JobProcesses) -> Iterator[None]:
    """Pass SIGINT/SIGTERM/SIGHUP on to the whole job while the watcher runs."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may set handlers; the caller owns signals then
        return

    def forward(signum: int, frame: FrameType | None) -> None:
        log.warning("watcher got signal %d; passing it on to the job", signum)
        for process in job.alive():
            with contextlib.suppress(Exception):  # it may have exited meanwhile
                process.send_signal(signum)

    with handling_stop_signals(forward):
        yield


def _die_with_watcher() -> Callable[[], None] | None:
    """For the job, before exec: SIGTERM when the watcher dies, however it dies.

    The job runs in a session of its own (so it can be ended as a group without
    touching the watcher), which also shields it from a kill of the watcher's group:
    Prefect cancelling a flow run, or a SIGKILL of ``dvc repro``. An unwatched job
    left holding the GPUs is the worst outcome, so Linux's parent-death signal ends
    it. Elsewhere there is no such signal: None.

    libc is loaded here, in the watcher: the returned function runs between fork and
    exec, where importing or loading anything could deadlock on a lock another
    thread held at the fork.
    """
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    pr_set_pdeathsig = 1

    def set_parent_death_signal() -> None:
        prctl(pr_set_pdeathsig, signal.SIGTERM)

    return set_parent_death_signal


def _start_job(command: list[str], env: dict[str, str]) -> Job:
    """The job, in a session of its own, ended by the watcher's death. Where the watcher is
    a stage the flow's forkserver served, a ``python -m`` job starts as a fork of it, with
    the stack imported already (``forkserver.start_warm``); otherwise as a process."""
    dies_with_us = _die_with_watcher()
    if warm := forkserver.start_warm(command, env, before=dies_with_us):
        log.info("job started warm (pid %d): a fork of this stage's interpreter", warm.pid)
        return warm
    return subprocess.Popen(command, env=env, start_new_session=True, preexec_fn=dies_with_us)


def _run_action(actions: dict[str, str], name: str, action: Any) -> None:
    # One failing action (MLflow down, webhook unreachable) must not stop the others:
    # the job still has to end and the humans still have to hear. Each outcome is
    # logged and lands in watch.json.
    try:
        actions[name] = str(action() or "done")
    except Exception as err:
        log.exception("watchdog action %s failed", name)
        actions[name] = f"failed: {type(err).__name__}: {err}"


def _tracking_uri(options: WatchOptions) -> str:
    if options.tracking_uri:
        return options.tracking_uri
    # Read now, not at import: whoever launched the watch set it for this job.
    if from_env := os.environ.get("MLFLOW_TRACKING_URI"):
        return from_env
    from tuneloop.tracking.runs import tracking_uri  # the project's one default (imports mlflow)

    return tracking_uri()


def watch(options: WatchOptions) -> WatchOutcome:
    """Run ``options.command`` under the watchdog until it ends or hangs."""
    config = options.config
    if not options.command:
        raise ValueError("watch: no command to run; give it after --")
    out_dir = options.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    heartbeat = options.heartbeat_path.resolve()
    clear_heartbeats(heartbeat)
    run_id = options.mlflow_run_id or os.environ.get(RUN_ID_ENV) or None

    source = open_source(options.replay, options.heartbeat_only, options.gpus)
    sampler = Sampler(source, config.hz, buffer_s=config.timeline_tail_s)
    devices = list(sampler.devices())
    watchdog = Watchdog(devices, config, _calibrations(options, devices))
    mode = "heartbeat only" if not sampler.available else f"{len(devices)} GPU(s) + heartbeat"
    log.info("watching %s (%s); heartbeat %s", " ".join(options.command), mode, heartbeat)

    # Wall-clock stamps that never jump: start from time.time(), advance by monotonic.
    wall0, mono0 = time.time(), time.monotonic()

    def now() -> float:
        return wall0 + (time.monotonic() - mono0)

    started = now()
    writer = TraceWriter(options.trace_path, devices)
    token = uuid.uuid4().hex
    env = {
        **os.environ,
        HEARTBEAT_ENV: str(heartbeat),
        JOB_TOKENS_ENV: job_tokens(token, os.environ),
    }
    try:
        proc = _start_job(list(options.command), env)
    except OSError as err:
        writer.close()
        sampler.close()
        raise WatchError(f"cannot start {options.command[0]!r}: {err}") from err
    job = JobProcesses(proc.pid, token)
    peers = _joined(options)
    alarm: Alarm | None = None
    actions: dict[str, str] = {}
    job_ended_at: float | None = None
    period = 1.0 / config.hz
    try:
        with _forward_signals(job):
            next_tick = time.monotonic()
            while proc.poll() is None:
                t = now()
                samples = sampler.poll(t)
                records = read_heartbeats(heartbeat)
                job.refresh(records)
                view = merge(records)
                writer.write(Tick(t, tuple(samples), view))
                alarm = watchdog.observe(t, samples, view) or _peer_alarm(peers, t, view)
                if alarm is not None:
                    run_id = run_id or job_run_id(records)
                    job_ended_at = _respond(
                        alarm, proc, job, records, watchdog, options, run_id, actions, sampler
                    )
                    break
                next_tick += period
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=max(0.0, next_tick - time.monotonic()))
    finally:
        writer.close()
        sampler.close()
        if proc.poll() is None:
            # An exception in the watcher itself: do not leave an unwatched job behind.
            log.error("watcher failed; ending the job it was watching")
            job.end(config.kill_grace_s, read_heartbeats(heartbeat))
        proc.wait()
    # The command has ended; nothing it started may outlive it (a rank in its own session).
    _run_action(actions, "leftovers", lambda: _end_leftovers(job, heartbeat, config.kill_grace_s))
    if actions["leftovers"] == "none":
        del actions["leftovers"]

    ended = now()
    watchdog.finish(ended)
    command_code = _exit_code(proc.wait())  # ended: its status
    exit_code = WATCHDOG_EXIT_CODE if alarm is not None else command_code
    bands = calibration_source(watchdog.calibrations.values())
    accounting = watchdog.accounting.to_dict()
    log.info("GPU time by state (power bands: %s):\n%s", bands, watchdog.accounting.table())
    run_id = run_id or job_run_id(read_heartbeats(heartbeat))
    plot = out_dir / "timeline.png"
    if (watchdog.windows or watchdog.heartbeats) and "plot" not in actions:
        _run_action(actions, "plot", lambda: _plot(options, watchdog, plot))
    if run_id and alarm is None:
        _run_action(
            actions,
            "mlflow_summary",
            lambda: log_mlflow_summary(
                run_id,
                {**accounting, "calibration_source": bands},
                [plot, options.trace_path],
                _tracking_uri(options),
            ),
        )
    manifest = out_dir / "watch.json"
    write_json(
        manifest,
        {
            "command": list(options.command),
            "config": asdict(config),
            "started": dt.datetime.fromtimestamp(started, dt.UTC).isoformat(),
            "ended": dt.datetime.fromtimestamp(ended, dt.UTC).isoformat(),
            "mode": mode,
            "devices": [asdict(d) for d in devices],
            "calibrations": {
                str(i): {"gpu_model": c.gpu_model, "estimated": c.estimated}
                for i, c in watchdog.calibrations.items()
            },
            "calibration_source": bands,
            "heartbeat": str(heartbeat),
            "trace": str(options.trace_path),
            "mlflow_run_id": run_id,
            "alarm": asdict(alarm) if alarm else None,
            "actions": actions,
            "events": [{"t": t, "message": m} for t, m in watchdog.events],
            "accounting": accounting,
            "command_exit_code": command_code,
            "exit_code": exit_code,
            "job_ended_at": job_ended_at,
        },
    )
    return WatchOutcome(exit_code, command_code, alarm, actions, accounting, manifest, job_ended_at)


def _calibrations(options: WatchOptions, devices: list[DeviceInfo]) -> dict[int, Calibration]:
    """The one calibration file given for every GPU; none: each is matched by its name."""
    if options.calibration is None:
        return {}
    chosen = load_calibration(options.calibration)
    return {d.index: chosen for d in devices}


def _joined(options: WatchOptions) -> Peers | None:
    """This node among the job's peers, announced to them; None for a job on one machine."""
    if options.peers is None:
        return None
    peers = Peers(options.peers, options.node)
    peers.join()
    return peers


def _peer_alarm(peers: Peers | None, t: float, view: HeartbeatView | None) -> Alarm | None:
    """An alarm of this node's own when another node's watchdog found a hang: its ranks wait
    on that node's, so they are ended too, after their stacks are written."""
    raised = peers.raised() if peers is not None else None
    if raised is None:
        return None
    return Alarm(
        t=t,
        kind="peer",
        reason=f"the watchdog on {raised.node} found a hang: {raised.reason}",
        last_step=view.step if view is not None else raised.last_step,
        quiet_s=0.0,
        stalled_s=None,
        section=view.section if view is not None else None,
    )


def _plot(options: WatchOptions, watchdog: Watchdog, out: Path) -> str:
    from tuneloop.telemetry.plot import plot_timeline

    title = f"tuneloop watch: {' '.join(options.command)[:80]}"
    plot_timeline(
        [], list(watchdog.windows), out, title, watchdog.alarms, list(watchdog.heartbeats)
    )
    return str(out)


def _end_leftovers(job: JobProcesses, heartbeat: Path, grace_s: float) -> str:
    ended = job.end(grace_s, read_heartbeats(heartbeat))
    if not ended.terminated:
        return "none"
    log.warning(
        "the job's command has exited; ended %d process(es) it left running: %s",
        len(ended.terminated),
        ended.terminated,
    )
    killed = f"; SIGKILL for {ended.killed}" if ended.killed else ""
    return f"ended {ended.terminated} (SIGTERM{killed})"


def _await_peers(peers: Peers, grace_s: float) -> str:
    """Wait for the other nodes' stacks before this node's ranks are ended (and with them the
    connections the others' ranks are blocked on)."""
    others = [node for node in peers.joined() if node != peers.node]
    missing = peers.wait_for_stacks(grace_s)
    if missing:
        log.warning("no stacks from %s within %.0f s; ending this node's ranks", missing, grace_s)
        return f"stacks from {sorted(set(others) - set(missing))}; none from {missing}"
    return f"stacks from {others}"


def _respond(
    alarm: Alarm,
    proc: Job,
    job: JobProcesses,
    records: Sequence[HeartbeatRecord],
    watchdog: Watchdog,
    options: WatchOptions,
    run_id: str | None,
    actions: dict[str, str],
    sampler: Sampler,
) -> float | None:
    """Stacks, end the job, timeline, MLflow, alert; returns when the job was ended."""
    out_dir = options.out_dir
    ended: list[float] = []
    stacks = out_dir / "stacks.txt"
    plot = out_dir / "timeline.png"
    peers = Peers(options.peers, options.node) if options.peers else None
    if peers is not None and alarm.kind != "peer":
        # First, so the other nodes dump their stacks while this node dumps its own.
        peers.raise_alarm(alarm.reason, alarm.last_step)
    _run_action(actions, "stacks", lambda: dump_stacks(job.alive(), records, stacks))
    if peers is not None:
        peers.stacked()
        if alarm.kind != "peer":
            _run_action(actions, "peers", lambda: _await_peers(peers, options.peer_grace_s))

    def end() -> str:
        done = job.end(options.config.kill_grace_s, records)
        proc.wait()
        ended.append(time.time())
        killed = f"; SIGKILL for {done.killed}" if done.killed else ""
        return f"ended {done.terminated} (SIGTERM{killed})"

    _run_action(actions, "end_job", end)
    timeline = watchdog.timeline_text(options.config.timeline_tail_s)
    (out_dir / "timeline.tsv").write_text(timeline, encoding="utf-8")
    if watchdog.windows or watchdog.heartbeats:
        tail_start = alarm.t - options.config.timeline_tail_s
        windows = [w for w in watchdog.windows if w.t1 >= tail_start]
        earlier = [(t, v) for t, v in watchdog.heartbeats if t < tail_start]
        # The step the tail starts at, then every change within it.
        beats = [(tail_start, earlier[-1][1])] if earlier else []
        beats += [(t, v) for t, v in watchdog.heartbeats if t >= tail_start]

        def draw() -> str:
            from tuneloop.telemetry.plot import plot_timeline

            title = f"watchdog: {alarm.kind} at step {alarm.last_step}"
            samples = sampler.recent(tail_start)
            return str(plot_timeline(samples, windows, plot, title, [alarm], beats))

        _run_action(actions, "plot", draw)
    if run_id:
        _run_action(
            actions,
            "mlflow",
            lambda: mark_mlflow_failed(
                run_id,
                alarm.reason,
                timeline,
                {
                    **watchdog.accounting.to_dict(),
                    "calibration_source": calibration_source(watchdog.calibrations.values()),
                },
                [stacks, plot, options.trace_path],
                _tracking_uri(options),
            ),
        )
    if options.alert.configured:
        payload = {
            "event": "tuneloop.watchdog." + alarm.kind,
            "reason": alarm.reason,
            "command": list(options.command),
            "last_step": alarm.last_step,
            "mlflow_run_id": run_id,
            "host": os.uname().nodename,
            "out_dir": str(out_dir),
        }
        _run_action(actions, "alert", lambda: send_alert(options.alert, payload))
    return ended[0] if ended else None
