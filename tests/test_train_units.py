"""The train stage's pure parts: the plan, shipped configs, stop-loss rules, checkpoints, loaders.

No training here; every test runs in well under a second.
"""

from __future__ import annotations

import ast
import json
import math
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.data_loader import BatchSamplerShard
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, TensorDataset
from transformers import TrainerControl, TrainerState

from tuneloop.io import write_json
from tuneloop.params import Params, ParamsError, load_params, parse_params
from tuneloop.tracking import init_from
from tuneloop.training import checkpoints, methods, plan
from tuneloop.training.plan import Environment, TrainSetupError, resolve_plan
from tuneloop.training.stoploss import (
    GB,
    StepMeter,
    StopLossCallback,
    StopRules,
    is_loss_spike,
)

# The fast tier: no pipeline, server or rank.
pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[1]

CPU = Environment(
    cuda=False,
    cuda_devices=0,
    bf16=False,
    flash_attn=False,
    bitsandbytes=False,
    deepspeed=False,
    launcher_world_size=None,
)
H100 = replace(CPU, cuda=True, cuda_devices=8, bf16=True, flash_attn=True, bitsandbytes=True)


def params(**train: Any) -> Params:
    data = yaml.safe_load((ROOT / "params.yaml").read_text())
    world_size = train.pop("world_size", 1)
    data["batch"].update(world_size=world_size, effective_batch=world_size)
    data["train"].update(train)
    return parse_params(data)


# --- the plan ---------------------------------------------------------------------------------


def test_qlora_without_cuda_fails_naming_the_reason_and_the_fix() -> None:
    with pytest.raises(TrainSetupError, match=r"train.method 'qlora'.*needs a CUDA GPU.*lora"):
        resolve_plan(params(method="qlora"), CPU)


def test_qlora_without_bitsandbytes_fails() -> None:
    with pytest.raises(TrainSetupError, match="bitsandbytes"):
        resolve_plan(params(method="qlora"), replace(H100, bitsandbytes=False))


def test_qlora_on_a_gpu_with_bitsandbytes_is_planned() -> None:
    planned = resolve_plan(params(method="qlora"), H100)
    assert planned.uses_lora and planned.precision == "bf16"


def test_gpu_gets_bf16_flash_attention_and_checkpointing() -> None:
    planned = resolve_plan(params(), H100)
    assert planned.precision == "bf16"
    assert planned.attn_implementation == "flash_attention_2"
    assert planned.gradient_checkpointing


def test_older_gpu_without_flash_attn_gets_fp16_and_sdpa() -> None:
    planned = resolve_plan(params(), replace(H100, bf16=False, flash_attn=False))
    assert planned.precision == "fp16" and planned.attn_implementation == "sdpa"


def test_cpu_gets_fp32_sdpa_and_no_checkpointing() -> None:
    planned = resolve_plan(params(), CPU)
    assert (planned.precision, planned.attn_implementation) == ("fp32", "sdpa")
    assert not planned.gradient_checkpointing and not planned.needs_launcher


@pytest.mark.parametrize(
    ("train", "env", "message"),
    [
        ({"world_size": 2}, CPU, r"train.distributed is 'none'"),
        ({"distributed": "ddp"}, CPU, r"nothing to share"),
        ({"distributed": "zero2", "world_size": 2}, CPU, r"needs DeepSpeed.*pip install"),
        ({"distributed": "fsdp", "world_size": 2}, CPU, r"fsdp' needs CUDA.*does not shard"),
        ({"distributed": "ddp", "world_size": 2}, replace(CPU, launcher_world_size=4), "4 proc"),
        ({"distributed": "ddp", "world_size": 16}, H100, r"needs 16 GPUs on this node"),
        (
            {"distributed": "ddp", "world_size": 2},
            replace(H100, accelerate_mode="deepspeed", launcher_world_size=2),
            r"accelerate launch was configured for deepspeed",
        ),
    ],
)
def test_impossible_runs_fail_before_any_work(
    train: dict[str, Any], env: Environment, message: str
) -> None:
    with pytest.raises(TrainSetupError, match=message):
        resolve_plan(params(**train), env)


