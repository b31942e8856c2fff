"""The cluster launchers' pure parts: params, the launch checks, the job script, accounting."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import TrainerControl, TrainerState

from tests.helpers import write_params
from tuneloop.cluster import slurm
from tuneloop.cluster.job import JobStatus, shell_words, usage_by_node
from tuneloop.cluster.submit import Interrupts, StageInterrupted, check_parent, failure, wait_for
from tuneloop.params import ParamsError, load_params
from tuneloop.preflight.launch import (
    check_launch,
    filesystem_type,
    shared_path_problems,
    world_size_problems,
)
from tuneloop.training.metrics import JobReport, NodeUsage
from tuneloop.training.preemption import SaveOnRequest

# The fast tier: no pipeline, server or rank.
pytestmark = pytest.mark.fast

TWO_NODES: dict[str, dict[str, Any]] = {
    "batch": {"world_size": 2, "micro_batch_size": 1, "effective_batch": 2},
    "train": {"method": "lora", "distributed": "ddp", "launcher": "slurm"},
    "cluster": {"nodes": 2, "gpus_per_node": 1, "env": {"NCCL_DEBUG": "INFO"}},
}


def two_nodes(tmp_path: Path, **cluster: object) -> Path:
    overrides = {**TWO_NODES, "cluster": {**TWO_NODES["cluster"], **cluster}}
    return write_params(tmp_path, overrides)


def test_nodes_times_gpus_must_be_the_world_size(tmp_path: Path) -> None:
    with pytest.raises(ParamsError, match=r"2 x 2 = 4, but batch.world_size .* is 2"):
        load_params(two_nodes(tmp_path, gpus_per_node=2))
    write_params(tmp_path, {**TWO_NODES, "train": {**TWO_NODES["train"], "distributed": "none"}})
    with pytest.raises(ParamsError, match=r"set train\.distributed"):
        load_params(tmp_path / "params.yaml")
    kube = {**TWO_NODES, "train": {**TWO_NODES["train"], "launcher": "kubernetes"}}
    with pytest.raises(ParamsError, match=r"set cluster\.image"):
        load_params(write_params(tmp_path, kube))
    with pytest.raises(ParamsError, match=r"cluster\.env"):
        load_params(two_nodes(tmp_path, env={"1BAD": "x"}))


def test_a_time_limit_written_back_unquoted_is_read_as_slurm_writes_it(tmp_path: Path) -> None:
    # `dvc exp run -S` rewrites params.yaml without quotes; YAML 1.1 reads 12:00:00 as 43200.
    path = two_nodes(tmp_path)
    text = path.read_text()
    assert "time_limit:" in text
    lines = [
        "  time_limit: 12:00:00" if line.strip().startswith("time_limit:") else line
        for line in text.splitlines()
    ]
    path.write_text("\n".join(lines) + "\n")
    assert load_params(path).cluster.time_limit == "12:00:00"


def test_the_launch_is_refused_when_the_shards_were_packed_for_other_ranks(
    tmp_path: Path,
) -> None:
    params = load_params(two_nodes(tmp_path))
    packed = tmp_path / params.paths.packed
    packed.mkdir(parents=True)
    (packed / "rank-00000.parquet").touch()
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path)
        (problem,) = world_size_problems(params)
        assert "2 ranks" in problem and "holds 1 rank shards" in problem
        (packed / "rank-00001.parquet").touch()
        assert world_size_problems(params) == []


def test_paths_on_a_local_disk_are_refused_for_nodes_elsewhere(tmp_path: Path) -> None:
    params = load_params(two_nodes(tmp_path))
    assert shared_path_problems(params, ["127.0.0.1", "localhost"], tmp_path) == []
    assert shared_path_problems(params, ["127.0.0.2", "127.0.0.3", "::1"], tmp_path) == []
    kind = filesystem_type(tmp_path)
    problems = shared_path_problems(params, ["10.0.0.1", "10.0.0.2"], tmp_path)
    if kind in ("nfs", "nfs4", "lustre"):  # a CI runner on shared storage
        assert problems == []
    else:
        assert len(problems) == 9 and f"on a {kind} filesystem" in problems[0]


def test_the_batch_script_runs_each_nodes_watchdog_around_its_torchrun(tmp_path: Path) -> None:
    params = load_params(two_nodes(tmp_path, partition="gpu", extra_args=["--qos=high"]))
    script = slurm.batch_script(params, tmp_path / "job", tmp_path, "/venv/bin/python")
    assert "#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=1\n" in script
    assert "#SBATCH --signal=B:USR1@300" in script and "#SBATCH --requeue" in script
    assert "#SBATCH --partition=gpu" in script and "#SBATCH --qos=high" in script
    assert "export NCCL_DEBUG=INFO" in script
    path = tmp_path / "job.sh"
    path.write_text(script)
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    (srun,) = [line for line in script.splitlines() if line.startswith("srun ")]
    # What the node's bash runs, with the node's own variables expanded there.
    inner = subprocess.run(
        ["bash", "-c", f"echo {srun.split(' bash -c ', 1)[1].removesuffix(' &')}"],
        capture_output=True,
        text=True,
        env={"SLURM_NODEID": "1", "SLURMD_NODENAME": "n2", "SLURM_JOB_ID": "7"}
        | {"TUNELOOP_RDZV_HOST": "10.0.0.1"},
    ).stdout
    assert inner.startswith("exec /venv/bin/python -m tuneloop.cli watch --deadlock-after=")
    assert f"--out-dir={tmp_path}/job/$SLURMD_NODENAME" in inner
    # The watchdogs of one run of the job share a folder, and know each other by Slurm's names.
    assert f'"--peers={tmp_path}/job/peers-$SLURM_JOB_ID-${{SLURM_RESTART_COUNT:-0}}"' in inner
    assert '"--node=$SLURMD_NODENAME"' in inner
    assert "-- /venv/bin/python -m torch.distributed.run --nnodes=2" in inner
    assert '"--node-rank=$SLURM_NODEID" --rdzv-backend=c10d' in inner
    assert '"--rdzv-endpoint=$TUNELOOP_RDZV_HOST:29500"' in inner
    assert inner.rstrip().endswith("--nproc-per-node=1 -m stages.train")


def test_the_signal_before_the_end_asks_the_ranks_to_save_then_requeues(tmp_path: Path) -> None:
    params = load_params(two_nodes(tmp_path, signal_before_end_s=120))
    script = slurm.batch_script(params, tmp_path / "job", tmp_path, "/venv/bin/python")
    lines = script.splitlines()
    request = f'export TUNELOOP_SAVE_REQUEST="{tmp_path}/job/save-request-$SLURM_JOB_ID-'
    assert any(line.startswith(request) for line in lines)
    start, end = lines.index("save_and_requeue() {"), lines.index("trap save_and_requeue USR1")
    trap = "\n".join(lines[start:end])
    # The request, a bounded wait for the step, then the requeue that ends whatever is left.
    assert (
        trap.index('touch "$TUNELOOP_SAVE_REQUEST"')
        < trap.index("-lt 90 ]")
        < trap.index('scontrol requeue "$SLURM_JOB_ID"')
    )
    assert '[ ! -e "$TUNELOOP_SAVE_REQUEST.saved" ]' in trap and "exit 0" in trap
    assert end < next(i for i, line in enumerate(lines) if line.startswith("srun "))
    assert slurm.save_wait_s(load_params(two_nodes(tmp_path, signal_before_end_s=10))) == 5


def test_a_second_signal_does_not_requeue_the_job_again(tmp_path: Path) -> None:
    # The trap itself, in bash, with `scontrol` recorded instead of run. A run of the Slurm
    # signal test once printed "requeueing" twice, and its requeued job ended FAILED: a
    # second USR1 ran the trap again. Without the trap's first line this prints it twice.
    params = load_params(two_nodes(tmp_path, signal_before_end_s=10))  # saves for 5 s
    request, calls = tmp_path / "request", tmp_path / "calls"
    harness = [
        "set -u",
        f"export TUNELOOP_SAVE_REQUEST={request}",
        # As Slurm's requeue does, the recorded one ends the step (which never saves): the
        # shell's `wait` then returns whether the trap ran during it or just before it.
        f'scontrol() {{ echo "$*" >> {calls}; kill "$step"; }}',
        *slurm.save_and_requeue_lines(params),
        "trap save_and_requeue USR1",
        "sleep 60 & step=$!",
        "echo ready",
        'wait "$step"',
    ]
    shell = subprocess.Popen(
        ["bash", "-c", "\n".join(harness)],
        env={**os.environ, "SLURM_JOB_ID": "7"},
        stdout=subprocess.PIPE,
        text=True,
    )
    assert shell.stdout is not None and shell.stdout.readline() == "ready\n"
    shell.send_signal(signal.SIGUSR1)
    # The second signal once the trap has begun (its first line out), while it waits 5 s
    # for the save.
    first = shell.stdout.readline()
    assert "the time limit nears" in first, first
    shell.send_signal(signal.SIGUSR1)
    out, _ = shell.communicate(timeout=60)
    out = first + out
    assert request.exists(), "the trap did not ask the ranks to save"
    assert out.count("requeueing") == 1, out
    assert calls.read_text().splitlines() == ["requeue 7"]


def test_a_save_request_saves_and_stops_at_the_next_step_once(tmp_path: Path) -> None:
    request = tmp_path / "save-request-7-0"
    callback = SaveOnRequest(request)
    args: Any = type("Args", (), {"device": torch.device("cpu")})()
    state, control = TrainerState(), TrainerControl()
    state.global_step = 3
    callback.on_step_end(args, state, control)
    assert not control.should_save and not control.should_training_stop
    request.touch()
    state.global_step = 4
    callback.on_step_end(args, state, control)
    assert control.should_save and control.should_training_stop and callback.step == 4
    state.global_step, control = 5, TrainerControl()
    callback.on_step_end(args, state, control)
    assert callback.step == 4 and not control.should_save


def test_a_stage_whose_parent_is_gone_stops_waiting() -> None:
    """A flow run cancelled by SIGTERM to its process alone: the flow stops ``dvc repro``,
    and the stage, orphaned, cancels its job at its next poll."""
    check_parent(os.getppid())
    with pytest.raises(StageInterrupted, match=r"the process that started the stage .* is gone"):
        check_parent(os.getppid() + 1)


RUNNING = JobStatus(job_id="7", state="RUNNING", nodes=("node1",))


class LibraryError(Exception):
    """What MLflow's client does with any exception raised inside its call."""


