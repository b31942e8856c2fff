"""The train stage on the tiny model: each method, DPO after SFT, two processes, resume, stop-loss.

One module fixture builds the data once (base, ingest, clean, pack); each test trains a few
steps in a folder of its own. Runs that need their own process (torchrun, a SIGKILL) go
through ``python -m stages.train`` as ``dvc repro`` would start it.
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file

from stages import train
from tests.helpers import write_params
from tests.train_helpers import (  # noqa: F401
    FAST,
    data,
    make_project,
    run_stage,
    served,
    stage_env,
)
from tuneloop.params import load_params
from tuneloop.telemetry.trace import TraceError, read_trace
from tuneloop.telemetry.watch import WATCHDOG_EXIT_CODE
from tuneloop.training import checkpoints, methods
from tuneloop.training import run as train_run
from tuneloop.training.plan import Environment, resolve_plan

# The whole suite (`make test`): training, torchrun ranks, dvc repro
pytestmark = pytest.mark.slow

ADAPTER_FILES = {
    "adapter_config.json",
    "adapter_model.safetensors",
    "chat_template.jinja",
    "manifest.json",
    "tokenizer.json",
    "tokenizer_config.json",
}


def run_main(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(folder)
    train.main()


def metrics(folder: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((folder / "metrics/train.json").read_text())
    return data


def train_runs(folder: Path) -> list[Any]:
    client = MlflowClient(f"sqlite:///{folder / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("tuneloop")
    assert experiment is not None
    runs = client.search_runs([experiment.experiment_id])
    return [r for r in runs if r.data.tags.get("tuneloop.stage") == "train@support"]


@pytest.fixture
def watch_training(monkeypatch: pytest.MonkeyPatch) -> dict[str, dict[str, Any]]:
    """Snapshots of every parameter before and after each trainer's train(), by trainer class."""
    seen: dict[str, dict[str, Any]] = {}

    def spy(original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
            named = dict(self.model.named_parameters())
            before = {n: p.detach().clone() for n, p in named.items()}
            output = original(self, *args, **kwargs)
            seen[type(self).__name__] = {
                "before": before,
                "after": {n: p.detach().clone() for n, p in self.model.named_parameters()},
                "trainable": {n for n, p in named.items() if p.requires_grad},
            }
            return output

        return wrapped

    for cls in (methods.PackedSFTTrainer, methods.MeteredDPOTrainer):
        monkeypatch.setattr(cls, "train", spy(cls.train))
    return seen


def changed(run: dict[str, Any]) -> set[str]:
    return {n for n in run["before"] if not torch.equal(run["before"][n], run["after"][n])}


def test_lora_trains_every_adapter_weight_and_nothing_else(
    data: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    watch_training: dict[str, dict[str, Any]],
) -> None:
    folder = make_project(data, tmp_path)
    monkeypatch.setenv("TUNELOOP_HEARTBEAT", str(tmp_path / "heartbeat.json"))
    run_main(folder, monkeypatch)

    run = watch_training["PackedSFTTrainer"]
    moved = changed(run)
    assert run["trainable"] and all("lora_" in n for n in run["trainable"])
    assert moved == run["trainable"]  # every adapter weight moved, no base weight did
    out = folder / "models/adapter"
    assert {p.name for p in out.iterdir()} >= ADAPTER_FILES
    assert all("lora_" in name for name in load_file(out / "adapter_model.safetensors"))
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["artifact"] == "adapter" and manifest["plan"]["precision"] == "fp32"
    m = metrics(folder)
    assert m["global_steps"] == 6 and m["tokens_per_second"] > 0 and m["gpu_hours"] == 0
    assert m["phases"]["sft"]["best_step"] in (3, 6)  # the best checkpoint is the output
    assert json.loads((tmp_path / "heartbeat.json").read_text())["step"] == 6
    (stage_run,) = train_runs(folder)
    assert {"loss", "learning_rate", "grad_norm", "tokens_per_second", "gpu_hours"} <= set(
        stage_run.data.metrics
    )
    assert stage_run.data.params["plan.method"] == "lora"


def test_full_trains_every_weight_and_saves_a_whole_model(
    data: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    watch_training: dict[str, dict[str, Any]],
) -> None:
    from transformers import AutoModelForCausalLM

    folder = make_project(data, tmp_path, method="full", max_steps=3)
    run_main(folder, monkeypatch)

    run = watch_training["PackedSFTTrainer"]
    moved = changed(run)
    assert run["trainable"] == set(run["before"]) and moved == run["trainable"]
    model = AutoModelForCausalLM.from_pretrained(folder / "models/adapter")
    base_weights = AutoModelForCausalLM.from_pretrained(folder / "models/base").state_dict()
    assert all(not torch.equal(t, base_weights[n]) for n, t in model.state_dict().items())
    assert json.loads((folder / "models/adapter/manifest.json").read_text())["artifact"] == "model"
    # Saved for inference: the Trainer's use_cache=False would make it generate without a cache.
    assert json.loads((folder / "models/adapter/config.json").read_text())["use_cache"] is True


def test_dpo_after_sft_refines_the_sft_adapter(
    data: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    watch_training: dict[str, dict[str, Any]],
) -> None:
    folder = make_project(data, tmp_path, phases=["sft", "dpo"], max_steps=3, dpo_max_steps=3)
    run_main(folder, monkeypatch)

    sft, dpo = watch_training["PackedSFTTrainer"], watch_training["MeteredDPOTrainer"]
    # DPO starts from SFT's result and moves every weight of the trained adapter.
    trained = {n for n in dpo["trainable"] if ".default." in n}
    assert trained == dpo["trainable"]
    moved = changed(dpo)
    assert moved == trained
    for name in trained:
        assert torch.equal(dpo["before"][name], sft["after"][name])
    out = folder / "models/adapter"
    assert {p.name for p in out.iterdir()} >= ADAPTER_FILES
    assert not (out / "ref").exists()  # TRL's frozen reference copy stays out of the result
    m = metrics(folder)
    assert set(m["phases"]) == {"sft", "dpo"} and m["phases"]["dpo"]["global_steps"] == 3
    runs = {r.info.run_name: r for r in train_runs(folder)}
    assert set(runs) == {"train@support", "train@support/dpo"}
    dpo_run = runs["train@support/dpo"]
    assert dpo_run.data.tags["mlflow.parentRunId"] == runs["train@support"].info.run_id
    assert "rewards/accuracies" in dpo_run.data.metrics


def test_early_stopping_and_the_best_checkpoint_follow_the_params(
    data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import EarlyStoppingCallback

    folder = make_project(data, tmp_path, early_stopping_patience=2)
    monkeypatch.chdir(folder)
    params = load_params()
    planned = resolve_plan(params, Environment.probe())
    args = train_run.phase_args("sft", params, planned)
    built = train_run.build_trainer("sft", args, params, planned, None, 0, time.time())
    stoppers = [
        c for c in built.trainer.callback_handler.callbacks if isinstance(c, EarlyStoppingCallback)
    ]
    assert [s.early_stopping_patience for s in stoppers] == [2]
    # Evaluated whenever saved, the best by validation loss reloaded as the phase's result.
    assert args.load_best_model_at_end and args.eval_steps == args.save_steps == 3
    assert args.metric_for_best_model == "eval_loss" and not args.greater_is_better


def test_qlora_on_a_machine_without_cuda_fails_at_start(
    data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    folder = make_project(data, tmp_path, method="qlora")
    with pytest.raises(SystemExit, match=r"(?s)cannot start.*qlora.*needs a CUDA GPU"):
        run_main(folder, monkeypatch)
    assert not (folder / "checkpoints").exists() and not (folder / "models/adapter").exists()


def plant_bad_batches(shard: Path, count: int, vocab_size: int) -> None:
    """Random labels on ``count`` bins: a corrupted export, far harder than anything learned."""
    rows = pq.read_table(shard).to_pylist()
    rng = random.Random(0)
    for i in rng.sample(range(len(rows)), count):
        rows[i]["labels"] = [rng.randrange(vocab_size) for _ in rows[i]["labels"]]
    pq.write_table(pa.Table.from_pylist(rows, schema=pq.read_schema(shard)), shard)


def test_loss_spike_on_a_planted_bad_batch_stops_marks_and_alerts(
    data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = make_project(
        data,
        tmp_path,
        method="full",  # learns fast enough on the tiny model for a bad batch to stand out
        max_steps=60,
        save_steps=100,
        # Per-character Chinese tokens: the learned loss is ~3.5 by step 40, a planted batch ~9;
        # the steps between vary by at most 1.3x their running median.
        loss_spike_factor=2.0,
        loss_spike_window=5,
        alert_command='echo "$TUNELOOP_ALERT_REASON" > alert.txt',
    )
    plant_bad_batches(folder / "data/packed/rank-00000.parquet", 10, vocab_size=2048)
    with pytest.raises(SystemExit, match=r"stopped at step \d+ by train.loss_spike_factor"):
        run_main(folder, monkeypatch)

    (run,) = train_runs(folder)
    assert run.info.status == "FAILED"
    assert run.data.tags["tuneloop.train.stop_rule"] == "loss_spike_factor"
    step = int(run.data.metrics["stop_step"])
    assert 5 < step < 60 and f"step {step}" in (folder / "alert.txt").read_text()
    assert "tokens_per_second" in run.data.metrics and "gpu_hours" in run.data.metrics
    assert not (folder / "models/adapter").exists()  # no output for DVC to record


def test_a_hung_rank_is_ended_then_a_rerun_trains_on_two_shards_and_keeps_the_evidence(
    data: Path, tmp_path: Path, served: Path
) -> None:
    """Rank 1 one micro-batch short, a whole epoch: rank 0's extra step waits forever.

    gloo would wait 30 minutes; the watchdog the stage started beside itself ends it. The
    rerun (shards fixed, other params: it starts afresh and clears its checkpoints) trains
    two gloo processes each on its own shard, and leaves the hung run's evidence as it was.
    Both runs are served, as under the retrain flow: the job the watcher starts is a fork of
    it, which then runs torchrun.
    """
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    deadlock_after_s = 10.0
    folder = make_project(
        data,
        tmp_path,
        world_size=2,
        watchdog={"deadlock_after_s": deadlock_after_s, "kill_grace_s": 5},
        distributed="ddp",
        max_steps=-1,
        epochs=1,
        save_steps=1000,
    )
    shard = folder / "data/packed/rank-00001.parquet"
    table = pq.read_table(shard)
    pq.write_table(table.slice(0, table.num_rows - 1), shard)
    paths = load_params(folder / "params.yaml").paths
    client = MlflowClient(f"sqlite:///{folder / 'mlflow.db'}")

    started = time.monotonic()
    done = run_stage(folder)
    elapsed = time.monotonic() - started
    assert done.returncode == WATCHDOG_EXIT_CODE, done.stderr[-3000:]
    assert "job started warm" in done.stderr
    (verdict,) = (folder / paths.watch).glob("*/watch.json")
    hung = verdict.parent
    watched = json.loads(verdict.read_text())
    alarm = watched["alarm"]
    assert alarm["kind"] == "deadlock"
    last_sign_of_life = alarm["t"] - alarm["quiet_s"]
    assert watched["job_ended_at"] - last_sign_of_life < deadlock_after_s + 15
    # The shipped bands are estimates; without a GPU no bands are in use at all.
    bands = "estimate" if watched["devices"] else "none"
    assert watched["calibration_source"] == bands
    assert (hung / "stacks.txt").stat().st_size > 0
    # The trace the watcher wrote while the job set up its checkpoints is still there, whole.
    trace = read_trace(hung / "trace.csv")
    assert max(t.heartbeat.step or 0 for t in trace.ticks if t.heartbeat) == alarm["last_step"]
    assert elapsed < 600
    (failed,) = train_runs(folder)
    assert failed.info.status == "FAILED"
    assert "no training step" in failed.data.tags["tuneloop.watchdog.reason"]
    assert failed.data.tags["tuneloop.watchdog.calibration_source"] == bands
    logged = {a.path for a in client.list_artifacts(failed.info.run_id, "watchdog")}
    assert {"watchdog/trace.csv", "watchdog/timeline.png", "watchdog/stacks.txt"} <= logged
    assert not (folder / "models/adapter").exists()
    evidence = {p.name: p.read_bytes() for p in hung.iterdir()}

    pq.write_table(table, shard)  # the packing fixed, as after a real hang
    batch = {"world_size": 2, "micro_batch_size": 1, "effective_batch": 2}
    write_params(
        folder,
        {"batch": batch, "train": {**FAST, "distributed": "ddp"}, "watchdog": {"enabled": True}},
    )
    done = run_stage(folder)  # no launcher around it: the stage re-execs under torchrun
    assert done.returncode == 0, done.stderr[-3000:]
    assert "starting afresh" in done.stderr and "job started warm" in done.stderr
    served_log = served.read_text()
    assert "runs cold" not in served_log
    assert len(re.findall(r"stages\.train: pid \d+ in ", served_log)) == 2, served_log
    m = metrics(folder)
    assert m["world_size"] == 2 and m["global_steps"] == 6
    shard_rows = pq.read_metadata(folder / "data/packed/rank-00001.parquet").num_rows
    # Six steps of one micro-batch each out of this rank's own shard; a re-split loader
    # would have halved the shard and doubled the epoch fraction.
    assert m["epochs"] == round(6 / shard_rows, 4)
    out = folder / "models/adapter"
    assert {p.name for p in out.iterdir()} >= ADAPTER_FILES
    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(folder / "models/base"), out
    )
    assert any("lora_B" in n and p.abs().sum() > 0 for n, p in model.named_parameters())
    (run,) = [r for r in train_runs(folder) if r.info.run_id != failed.info.run_id]
    assert run.info.status == "FINISHED"  # rank 0 alone logs
    # The stage ran beside its watchdog, which let it be and left its verdict beside the first.
    assert {p.name: p.read_bytes() for p in hung.iterdir()} == evidence
    (verdict,) = [v for v in (folder / paths.watch).glob("*/watch.json") if v.parent != hung]
    watched = json.loads(verdict.read_text())
    assert watched["alarm"] is None and watched["exit_code"] == 0
    assert watched["command"][-2:] == ["-m", "stages.train"]
    assert watched["mlflow_run_id"] == run.info.run_id  # named by the job's heartbeat
    logged = {a.path for a in client.list_artifacts(run.info.run_id, "watchdog")}
    assert {"watchdog/trace.csv", "watchdog/timeline.png", "watchdog/accounting.json"} <= logged


def test_sigkill_mid_run_then_rerun_continues_to_the_same_final_step(
    data: Path, tmp_path: Path
) -> None:
    # A learning rate at which the tiny model's loss visibly falls in four steps, so a resumed
    # run is told apart from a fresh one by its loss too.
    folder = make_project(
        data, tmp_path, watchdog={}, max_steps=16, save_steps=4, learning_rate=1.0e-2
    )
    paths = load_params(folder / "params.yaml").paths
    sft_dir = checkpoints.phase_folder(folder / paths.checkpoints, "sft")
    marker = checkpoints.checkpoint_dir(sft_dir, 4) / checkpoints.MARKER
    stage = subprocess.Popen(
        [sys.executable, "-m", "stages.train"],
        cwd=folder,
        env=stage_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:

        def traced() -> bool:
            """The watcher's live trace has rows: it sampled the job at least once."""
            for trace in (folder / paths.watch).glob("*/trace.csv"):
                try:
                    return bool(read_trace(trace).ticks)
                except TraceError:  # the header is still being written
                    return False
            return False

        deadline = time.monotonic() + 240
        while stage.poll() is None and time.monotonic() < deadline:
            if marker.exists() and traced():
                break
            time.sleep(0.05)
        # The watcher's live trace, written beside a job that has set up its checkpoints.
        (live,) = (folder / paths.watch).glob("*/trace.csv")
        stage.kill()  # SIGKILL: no handler runs, no clean-up
    finally:
        stage.wait(timeout=60)
    assert stage.returncode == -9, "the run ended before it could be killed"
    assert not (folder / "models/adapter").exists()
    killed_trace = live.read_bytes()
    assert read_trace(live).ticks  # rows, not only the header

    done = run_stage(folder)
    assert done.returncode == 0, done.stderr[-3000:]
    assert live.read_bytes() == killed_trace  # the rerun's watcher writes a folder of its own
    assert len(list((folder / paths.watch).glob("*/trace.csv"))) == 2
    sft = metrics(folder)["phases"]["sft"]
    assert sft["global_steps"] == 16 and sft["resumed_from_step"] >= 4
    # One run in MLflow, its loss curve whole: the rerun continued the run the kill cut off.
    (run,) = train_runs(folder)
    assert run.info.status == "FINISHED"
    history = MlflowClient(f"sqlite:///{folder / 'mlflow.db'}").get_metric_history(
        run.info.run_id, "loss"
    )
    steps = sorted({point.step for point in history})
    assert steps == list(range(1, 17))
    by_step = {point.step: point.value for point in history}
    # Picks up where it stopped, weights, optimizer, data order and RNG included: from the
    # resumed step on, its losses are an uninterrupted run's (per-step losses of one sample
    # each are too noisy to tell a resumed run from a fresh one by their size alone).
    straight = make_project(
        data, tmp_path / "straight", max_steps=16, save_steps=4, learning_rate=1.0e-2
    )
    assert run_stage(straight).returncode == 0
    (reference,) = train_runs(straight)
    expected = {
        point.step: point.value
        for point in MlflowClient(f"sqlite:///{straight / 'mlflow.db'}").get_metric_history(
            reference.info.run_id, "loss"
        )
    }
    after = range(sft["resumed_from_step"] + 1, 17)
    assert [by_step[s] for s in after] == pytest.approx([expected[s] for s in after], rel=1e-3)


@pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="needs 2 GPUs"
)
@pytest.mark.parametrize(("distributed", "method"), [("zero2", "lora"), ("zero3", "full")])
def test_deepspeed_two_processes_save_the_single_process_format(
    data: Path, tmp_path: Path, distributed: str, method: str
) -> None:
    # On a CPU the first launch compiles DeepSpeed's communication op; `make test` builds it first.
    folder = make_project(data, tmp_path, world_size=2, distributed=distributed, method=method)
    done = run_stage(folder)
    assert done.returncode == 0, done.stderr[-3000:]
    out = folder / "models/adapter"
    if method == "lora":
        assert {p.name for p in out.iterdir()} >= ADAPTER_FILES
    else:
        from transformers import AutoModelForCausalLM

        # ZeRO-3 gathers the sharded weights into one ordinary checkpoint for the save.
        model = AutoModelForCausalLM.from_pretrained(out)
        base_weights = AutoModelForCausalLM.from_pretrained(folder / "models/base").state_dict()
        assert all(not torch.equal(t, base_weights[n]) for n, t in model.state_dict().items())
    assert metrics(folder)["global_steps"] == 6