def test_distributed_runs_relaunch_under_torchrun_unless_launched() -> None:
    ddp = params(distributed="ddp", world_size=2)
    assert resolve_plan(ddp, CPU).needs_launcher
    assert not resolve_plan(ddp, replace(CPU, launcher_world_size=2)).needs_launcher
    argv = plan.torchrun_argv(2)
    assert argv[1:4] == ["-m", "torch.distributed.run", "--standalone"]
    assert argv[-3:] == ["--nproc-per-node=2", "-m", "stages.train"]


def test_distributed_choice_picks_the_shipped_config() -> None:
    env = replace(H100, deepspeed=True)
    assert resolve_plan(params(distributed="zero2", world_size=2), env).deepspeed_config == (
        ROOT / "configs/deepspeed/zero2.json"
    )
    zero3 = resolve_plan(params(distributed="zero3", method="full", world_size=2), env)
    assert zero3.deepspeed_config == ROOT / "configs/deepspeed/zero3.json"
    fsdp = resolve_plan(params(distributed="fsdp", world_size=2), env)
    assert fsdp.fsdp_config == ROOT / "configs/fsdp/fsdp2.json" and fsdp.deepspeed_config is None


# --- params -----------------------------------------------------------------------------------


@pytest.mark.parametrize("phases", [["dpo", "sft"], ["sft", "sft"]])
def test_phases_run_sft_before_dpo_once_each(phases: list[str]) -> None:
    with pytest.raises(ParamsError, match=r"train.phases"):
        params(phases=phases)


def test_lora_targets_attention_and_mlp_with_alpha_from_the_rank() -> None:
    shipped = load_params(ROOT / "params.yaml")
    config = methods.lora_config(shipped)
    targets = set(config.target_modules or ())
    assert {"q_proj", "k_proj", "v_proj", "o_proj"} <= targets
    assert {"gate_proj", "up_proj", "down_proj"} <= targets
    assert shipped.train.lora_alpha is None and config.lora_alpha == 2 * config.r
    assert methods.lora_config(params(lora_alpha=8)).lora_alpha == 8


def test_target_modules_must_name_layers_of_the_model() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=32,
    )
    model = LlamaForCausalLM(config)
    methods.check_target_modules(model, params())  # the shipped list: every projection
    # peft would adapt q_proj and skip qkv_proj without a word.
    with pytest.raises(ValueError, match=r"\['qkv_proj'\] name no layer of LlamaForCausalLM.*"):
        methods.check_target_modules(model, params(target_modules=["q_proj", "qkv_proj"]))
    with pytest.raises(ValueError, match=r"'down_proj', 'gate_proj'.*\[all-linear\]"):
        methods.check_target_modules(model, params(target_modules=["c_attn"]))
    every_linear = params(target_modules=["all-linear"])
    methods.check_target_modules(model, every_linear)
    assert methods.lora_config(every_linear).target_modules == "all-linear"


