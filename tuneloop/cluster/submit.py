"""The train stage's side of a cluster run: check, submit, stream the log, wait, report.

``dvc repro`` (or the flow) runs ``python -m stages.train`` on the login node as ever; with
``train.launcher: slurm`` it does not train: it checks the launch (``preflight.launch``),
opens the stage's MLflow run, submits one job whose ranks log into that run, copies the job's
output into its own log while it waits, and ends as the job ended. Its outputs (the adapter,
metrics/train.json) are what rank 0 wrote on storage the nodes share, so DVC records them
here, the same as after a local run.

Cancel: SIGINT (Ctrl-C on ``dvc repro``), SIGTERM (Prefect cancelling the flow run) or
SIGHUP cancel the job (scancel) and the stage waits until Slurm has ended it; so do an
exception and the death of the process that started the stage (a flow run cancelled while
``dvc repro`` runs: the stage finds itself orphaned at its next poll). Nothing ends a job
after a SIGKILL of the stage itself but the job's time limit: ``scancel`` it by the id on the
stage's MLflow run.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType

from tuneloop.cluster import slurm
from tuneloop.cluster.job import (
    JOB_FILE,
    SUCCEEDED,
    TAG_JOB_ID,
    TAG_LAUNCHER,
    TAG_LOGS,
    TAG_NODES,
    TAG_STATE,
    JobStatus,
    Submitted,
    read_alarms,
    read_exit_codes,
    usage_by_node,
)
from tuneloop.cluster.kubernetes import TrainJobs, trainjob
from tuneloop.io import read_model, write_json, write_model
from tuneloop.params import Params
from tuneloop.preflight.launch import launch_problems, world_size_problems
from tuneloop.telemetry.watch import WATCHDOG_EXIT_CODE, handling_stop_signals, new_out_dir
from tuneloop.training.metrics import JobReport, TrainMetrics

STAGE = "train"
# A cancelled job's processes get Slurm's KillWait to end; then it is gone from the queue.
CANCEL_WAIT_S = 120
log = logging.getLogger(__name__)


class StageInterrupted(Exception):
    """A signal reached the stage while it waited for the job, or its parent died."""

    def __init__(self, signum: int, why: str | None = None) -> None:
        super().__init__(why or signal.Signals(signum).name)
        self.signum = signum


def check_parent(parent: int) -> None:
    """Raise when the process that started the stage is gone (``dvc repro`` killed by a flow
    run's cancellation, say): nobody waits for the job any more."""
    if os.getppid() != parent:
        raise StageInterrupted(
            signal.SIGHUP, f"the process that started the stage (pid {parent}) is gone"
        )


class Interrupts:
    """SIGINT, SIGTERM and SIGHUP while the stage waits for its job, raised where it is safe.

    A handler that raised wherever the signal landed raised inside MLflow's or a subprocess's
    code, which may wrap it: a SIGTERM during ``mlflow.set_tags`` ended the stage with
    ``MlflowException: SIGTERM``, naming neither the signal nor the job. So the handler raises
    ``StageInterrupted`` only while the stage sleeps between polls; elsewhere it notes the
    signal, and the next ``check`` (``wait_for`` makes one before every poll) raises it.
    """

    def __init__(self) -> None:
        self.pending: int | None = None
        self.sleeping = False

    def handler(self, signum: int, frame: FrameType | None) -> None:
        self.pending = signum
        if self.sleeping:
            self.sleeping = False  # a second signal while this one unwinds the sleep: noted
            raise StageInterrupted(signum)

    def check(self) -> None:
        if self.pending is not None:
            raise StageInterrupted(self.pending)

    def sleep(self, seconds: float) -> None:
        self.sleeping = True  # before the check: a signal between the two raises either way
        try:
            self.check()
            time.sleep(seconds)
        finally:
            self.sleeping = False

    @contextlib.contextmanager
    def installed(self) -> Iterator[Interrupts]:
        with handling_stop_signals(self.handler):
            yield self


class LogTail:
    """Copies what the job appends to its output file into the stage's own log."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0

    def pump(self) -> None:
        if not self.path.is_file():
            return
        with self.path.open("rb") as out:
            out.seek(self.offset)
            new = out.read()
        self.offset += len(new)
        if new:
            sys.stderr.write(new.decode("utf-8", "replace"))
            sys.stderr.flush()


def wait_for(
    job_id: str,
    status: Callable[[str], JobStatus | None],
    pump: Callable[[], None],
    poll_s: float,
    interrupts: Interrupts | None = None,
) -> JobStatus:
    """Poll until the job has ended, streaming its log; the last status the scheduler gave.
    Raises ``StageInterrupted`` for a signal ``interrupts`` caught, or a parent gone."""
    interrupts = interrupts or Interrupts()
    last: JobStatus | None = None
    parent = os.getppid()
    while True:
        interrupts.check()
        check_parent(parent)
        pump()
        now = status(job_id)
        if now is None:  # the scheduler forgot it already: the last status seen stands
            if last is None:
                raise slurm.SlurmError(f"the scheduler does not know job {job_id}")
            return last
        if last is None or (now.state, now.nodes) != (last.state, last.nodes):
            log.info("train: job %s %s on %s", job_id, now.state, ",".join(now.nodes) or "-")
            _set_tags({TAG_STATE: now.state, TAG_NODES: ",".join(now.nodes)} if now.nodes else {})
        last = now
        if now.ended:
            time.sleep(min(poll_s, 1.0))  # the last lines reach the shared file
            pump()
            return now
        interrupts.sleep(poll_s)


def cancel(
    job_id: str,
    status: Callable[[str], JobStatus | None],
    end: Callable[[str], None],
    poll_s: float,
) -> JobStatus | None:
    """Cancel the job (scancel, delete), then wait until it has ended; its last status."""
    log.warning("train: cancelling job %s", job_id)
    end(job_id)
    deadline = time.monotonic() + CANCEL_WAIT_S
    last = None
    while time.monotonic() < deadline:
        now = status(job_id)
        if now is None or now.ended:
            return now or last
        last = now
        time.sleep(min(poll_s, 1.0))
    log.error("train: job %s still %s after cancelling it", job_id, last.state if last else "?")
    return last


def _set_tags(tags: dict[str, str]) -> None:
    import mlflow

    if tags and mlflow.active_run() is not None:
        mlflow.set_tags(tags)


def job_report(params: Params, status: JobStatus, folder: Path) -> JobReport:
    usage = usage_by_node(slurm.runs(status.job_id), params.cluster.gpus_per_node)
    if not usage and status.nodes:  # no accounting kept: the last run's own clock
        usage = usage_by_node([(status.nodes, status.elapsed_s)], params.cluster.gpus_per_node)
    return JobReport(
        launcher="slurm",
        job_id=status.job_id,
        state=status.state,
        nodes=status.nodes,
        restarts=status.restarts,
        elapsed_s=max((u.seconds for u in usage), default=status.elapsed_s),
        gpu_hours=round(sum(u.gpu_hours for u in usage), 6),
        usage=tuple(usage),
        logs=str(folder),
    )


def record(params: Params, report: JobReport) -> None:
    """The job on the stage's MLflow run and, once it succeeded, in metrics/train.json."""
    import mlflow

    from tuneloop.stage import metrics_path
    from tuneloop.tracking import runs

    _set_tags({TAG_STATE: report.state, TAG_NODES: ",".join(report.nodes)})
    per_node = {f"cluster.gpu_hours.{u.node}": u.gpu_hours for u in report.usage}
    runs.log_metrics(
        {"gpu_hours": report.gpu_hours, "cluster.elapsed_s": report.elapsed_s, **per_node}
    )
    path = metrics_path(params, STAGE)
    if report.state == SUCCEEDED and path.is_file():
        metrics = read_model(path, TrainMetrics)
        # The scheduler's accounting replaces the ranks' own estimate (GPUs x their wall time).
        update = {"gpu_hours": report.gpu_hours, "cluster": report}
        write_model(path, metrics.model_copy(update=update))
    for node in report.nodes:
        stacks = Path(report.logs) / node / "stacks.txt"
        if stacks.is_file():
            mlflow.log_artifact(str(stacks), f"watchdog/{node}")


def failure(
    report: JobReport, codes: dict[str, int], alarms: dict[str, str] | None = None
) -> tuple[int, str]:
    """The stage's exit code and its one sentence for a job that did not complete.
    ``alarms``: each node watchdog's alarm kind, to name the node that found a hang apart
    from those that ended their ranks because of it ("peer")."""
    logs = f"logs in {report.logs} (slurm-{report.job_id}.out, each node's watchdog by name)"
    ended = sorted(node for node, code in codes.items() if code == WATCHDOG_EXIT_CODE)
    if ended:
        alarms = alarms or {}
        found = [node for node in ended if alarms.get(node) != "peer"] or ended
        others = [node for node in ended if node not in found]
        also = f"; {', '.join(others)} wrote its ranks' stacks and ended them too" if others else ""
        return WATCHDOG_EXIT_CODE, (
            f"train: the watchdog on {', '.join(found)} found a hang and ended Slurm job "
            f"{report.job_id} ({report.state}){also}; every rank's stacks and the {logs}"
        )
    # A node whose watchdog left no exit code was ended before it could write one (scancel's
    # SIGKILL after its grace): it did not end well either.
    failed = [node for node in report.nodes if codes.get(node, 1) != 0] or list(report.nodes)
    return 1, (
        f"train: Slurm job {report.job_id} ended {report.state} on "
        f"{', '.join(failed) or 'no node'}; {logs}"
    )


def run_on_slurm(params: Params) -> None:
    """Submit the ranks as one Slurm job, wait, and end as it ended (SystemExit unless it
    completed)."""
    from tuneloop.tracking import runs

    project = Path.cwd().resolve()
    if problems := launch_problems(params, project):
        lines = "\n".join(f"- {p}" for p in problems)
        raise SystemExit(f"train: the Slurm launch was refused before submitting:\n{lines}")
    folder = new_out_dir(params.paths.watch).resolve()
    folder.mkdir(parents=True)
    script = folder / "job.sbatch"
    script.write_text(slurm.batch_script(params, folder, project, sys.executable))
    with runs.stage_run(STAGE, params) as run:
        # Rank 0 logs into this run; the job keeps the variable through a requeue.
        env = os.environ | {"MLFLOW_RUN_ID": run.info.run_id}
        status = _submit_and_wait(params, script, folder, env)
        report = job_report(params, status, folder)
        record(params, report)
        log.info("train: %s", report.model_dump(mode="json"))
        if report.state != SUCCEEDED:
            codes = read_exit_codes(folder, report.nodes)
            code, sentence = failure(report, codes, read_alarms(folder, report.nodes))
            log.error("%s", sentence)
            raise SystemExit(code)


def _submit_and_wait(params: Params, script: Path, folder: Path, env: dict[str, str]) -> JobStatus:
    poll_s = params.cluster.poll_s
    with Interrupts().installed() as interrupts:
        # A signal from here on is raised at the next check: after the submit, never in it, so
        # the job it submitted is known and cancelled.
        job_id = slurm.submit(script, env)
        submitted = Submitted(
            launcher="slurm", job_id=job_id, submitted_at=dt.datetime.now(dt.UTC).isoformat()
        )
        write_json(folder / JOB_FILE, submitted.model_dump(mode="json"))
        log.info("train: submitted Slurm job %s; its log and evidence: %s", job_id, folder)
        _set_tags({TAG_LAUNCHER: "slurm", TAG_JOB_ID: job_id, TAG_LOGS: str(folder)})
        ended: JobStatus | None = None
        try:
            tail = LogTail(folder / f"slurm-{job_id}.out")
            ended = wait_for(job_id, slurm.status, tail.pump, poll_s, interrupts)
            return ended
        except StageInterrupted as interrupted:
            log.error("train: %s while waiting; cancelling Slurm job %s", interrupted, job_id)
            code = 128 + interrupted.signum
        finally:
            if ended is None:  # a signal or an error: the job must not outlive the stage
                with signal_ignored():
                    last = cancel(job_id, slurm.status, slurm.cancel, poll_s)
                if last is not None:
                    _set_tags({TAG_STATE: last.state})
    log.error(
        "train: Slurm job %s ended CANCELLED (the stage was interrupted); logs in %s",
        job_id,
        folder,
    )
    raise SystemExit(code)


def signal_ignored() -> contextlib.AbstractContextManager[None]:
    # A second Ctrl-C must not interrupt the cancel that the first one asked for.
    return handling_stop_signals(signal.SIG_IGN)


class PodLogs:
    """Copies what each pod of the TrainJob has logged since the last poll into the stage's log."""

    def __init__(self, jobs: TrainJobs, name: str) -> None:
        self.jobs, self.name = jobs, name
        self.seen: dict[str, int] = {}

    def pump(self) -> None:
        for pod, text in self.jobs.logs(self.name).items():
            new = text[self.seen.get(pod, 0) :]
            self.seen[pod] = len(text)
            for line in new.splitlines():
                sys.stderr.write(f"[{pod}] {line}\n")
        sys.stderr.flush()


def run_on_kubernetes(params: Params, jobs: TrainJobs | None = None) -> None:
    """Create the TrainJob, wait, and end as it ended (SystemExit unless it completed)."""
    from tuneloop.tracking import runs

    project = Path.cwd().resolve()
    if problems := world_size_problems(params):
        lines = "\n".join(f"- {p}" for p in problems)
        raise SystemExit(f"train: the TrainJob was refused before submitting:\n{lines}")
    folder = new_out_dir(params.paths.watch).resolve()
    folder.mkdir(parents=True)
    name = f"tuneloop-train-{folder.name}".lower()
    jobs = jobs or TrainJobs(params.cluster.namespace)
    poll_s = params.cluster.poll_s
    with runs.stage_run(STAGE, params) as run:
        manifest = trainjob(params, name, project)
        manifest["spec"]["trainer"]["env"].append(
            {"name": "MLFLOW_RUN_ID", "value": run.info.run_id}
        )
        write_json(folder / "trainjob.json", manifest)
        with Interrupts().installed() as interrupts:
            jobs.create(manifest)
            write_json(
                folder / JOB_FILE,
                Submitted(
                    launcher="kubernetes",
                    job_id=name,
                    submitted_at=dt.datetime.now(dt.UTC).isoformat(),
                ).model_dump(mode="json"),
            )
            _set_tags({TAG_LAUNCHER: "kubernetes", TAG_JOB_ID: name, TAG_LOGS: str(folder)})
            ended: JobStatus | None = None
            try:
                pods = PodLogs(jobs, name)
                ended = wait_for(name, jobs.status, pods.pump, poll_s, interrupts)
            except StageInterrupted as interrupted:
                log.error("train: %s while waiting; deleting TrainJob %s", interrupted, name)
            finally:
                if ended is None:
                    with signal_ignored():
                        cancel(name, jobs.status, jobs.delete, poll_s)
        if ended is None:
            _set_tags({TAG_STATE: "CANCELLED"})
            raise SystemExit(f"train: TrainJob {name} deleted (CANCELLED); logs in {folder}")
        usage = usage_by_node([(ended.nodes, ended.elapsed_s)], params.cluster.gpus_per_node)
        report = JobReport(
            launcher="kubernetes",
            job_id=name,
            state=ended.state,
            nodes=ended.nodes,
            restarts=ended.restarts,
            elapsed_s=ended.elapsed_s,
            gpu_hours=round(sum(u.gpu_hours for u in usage), 6),
            usage=tuple(usage),
            logs=str(folder),
        )
        record(params, report)
        if report.state != SUCCEEDED:
            raise SystemExit(
                f"train: TrainJob {name} ended {report.state} on "
                f"{', '.join(report.nodes) or 'no node'} ({ended.reason}); logs in {folder} "
                f"and `kubectl logs -n {params.cluster.namespace} -l "
                f"jobset.sigs.k8s.io/jobset-name={name}`"
            )


def run_on_cluster(params: Params) -> None:
    """``train.launcher`` slurm or kubernetes: submit the ranks there and wait."""
    if params.train.launcher == "kubernetes":
        run_on_kubernetes(params)
    else:
        run_on_slurm(params)
