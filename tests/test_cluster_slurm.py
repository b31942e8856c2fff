"""The train stage on a real two-node Slurm cluster (tests/slurm_helpers.py): a LoRA of the tiny
model, 2 nodes x 1 rank over gloo, each node's rank under its own watchdog.

The data is built once (the module fixture of tests/test_train_stage.py); every run goes
through ``python -m stages.train`` as ``dvc repro`` starts it on the login node.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import torch
from mlflow.tracking import MlflowClient

from tests.helpers import free_port, write_params
from tests.slurm_helpers import SlurmCluster, slurm_cluster  # noqa: F401
from tests.train_helpers import FAST, data, make_project, run_stage, stage_env  # noqa: F401
from tuneloop.cli.rollout import training_job_line
from tuneloop.cluster.slurm import pairs
from tuneloop.params import load_params

# The whole suite (`make test`): a two-node Slurm cluster, training ranks on it
pytestmark = pytest.mark.slow

LORA = {"method": "lora", "distributed": "ddp"}
# Steps of the run the pre-end signal interrupts: far more than it makes before the signal.
MAX_STEPS = 24
# How long Prefect's runner waits after SIGTERM before it sends SIGKILL.
PREFECT_KILL_GRACE_S = 30


def cluster_project(data: Path, folder: Path, **train: Any) -> Path:
    """A two-rank LoRA project whose train stage submits to the test cluster."""
    make_project(data, folder, world_size=2, watchdog={}, **LORA)
    write_params(
        folder,
        {
            "batch": {"world_size": 2, "micro_batch_size": 1, "effective_batch": 2},
            "train": {**FAST, **LORA, "launcher": "slurm", **train},
            "watchdog": {"enabled": True},
            "cluster": {
                "nodes": 2,
                "gpus_per_node": 1,
                "rendezvous_port": free_port(),
                "poll_s": 0.5,
                "time_limit": "10:00",
                "env": {"OMP_NUM_THREADS": "1"},
            },
        },
    )
    return folder


def start_stage(
    folder: Path, cluster: SlurmCluster, *parent: str, session: bool = False
) -> tuple[subprocess.Popen[bytes], Path]:
    """``python -m stages.train`` (under ``parent``, a shell say; in a session of its own with
    ``session``) and the file of its output."""
    log = folder / "stage.log"
    with log.open("wb") as out:
        stage = subprocess.Popen(
            [*parent, sys.executable, "-m", "stages.train"],
            cwd=folder,
            env=stage_env() | {"SLURM_CONF": cluster.env["SLURM_CONF"]},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=session,
        )
    return stage, log


def finish(stage: subprocess.Popen[bytes], log: Path, timeout: float = 600) -> str:
    stage.wait(timeout=timeout)
    return log.read_text()


def training_job(cluster: SlurmCluster, log: Path, timeout: float = 300) -> str:
    """The id of the stage's job once both nodes' ranks have made a training step."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log.read_text()
        if (
            "submitted Slurm job" in text
            and text.count("'train_samples'") + text.count("'loss'") >= 1
        ):
            return text.split("submitted Slurm job ", 1)[1].split(";", 1)[0]
        time.sleep(1)
    raise AssertionError(f"no training step within {timeout} s:\n{log.read_text()[-3000:]}")


def started_job(cluster: SlurmCluster, log: Path, timeout: float = 300) -> str:
    """The id of the stage's job once its srun step runs: the batch shell set its USR1 trap
    before it started srun, and the ranks are only starting."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log.read_text()
        if "submitted Slurm job " in text:
            job_id = text.split("submitted Slurm job ", 1)[1].split(";", 1)[0]
            steps = cluster.run("squeue", "-h", "-s", "-j", job_id, "-o", "%i").split()
            if f"{job_id}.0" in steps:
                return job_id
        time.sleep(0.5)
    raise AssertionError(f"no srun step within {timeout} s:\n{log.read_text()[-3000:]}")


def wait_requeued(cluster: SlurmCluster, job_id: str, timeout: float = 180) -> None:
    """Until the requeued job is PENDING and its last run has left both nodes.

    Slurm holds a requeued job back a while (BeginTime); a test then releases it
    (``release``) rather than wait.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pending = "PENDING" in cluster.run("squeue", "-h", "-j", job_id, "-o", "%T")
        states = cluster.run("sinfo", "-h", "-N", "-o", "%t").split()
        if pending and states and all(state == "idle" for state in states):
            return
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} was not requeued within {timeout} s")