def test_trainer_arguments_follow_the_params(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    planned = resolve_plan(params(), CPU)
    args = methods.sft_args(params(), planned, Path("/tmp/tuneloop-args"), has_val=True)
    assert args.lr_scheduler_type == "cosine" and args.warmup_steps == 0.03
    assert (args.save_steps, args.eval_steps) == (200, 200)  # aligned, for the best checkpoint
    assert args.load_best_model_at_end and args.metric_for_best_model == "eval_loss"
    assert not args.bf16 and not args.gradient_checkpointing
    assert args.report_to == ["mlflow"]
    dpo = methods.dpo_args(params(), planned, Path("/tmp/tuneloop-args"))
    assert dpo.beta == 0.1 and dpo.learning_rate == 3.0e-4


def test_only_rank_0_reports_to_mlflow(monkeypatch: pytest.MonkeyPatch) -> None:
    """The other ranks log nothing, and so never import MLflow (nor does the module)."""
    monkeypatch.setenv("RANK", "1")
    planned = resolve_plan(params(), CPU)
    assert methods.sft_args(params(), planned, Path("/tmp/tuneloop-args"), True).report_to == []
    assert methods.dpo_args(params(), planned, Path("/tmp/tuneloop-args")).report_to == []
    every_rank = ast.parse(Path(methods.__file__).with_name("run.py").read_text())
    at_the_top = {
        name
        for node in every_rank.body
        for name in (
            [alias.name for alias in node.names]
            if isinstance(node, ast.Import)
            else [node.module or ""]
            if isinstance(node, ast.ImportFrom)
            else []
        )
    }
    assert not {name for name in at_the_top if name.split(".")[0] == "mlflow"}


# --- shipped configs --------------------------------------------------------------------------


def test_every_shipped_config_loads_and_agrees_with_the_plan() -> None:
    for stage, path in plan.DEEPSPEED_CONFIGS.items():
        config = json.loads(path.read_text())
        assert config["zero_optimization"]["stage"] == int(stage[-1])
        # "auto": the Trainer fills batch sizes and accumulation from the params, once.
        assert config["train_micro_batch_size_per_gpu"] == "auto"
        assert config["gradient_accumulation_steps"] == "auto"
    zero3 = json.loads(plan.DEEPSPEED_CONFIGS["zero3"].read_text())
    assert zero3["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"]
    assert json.loads(plan.FSDP_CONFIG.read_text())["version"] == 2
    for name, kind in [("ddp", "MULTI_GPU"), ("zero2", "DEEPSPEED"), ("zero3", "DEEPSPEED")]:
        config = load_config_from_file(str(ROOT / "configs/accelerate" / f"{name}.yaml"))
        assert config.distributed_type == kind
        if kind == "DEEPSPEED":
            # The same file the stage passes to the Trainer: configured once.
            assert (
                ROOT / config.deepspeed_config["deepspeed_config_file"]
                == (plan.DEEPSPEED_CONFIGS[name])
            )
    fsdp = load_config_from_file(str(ROOT / "configs/accelerate/fsdp.yaml"))
    assert fsdp.distributed_type == "FSDP" and fsdp.fsdp_config["fsdp_version"] == 2


# --- stop-loss --------------------------------------------------------------------------------


def test_loss_spike_rule() -> None:
    history = [3.0, 2.9, 3.1, 2.8, 3.0]
    assert not is_loss_spike(history, 8.9, factor=3, window=5)
    assert is_loss_spike(history, 9.1, factor=3, window=5)
    assert not is_loss_spike(history[:4], 100.0, factor=3, window=5)  # window not full yet
    assert is_loss_spike(history, math.nan, factor=3, window=5)
    assert is_loss_spike([], math.inf, factor=3, window=5)


def run_steps(callback: StopLossCallback, losses: list[float]) -> TrainerControl:
    args: Any = type("Args", (), {"device": torch.device("cpu")})()
    state, control = TrainerState(), TrainerControl()
    for loss in losses:
        state.global_step += 1
        control.should_save = state.global_step % 2 == 0  # as DefaultFlowCallback might
        callback.meter.add(torch.tensor(loss), 10)
        callback.on_step_end(args, state, control)
        if control.should_training_stop:
            break
    return control


def test_spike_stops_without_saving_the_spiked_weights() -> None:
    rules = StopRules(spike_factor=3.0, spike_window=4)
    callback = StopLossCallback(rules, StepMeter(), started_at=time.time())
    control = run_steps(callback, [7.0, 5.0, 4.0, 3.5, 3.2, 3.0, 12.0, 2.9])
    assert callback.event is not None and callback.event.rule == "loss_spike_factor"
    assert callback.event.step == 7 and "step 7" in callback.event.detail
    assert control.should_training_stop and not control.should_save


def test_wall_budget_stops_and_saves_for_resume() -> None:
    rules = StopRules(max_wall_seconds=3600)
    callback = StopLossCallback(rules, StepMeter(), started_at=time.time() - 3601)
    control = run_steps(callback, [3.0])
    assert callback.event is not None and callback.event.rule == "max_wall_hours"
    assert control.should_training_stop and control.should_save


def test_memory_ceiling_stops() -> None:
    rules = StopRules(max_host_memory_bytes=0.001 * GB)  # any Python process holds more
    callback = StopLossCallback(rules, StepMeter(), started_at=time.time())
    run_steps(callback, [3.0])
    assert callback.event is not None and callback.event.rule == "max_host_memory_gb"


def test_no_rule_no_stop_and_rules_come_from_params() -> None:
    callback = StopLossCallback(StopRules(), StepMeter(), started_at=0.0)
    assert not run_steps(callback, [1.0, 100.0, math.nan]).should_training_stop
    rules = StopRules.from_params(
        params(max_wall_hours=2, max_gpu_memory_gb=70, loss_spike_factor=5.0).train, "sft"
    )
    assert rules.max_wall_seconds == 7200 and rules.max_gpu_memory_bytes == 70 * GB
    assert rules.spike_factor == 5.0
    assert StopRules.from_params(params().train, "dpo").spike_factor is None


def test_meter_sums_a_steps_micro_batches_and_counts_tokens() -> None:
    meter = StepMeter()
    meter.add(torch.tensor(0.5), 100)
    meter.add(torch.tensor(0.25), torch.tensor(50))
    loss = meter.pop_step_loss()
    assert loss is not None and float(loss) == 0.75 and meter.pop_step_loss() is None
    assert meter.tokens() == 150


# --- checkpoints ------------------------------------------------------------------------------


def make_checkpoint(phase_dir: Path, step: int, complete: bool) -> Path:
    folder = checkpoints.checkpoint_dir(phase_dir, step)
    folder.mkdir(parents=True)
    (folder / "optimizer.pt").write_bytes(b"x")
    if complete:
        checkpoints.mark_complete(folder, {"step": step})
    return folder


def test_newest_complete_checkpoint_skips_a_save_cut_short(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, 50, complete=True)
    make_checkpoint(tmp_path, 100, complete=True)
    make_checkpoint(tmp_path, 150, complete=False)  # killed mid-save
    assert checkpoints.newest_complete(tmp_path) == tmp_path / "checkpoint-100"
    assert checkpoints.prune_incomplete(tmp_path) == [tmp_path / "checkpoint-150"]
    assert [step for step, _ in checkpoints.checkpoints(tmp_path)] == [50, 100]


def test_checkpoint_names_are_the_trainers_and_parse_back() -> None:
    folder = checkpoints.checkpoint_dir(Path("sft"), 1200)
    assert folder == Path("sft/checkpoint-1200")
    assert checkpoints.checkpoint_step(folder) == 1200
    for other in ("final", "checkpoint-", "checkpoint-12a", "checkpoint-12.tmp", "xcheckpoint-1"):
        assert checkpoints.checkpoint_step(Path(other)) is None


def test_prepare_keeps_the_same_run_and_clears_another(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    record = checkpoints.RunRecord("fp-1", "hash-1")
    assert not checkpoints.prepare(root, record, resume=True).resumed
    make_checkpoint(root / "sft", 10, complete=True)
    make_checkpoint(root / "sft", 20, complete=False)
    kept = checkpoints.prepare(root, record, resume=True)
    assert kept.resumed and checkpoints.newest_complete(root / "sft") == root / "sft/checkpoint-10"
    assert not (root / "sft/checkpoint-20").exists()
    assert not checkpoints.prepare(root, record, resume=False).resumed
    make_checkpoint(root / "sft", 10, complete=True)
    make_checkpoint(root / "dpo", 5, complete=True)
    # Not the run's to clear: what someone else keeps beside the checkpoints.
    (root / "watch/20260101-000000").mkdir(parents=True)
    (root / "watch/20260101-000000/stacks.txt").write_text("=== pid 1\n")
    (root / "notes.txt").write_text("kept")
    other = checkpoints.prepare(root, checkpoints.RunRecord("fp-2", "hash-1"), resume=True)
    assert not other.resumed and "other params or data" in other.detail
    assert not (root / "sft").exists() and not (root / "dpo").exists()
    assert checkpoints.read_record(root) == checkpoints.RunRecord("fp-2", "hash-1")
    assert (root / "watch/20260101-000000/stacks.txt").read_text() == "=== pid 1\n"
    assert (root / "notes.txt").read_text() == "kept"


def test_fingerprint_ignores_how_a_run_is_watched_not_what_it_trains(tmp_path: Path) -> None:
    data = tmp_path / "packed"
    data.mkdir()
    (data / "manifest.json").write_text("{}")
    base = checkpoints.fingerprint(params(), {"packed": data})
    assert checkpoints.fingerprint(params(max_wall_hours=5, save_steps=7), {"packed": data}) == base
    assert checkpoints.fingerprint(params(learning_rate=1e-4), {"packed": data}) != base
    (data / "manifest.json").write_text('{"created_at": "later"}')
    assert checkpoints.fingerprint(params(), {"packed": data}) != base


def _resume_params(root: Path, local_base: bool = False, **train: Any) -> Params:
    data = yaml.safe_load((ROOT / "params.yaml").read_text())
    data["paths"].update(init=str(root / "init"), base_model=str(root / "base"))
    if local_base:
        data["model"]["base"] = str(root / "local")
    data["train"].update(train)
    return parse_params(data)


RESUME_CHANGES = [
    ("nothing", False),
    ("how the run is watched", False),
    ("a train param", True),
    ("the packed data", True),
    ("the champion it starts from", True),
    ("the champion's run", True),
    ("the base to the champion", True),
    ("the base stage's build", True),
    ("a local base's weights saved over it", True),
]


@pytest.mark.parametrize(("change", "misses"), RESUME_CHANGES, ids=[c for c, _ in RESUME_CHANGES])
def test_resume_key_covers_params_data_and_the_starting_weights(
    tmp_path: Path, change: str, misses: bool
) -> None:
    """Checkpoints resume only under the same key: a run continued from other weights (another
    champion, a rebuilt base) would mix two trainings in one model."""
    packed, base, init = tmp_path / "packed", tmp_path / "base", tmp_path / "init"
    for folder in (packed, base, init, tmp_path / "local"):
        folder.mkdir()
    weights = tmp_path / "local" / "model.safetensors"
    weights.write_bytes(b"month 1")
    local = change.startswith("a local base")
    (packed / "manifest.json").write_text("{}")
    (base / "manifest.json").write_text('{"created_at": "month 1"}')
    champion = init_from.Start("champion", "train.init_from is champion", "m", "3", "run-a")
    write_json(init / init_from.INIT_FILE, asdict(champion))
    before = checkpoints.fingerprint(_resume_params(tmp_path, local), {"packed": packed})
    train: dict[str, Any] = {}
    if change == "how the run is watched":
        train = {"max_wall_hours": 5, "save_steps": 7, "resume": "never"}
    elif change == "a train param":
        train = {"learning_rate": 1e-4}
    elif change == "the packed data":
        (packed / "manifest.json").write_text('{"created_at": "later"}')
    elif change == "the champion it starts from":
        write_json(init / init_from.INIT_FILE, asdict(replace(champion, version="4")))
    elif change == "the champion's run":  # the same version number in another registry
        write_json(init / init_from.INIT_FILE, asdict(replace(champion, run_id="run-b")))
    elif change == "the base to the champion":
        write_json(init / init_from.INIT_FILE, asdict(init_from.Start("base", "no champion")))
    elif change == "the base stage's build":  # model.tiny is no train param
        (base / "manifest.json").write_text('{"created_at": "month 2"}')
    elif local:  # the same name and size
        weights.write_bytes(b"month 2")
    after = checkpoints.fingerprint(_resume_params(tmp_path, local, **train), {"packed": packed})
    assert (after != before) == misses


def test_link_tree_leaves_the_marker_out(tmp_path: Path) -> None:
    source = make_checkpoint(tmp_path / "src", 1, complete=True)
    checkpoints.link_tree(source, tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["optimizer.pt"]


# --- data -------------------------------------------------------------------------------------


def test_each_rank_keeps_its_whole_shard() -> None:
    # What accelerate.prepare builds on rank 1 of 2: every other batch of the shard.
    sharded = BatchSamplerShard(
        BatchSampler(SequentialSampler(range(6)), batch_size=1, drop_last=False),
        num_processes=2,
        process_index=1,
    )
    loader: DataLoader[Any] = DataLoader(TensorDataset(torch.arange(6)), batch_sampler=sharded)
    assert len(loader) == 3
    methods.keep_rank_shard(loader)
    assert len(loader) == 6 and [int(batch[0]) for batch in loader] == list(range(6))


def test_dpo_pairs_become_conversational(tmp_path: Path) -> None:
    path = tmp_path / "dpo.jsonl"
    pair = {
        "id": "a",
        "prompt": [{"role": "user", "content": "hi"}],
        "chosen": "ok",
        "rejected": "no",
    }
    path.write_text(json.dumps(pair) + "\n")
    row = methods.dpo_pairs(path)[0]
    assert row["chosen"] == [{"role": "assistant", "content": "ok"}]
    assert row["prompt"] == pair["prompt"]
    path.write_text("")
    with pytest.raises(ValueError, match=r"remove dpo from train\.phases"):
        methods.dpo_pairs(path)