def test_a_signal_inside_a_library_call_is_raised_as_itself_at_the_next_poll() -> None:
    """Prefect's SIGTERM can land while the stage is inside MLflow (the tag of a new state),
    which wraps what the handler raises; the stage must still see SIGTERM, and cancel."""
    calls = []

    def status(job_id: str) -> JobStatus:
        calls.append(job_id)
        try:
            os.kill(os.getpid(), signal.SIGTERM)  # delivered here, inside the "library"
        except Exception as error:
            raise LibraryError(str(error)) from error
        return RUNNING

    with Interrupts().installed() as interrupts, pytest.raises(StageInterrupted) as raised:
        wait_for("7", status, lambda: None, poll_s=0.01, interrupts=interrupts)
    assert raised.value.signum == signal.SIGTERM and str(raised.value) == "SIGTERM"
    assert calls == ["7"]  # raised before the next poll, not after the job ended


def test_a_signal_during_the_sleep_between_polls_ends_the_wait_at_once() -> None:
    polls = []

    def status(job_id: str) -> JobStatus:
        polls.append(job_id)
        return RUNNING

    before = signal.getsignal(signal.SIGINT)  # ignored where the suite runs under nohup
    timer = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT))
    with Interrupts().installed() as interrupts, pytest.raises(StageInterrupted) as raised:
        timer.start()
        wait_for("7", status, lambda: None, poll_s=3600, interrupts=interrupts)
    assert raised.value.signum == signal.SIGINT and polls == ["7"]
    assert signal.getsignal(signal.SIGINT) is before  # put back