def release(cluster: SlurmCluster, job_id: str) -> None:
    """Start the requeued job now rather than after Slurm's delay for a requeue, once the
    second of the requeue has passed.

    The requeue revoked the last run's credential on each node, stamped in whole seconds,
    and a node refuses a credential from that same second ("Job credential revoked": the
    job ends FAILED at once). The requeued job's SubmitTime is no earlier than that stamp.
    """
    fields = pairs(cluster.run("scontrol", "show", "job", "-o", job_id))
    requeued = dt.datetime.fromisoformat(fields["SubmitTime"]).timestamp()
    time.sleep(max(0.0, requeued + 1 - time.time()))
    cluster.run("scontrol", "update", f"jobid={job_id}", "StartTime=now")


def train_run(folder: Path) -> Any:
    client = MlflowClient(f"sqlite:///{folder / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("tuneloop")
    assert experiment is not None
    (run,) = [
        r
        for r in client.search_runs([experiment.experiment_id])
        if r.data.tags.get("tuneloop.stage") == "train@support"
    ]
    return run


def logits(folder: Path) -> torch.Tensor:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(folder / "models/base")
    model = PeftModel.from_pretrained(base, folder / "models/adapter").eval()
    with torch.no_grad():
        return model(torch.arange(1, 33).unsqueeze(0)).logits


def test_two_nodes_train_the_adapter_a_local_two_rank_run_trains(
    data: Path,
    tmp_path: Path,
    slurm_cluster: SlurmCluster,
) -> None:
    local = make_project(data, tmp_path / "local", world_size=2, watchdog={}, **LORA)
    done = run_stage(local)
    assert done.returncode == 0, done.stderr[-3000:]

    folder = cluster_project(data, tmp_path / "slurm")
    stage, log = start_stage(folder, slurm_cluster)
    err = finish(stage, log)
    assert stage.returncode == 0, err[-4000:]

    m = json.loads((folder / "metrics/train.json").read_text())
    job = m["cluster"]
    assert job["state"] == "COMPLETED" and job["nodes"] == ["node1", "node2"]
    assert {u["node"] for u in job["usage"]} == {"node1", "node2"}
    assert m["gpu_hours"] == job["gpu_hours"] > 0
    assert m["global_steps"] == 6 and m["world_size"] == 2
    # The job's output, streamed into the stage's log: both nodes' watchdogs and torchrun.
    assert f"job {job['job_id']} run 0 on node[1-2]" in err
    assert err.count("tuneloop watch: exit 0") == 2
    for node in ("node1", "node2"):
        watched = json.loads((Path(job["logs"]) / node / "watch.json").read_text())
        assert watched["exit_code"] == 0 and "torch.distributed.run" in watched["command"]

    merge = load_params(folder / "params.yaml").merge
    diff = (logits(folder) - logits(local)).abs().max().item()
    assert diff < merge.max_abs_logit_diff

    run = train_run(folder)
    assert run.info.status == "FINISHED"
    tags = run.data.tags
    assert tags["tuneloop.cluster.job_id"] == job["job_id"]
    assert tags["tuneloop.cluster.nodes"] == "node1,node2"
    assert tags["tuneloop.cluster.state"] == "COMPLETED"
    assert run.data.metrics["gpu_hours"] == job["gpu_hours"]
    assert run.data.metrics["cluster.gpu_hours.node2"] > 0
    assert "train_loss" in run.data.metrics  # rank 0 logged into the stage's run
    assert slurm_cluster.queue() == []


def test_a_launch_whose_ranks_disagree_with_the_packed_shards_is_refused_before_submitting(
    data: Path,
    tmp_path: Path,
    slurm_cluster: SlurmCluster,
) -> None:
    folder = cluster_project(data, tmp_path)
    shutil.rmtree(folder / "data/packed")
    shutil.copytree(data / "data/packed", folder / "data/packed")  # packed for one rank
    jobs_before = slurm_cluster.run("scontrol", "show", "job", "-o")
    stage, log = start_stage(folder, slurm_cluster)
    err = finish(stage, log, timeout=120)
    assert stage.returncode != 0
    assert "the Slurm launch was refused before submitting" in err
    assert "2 ranks, but data/packed holds 1 rank shards" in err
    assert slurm_cluster.run("scontrol", "show", "job", "-o") == jobs_before
    assert not (folder / "reports/watch").exists()


def test_a_job_cancelled_from_outside_fails_the_stage_naming_cancelled(
    data: Path,
    tmp_path: Path,
    slurm_cluster: SlurmCluster,
) -> None:
    folder = cluster_project(data, tmp_path, max_steps=2000, save_steps=1000)
    stage, log = start_stage(folder, slurm_cluster)
    job_id = started_job(slurm_cluster, log)  # running: how far the ranks got does not matter
    with pytest.MonkeyPatch.context() as patch:  # what `tuneloop status` prints first
        patch.chdir(folder)
        patch.setenv("SLURM_CONF", slurm_cluster.env["SLURM_CONF"])
        line = training_job_line(load_params(folder / "params.yaml"))
    assert line is not None and line.startswith(f"Slurm job {job_id} RUNNING on node1,node2")
    slurm_cluster.run("scancel", job_id)
    err = finish(stage, log, timeout=120)
    assert stage.returncode == 1
    assert f"train: Slurm job {job_id} ended CANCELLED on node1, node2; logs in " in err
    assert slurm_cluster.queue() == []
    assert train_run(folder).data.tags["tuneloop.cluster.state"] == "CANCELLED"
    assert not (folder / "models/adapter").exists()


def test_cancelling_the_flow_run_ends_the_stage_and_its_job(
    data: Path,
    tmp_path: Path,
    slurm_cluster: SlurmCluster,
) -> None:
    """What Prefect 3's runner does to a cancelled flow run: SIGTERM to the flow's process
    group (``_PosixProcessGroupTerminationScope``), SIGKILL after a grace. The flow's process,
    its ``dvc repro`` and the stage share that group; the stage cancels its job on SIGTERM,
    and the SIGKILL that follows (here at once) does not leave the job behind."""
    folder = cluster_project(data, tmp_path, max_steps=2000, save_steps=1000)
    # The parent shell waits for the stage, as the flow's process and dvc repro do.
    stage, log = start_stage(
        folder, slurm_cluster, "bash", "-c", '"$@"; exit $?', "parent", session=True
    )
    job_id = started_job(slurm_cluster, log)
    os.killpg(stage.pid, signal.SIGTERM)
    stage.wait()
    grace = time.monotonic() + PREFECT_KILL_GRACE_S
    while "ended CANCELLED" not in log.read_text() and time.monotonic() < grace:
        time.sleep(0.5)
    with contextlib.suppress(ProcessLookupError):  # the stage ended within the grace
        os.killpg(stage.pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while job_id in slurm_cluster.queue() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert slurm_cluster.queue() == []
    text = log.read_text()
    assert f"train: SIGTERM while waiting; cancelling Slurm job {job_id}" in text
    assert f"train: Slurm job {job_id} ended CANCELLED (the stage was interrupted)" in text


def test_a_requeued_job_resumes_from_its_last_checkpoint_and_ends_at_the_planned_step(
    data: Path,
    tmp_path: Path,
    slurm_cluster: SlurmCluster,
) -> None:
    """What a preemption or the time limit's USR1 does: Slurm requeues the job; the next run
    resumes from the newest checkpoint (train.resume: auto) while the stage keeps waiting."""
    from tuneloop.training import checkpoints

    folder = cluster_project(data, tmp_path, max_steps=30, save_steps=3)
    stage, log = start_stage(folder, slurm_cluster)
    job_id = training_job(slurm_cluster, log)
    phase = folder / "checkpoints/train/sft"
    deadline = time.monotonic() + 300
    while checkpoints.newest_complete(phase) is None and time.monotonic() < deadline:
        time.sleep(0.5)
    assert checkpoints.newest_complete(phase) is not None, log.read_text()[-3000:]
    slurm_cluster.run("scontrol", "requeue", job_id)
    wait_requeued(slurm_cluster, job_id)
    release(slurm_cluster, job_id)
    err = finish(stage, log)
    assert stage.returncode == 0, err[-4000:]
    assert f"job {job_id} run 1 on node[1-2]" in err
    m = json.loads((folder / "metrics/train.json").read_text())
    assert m["global_steps"] == 30
    resumed = m["phases"]["sft"]["resumed_from_step"]
    assert resumed is not None and resumed % 3 == 0 and 3 <= resumed < 30
    assert m["cluster"]["restarts"] == 1 and m["cluster"]["state"] == "COMPLETED"
    assert train_run(folder).info.status == "FINISHED"


def test_the_signal_before_the_time_limit_saves_that_step_then_the_job_requeues_and_resumes(
    data: Path,
    tmp_path: Path,
    slurm_cluster: SlurmCluster,
) -> None:
    """What Slurm does ``signal_before_end_s`` before the time limit (--signal=B:USR1), sent by
    hand as the ranks start, so that the run cannot end before it however fast they step: the
    ranks save the step they are at, far from any ``save_steps`` multiple, stop, and the batch
    shell requeues the job; the next run resumes from that step."""
    from tuneloop.training import checkpoints

    folder = cluster_project(data, tmp_path, max_steps=MAX_STEPS, save_steps=1000)
    stage, log = start_stage(folder, slurm_cluster)
    job_id = started_job(slurm_cluster, log)
    slurm_cluster.run("scancel", "--batch", "--signal=USR1", job_id)
    wait_requeued(slurm_cluster, job_id)
    (job,) = (p.parent for p in (folder / "reports/watch").glob("*/job.json"))
    (saved,) = job.glob(f"save-request-{job_id}-0.saved")
    step = json.loads(saved.read_text())["step"]
    assert 0 < step < MAX_STEPS and step % 1000 != 0
    assert checkpoints.is_complete(folder / f"checkpoints/train/sft/checkpoint-{step}")
    release(slurm_cluster, job_id)
    err = finish(stage, log)
    assert stage.returncode == 0, err[-4000:]
    assert f"saving step {step} and stopping" in err
    assert f"job {job_id} run 1 on node[1-2]" in err
    m = json.loads((folder / "metrics/train.json").read_text())
    assert m["global_steps"] == MAX_STEPS
    assert m["phases"]["sft"]["resumed_from_step"] == step
    assert m["cluster"]["restarts"] == 1 and m["cluster"]["state"] == "COMPLETED"
    assert train_run(folder).info.status == "FINISHED"
    assert slurm_cluster.queue() == []


def test_a_rank_that_stops_stepping_on_one_node_ends_the_job_with_86_and_its_stacks(
    data: Path,
    tmp_path: Path,
    slurm_cluster: SlurmCluster,
) -> None:
    """Rank 1's shard one micro-batch short: at the epoch's end rank 0 waits in a collective
    for ever. Its node's watchdog finds it silent, tells the other node's watchdog, and both
    write their ranks' stacks before either ends its ranks (else the other node's rank would
    die on the closed connection first, its stacks lost)."""
    folder = cluster_project(data, tmp_path, max_steps=-1, epochs=1, save_steps=1000)
    write_params(
        folder,
        {
            **yaml_params(folder),
            "watchdog": {"enabled": True, "deadlock_after_s": 10, "kill_grace_s": 5},
        },
    )
    shard = folder / "data/packed/rank-00001.parquet"
    table = pq.read_table(shard)
    pq.write_table(table.slice(0, table.num_rows - 1), shard)
    stage, log = start_stage(folder, slurm_cluster)
    err = finish(stage, log)
    assert stage.returncode == 86, err[-4000:]
    (submitted,) = (folder / "reports/watch").glob("*/job.json")
    job = submitted.parent
    watched = {n: json.loads((job / n / "watch.json").read_text()) for n in ("node1", "node2")}
    assert {n: w["exit_code"] for n, w in watched.items()} == {"node1": 86, "node2": 86}
    kinds = {n: w["alarm"]["kind"] for n, w in watched.items()}
    found = sorted(n for n, kind in kinds.items() if kind != "peer")
    assert found and all(kinds[n] == "deadlock" for n in found), kinds
    assert f"train: the watchdog on {', '.join(found)} found a hang and ended Slurm job" in err
    run = train_run(folder)
    assert run.info.status == "FAILED"
    client = MlflowClient(f"sqlite:///{folder / 'mlflow.db'}")
    for node in ("node1", "node2"):  # every node's ranks, blocked where they were
        assert "Thread " in (job / node / "stacks.txt").read_text(), node
        logged = {a.path for a in client.list_artifacts(run.info.run_id, f"watchdog/{node}")}
        assert f"watchdog/{node}/stacks.txt" in logged
    assert slurm_cluster.queue() == []
    assert not (folder / "models/adapter").exists()


def yaml_params(folder: Path) -> dict[str, Any]:
    """The project's params.yaml as written, to change one group of it."""
    import yaml

    data: dict[str, Any] = yaml.safe_load((folder / "params.yaml").read_text())
    return {group: data[group] for group in ("batch", "train", "cluster")}