def test_gpu_hours_are_elapsed_times_gpus_per_node_over_every_run() -> None:
    usage = usage_by_node([(("a", "b"), 1800.0), (("b", "c"), 1800.0)], gpus_per_node=8)
    assert [(u.node, u.seconds, u.gpu_hours) for u in usage] == [
        ("a", 1800.0, 4.0),
        ("b", 3600.0, 8.0),
        ("c", 1800.0, 4.0),
    ]
    assert slurm.seconds("1-02:03:04") == 93784 and slurm.seconds("05:06") == 306


def test_a_failed_job_is_one_sentence_naming_state_node_and_logs() -> None:
    report = JobReport(
        launcher="slurm",
        job_id="12",
        state="NODE_FAIL",
        nodes=("n1", "n2"),
        restarts=0,
        elapsed_s=60,
        gpu_hours=0.1,
        usage=(NodeUsage(node="n1", seconds=60, gpus=1, gpu_hours=0.05),),
        logs="/shared/watch/x",
    )
    code, sentence = failure(report, {"n1": 0, "n2": 137})
    assert code == 1
    assert sentence.startswith("train: Slurm job 12 ended NODE_FAIL on n2; logs in /shared/watch/x")
    code, sentence = failure(report, {"n1": 86, "n2": 143})
    assert code == 86 and "the watchdog on n1 found a hang" in sentence
    code, sentence = failure(report, {"n1": 86, "n2": 86}, {"n1": "peer", "n2": "deadlock"})
    assert code == 86 and "the watchdog on n2 found a hang" in sentence
    assert "; n1 wrote its ranks' stacks and ended them too;" in sentence
    assert shell_words(["a b", "$X:1"]) == "'a b' \"$X:1\""


def test_preflight_checks_the_launch_so_dvc_repro_stops_before_train(tmp_path: Path) -> None:
    params = load_params(two_nodes(tmp_path))
    params = params.model_copy(
        update={"train": params.train.model_copy(update={"launcher": "kubernetes"})}
    )
    packed = tmp_path / params.paths.packed
    packed.mkdir(parents=True)
    (packed / "rank-00000.parquet").touch()
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path)
        refused = check_launch(params)
        assert refused.status == "fail" and "holds 1 rank shards" in refused.detail
        (packed / "rank-00001.parquet").touch()
        passed = check_launch(params)
        assert passed.status == "pass" and "2 node(s) x 1 = 2 ranks" in passed.detail
        local = params.model_copy(
            update={"train": params.train.model_copy(update={"launcher": "local"})}
        )
        assert check_launch(local).status == "skip"
