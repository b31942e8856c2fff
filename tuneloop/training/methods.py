"""Models, methods and trainers: LoRA, QLoRA and full weights; SFT on packed shards; DPO.

``load_model`` loads what a phase trains: the base (16-bit, 4-bit for QLoRA, or 32-bit master
weights for full fine-tuning) or the previous phase's result. ``sft_args``/``dpo_args`` are the
Trainer arguments, one place for precision, schedule, checkpoints, evaluation and the
distributed config. ``PackedSFTTrainer`` trains on this rank's packed shard as pack wrote it,
and both trainers meter every step for the stop-loss rules.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from accelerate.data_loader import BatchSamplerShard
from datasets import Dataset
from peft import LoraConfig, PeftModel
from peft.utils import load_peft_weights, set_peft_model_state_dict
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, PreTrainedModel
from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

from tuneloop.data.shards import VAL_SHARD, shard_name
from tuneloop.io import read_jsonl
from tuneloop.params import Params
from tuneloop.training.plan import Rank, TrainPlan
from tuneloop.training.stoploss import StepMeter

log = logging.getLogger(__name__)


def _restore_on_indexed_cpu(storage: Any, location: str) -> Any:
    # Resuming a rank of a DDP run on CPUs, transformers 5.17 loads the optimizer state with
    # map_location=args.device, which is 'cpu:<rank>' there; torch 2.13 has no deserializer
    # for that location and the resume fails (a requeued Slurm job on the CPU test cluster).
    return storage if location.startswith("cpu:") else None


# After torch's own "cpu" (priority 10), before "cuda" (20); tags nothing when saving.
torch.serialization.register_package(11, lambda storage: None, _restore_on_indexed_cpu)

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_ADAPTER = "adapter_model.safetensors"
_TRAINED_ADAPTER = "default"  # peft's name for the adapter a config or folder creates
_REFERENCE_ADAPTER = "ref"  # TRL's name for DPO's frozen copy
ALL_LINEAR = "all-linear"  # peft's name for every Linear layer but the output head


def lora_config(params: Params) -> LoraConfig:
    """Attention and MLP projections by default (train.target_modules); alpha from the rank."""
    modules = params.train.target_modules
    return LoraConfig(
        r=params.train.lora_r,
        lora_alpha=params.train.resolved_lora_alpha,
        lora_dropout=params.train.lora_dropout,
        target_modules=ALL_LINEAR if modules == (ALL_LINEAR,) else list(modules),
        task_type="CAUSAL_LM",
    )


def check_target_modules(model: torch.nn.Module, params: Params) -> None:
    """Refuse a ``train.target_modules`` name that is no layer of ``model``.

    peft adapts the names it finds and skips the others without a word (it fails only when
    none matches): a Qwen3 list on a model that names its projections otherwise would train
    part of what was asked. The message lists the model's own Linear layer names.
    """
    modules = params.train.target_modules
    if modules == (ALL_LINEAR,):
        return
    names = {name.rpartition(".")[2] for name, _ in model.named_modules()}
    missing = [name for name in modules if name not in names]
    if missing:
        linear = sorted(
            {
                name.rpartition(".")[2]
                for name, module in model.named_modules()
                if isinstance(module, torch.nn.Linear)
            }
        )
        raise ValueError(
            f"train.target_modules {missing} name no layer of {type(model).__name__}; its "
            f"Linear layers are {linear}: list those, or set train.target_modules: "
            f"[{ALL_LINEAR}] (every Linear layer but the output head)"
        )


def _load_kwargs(plan: TrainPlan) -> dict[str, Any]:
    compute = _DTYPES[plan.precision]
    kwargs: dict[str, Any] = {"attn_implementation": plan.attn_implementation}
    if plan.method == "qlora":
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=compute,
            # Packed 4-bit weights stored in the compute dtype, so ZeRO-3 and FSDP can shard them.
            bnb_4bit_quant_storage=compute,
        )
        kwargs["dtype"] = compute
        if plan.distributed not in ("zero3", "fsdp"):
            kwargs["device_map"] = {"": torch.cuda.current_device()}
    elif plan.method == "full":
        # Trainable weights stay float32 (mixed precision computes in bf16); an optimizer on
        # bf16 weights loses small updates.
        kwargs["dtype"] = torch.float32
    else:
        # A frozen base can sit in the compute dtype; LoRA weights are kept in float32 by peft.
        kwargs["dtype"] = compute
    return kwargs


def load_model(ref: str | Path, plan: TrainPlan, adapter: Path | None = None) -> Any:
    """The model a phase trains: ``ref``'s weights, plus a trainable adapter when given.

    ``ref`` is the base, or for full fine-tuning the previous phase's result; ``adapter`` is the
    previous phase's LoRA adapter. Without ``adapter`` a LoRA phase gets its adapter from the
    trainer's ``peft_config``.
    """
    if plan.deepspeed_config is not None:
        import deepspeed  # only installed where the plan asks for it

        # ZeRO-3 partitions weights as from_pretrained creates them (zero.Init), sizing the
        # world from DeepSpeed's own comm layer. On a CPU accelerate starts torch.distributed
        # without it, and zero.Init would see a world of 1; this adopts the running group.
        deepspeed.init_distributed(dist_backend="nccl" if plan.cuda else "gloo")
    model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(str(ref), **_load_kwargs(plan))
    if adapter is None:
        return model
    return PeftModel.from_pretrained(model, str(adapter), is_trainable=True)


def _common_args(params: Params, plan: TrainPlan, output_dir: Path) -> dict[str, Any]:
    train, batch = params.train, params.batch
    args: dict[str, Any] = {
        "output_dir": str(output_dir),
        "lr_scheduler_type": train.lr_scheduler,
        "warmup_steps": train.warmup_ratio,  # a float below 1 is a ratio of the total steps
        "weight_decay": train.weight_decay,
        "per_device_train_batch_size": batch.micro_batch_size,
        "per_device_eval_batch_size": batch.micro_batch_size,
        "gradient_accumulation_steps": batch.gradient_accumulation_steps,
        # TRL defaults both on; on a CPU they only cost time (about 2.3x here).
        "bf16": plan.precision == "bf16",
        "fp16": plan.precision == "fp16",
        "gradient_checkpointing": plan.gradient_checkpointing,
        "save_strategy": "steps",
        "save_steps": train.save_steps,
        "save_total_limit": train.save_total_limit,
        "logging_steps": train.logging_steps,
        # Only rank 0 logs (transformers' MLflow callback does nothing on the others), so the
        # others never import MLflow: about 2 s of CPU at each rank's start.
        "report_to": ["mlflow"] if Rank.from_env().is_main else [],
        "seed": train.seed,
        # One seed on every rank: equal-length shards get the same permutation each epoch, so
        # the ranks' i-th micro-batches stay the near-equal-size bins pack put side by side.
        "data_seed": train.seed,
        "dataloader_num_workers": 0,
        "use_cpu": not plan.cuda,
        # LoRA leaves most weights frozen, full uses them all: no unused parameters to look for.
        "ddp_find_unused_parameters": False,
    }
    if plan.deepspeed_config is not None:
        args["deepspeed"] = str(plan.deepspeed_config)
    if plan.fsdp_config is not None:
        args["fsdp"] = "full_shard auto_wrap"
        args["fsdp_config"] = str(plan.fsdp_config)
    return args


def sft_args(params: Params, plan: TrainPlan, output_dir: Path, has_val: bool) -> SFTConfig:
    evaluation: dict[str, Any] = {"eval_strategy": "no"}
    if has_val:
        # Evaluate exactly when saving, so every checkpoint has a validation loss and the best
        # one can be kept and loaded as the phase's result.
        evaluation = {
            "eval_strategy": "steps",
            "eval_steps": params.train.save_steps,
            "load_best_model_at_end": True,
            "metric_for_best_model": "eval_loss",
            "greater_is_better": False,
        }
    return SFTConfig(
        **_common_args(params, plan, output_dir),
        **evaluation,
        run_name="train/sft",
        learning_rate=params.train.learning_rate,
        num_train_epochs=params.train.epochs,
        max_steps=params.train.max_steps,
        padding_free=True,
        max_length=None,  # bins are already cut to pack.seq_len
        dataset_kwargs={"skip_prepare_dataset": True},
        remove_unused_columns=False,  # the collator needs seq_lengths
    )


def dpo_args(params: Params, plan: TrainPlan, output_dir: Path) -> DPOConfig:
    return DPOConfig(
        **_common_args(params, plan, output_dir),
        eval_strategy="no",  # clean holds no validation pairs
        run_name="train/dpo",
        learning_rate=params.train.dpo_learning_rate,
        num_train_epochs=params.train.dpo_epochs,
        max_steps=params.train.dpo_max_steps,
        beta=params.train.dpo_beta,
        # Prompt and answer within the context the SFT data was packed for.
        max_length=params.pack.seq_len,
    )


def rank_shard(packed: Path, rank: int) -> Dataset:
    path = packed / shard_name(rank)
    if not path.exists():
        raise FileNotFoundError(
            f"{path} not found: pack writes one shard per rank of batch.world_size; "
            "rerun pack after changing batch.world_size"
        )
    return Dataset.from_parquet(str(path))


def val_set(packed: Path) -> Dataset | None:
    path = packed / VAL_SHARD
    if not path.exists():
        return None
    val = Dataset.from_parquet(str(path))
    return val if len(val) else None


def dpo_pairs(path: Path) -> Dataset:
    """clean's pairs in TRL's conversational preference format.

    clean writes the prompt as messages and each answer as text; TRL wants both sides as
    messages, so the chat template adds the same assistant markup it adds in SFT.
    """
    rows = [
        {
            "prompt": pair["prompt"],
            "chosen": [{"role": "assistant", "content": pair["chosen"]}],
            "rejected": [{"role": "assistant", "content": pair["rejected"]}],
        }
        for pair in read_jsonl(path)
    ]
    if not rows:
        raise ValueError(
            f"{path} holds no preference pairs, but train.phases includes dpo: "
            "remove dpo from train.phases or ingest badcases with corrections"
        )
    return Dataset.from_list(rows)


def keep_rank_shard(loader: DataLoader[Any]) -> DataLoader[Any]:
    """Undo accelerate's split of the training data: this rank's shard is its share already.

    ``accelerator.prepare`` wraps the batch sampler in ``BatchSamplerShard``, which would give
    each rank every world_size-th batch of its own shard. Neutralised the way the Trainer does
    it for its own rank-aware ``BatchRebalanceSampler``.
    """
    batch_sampler = getattr(loader, "batch_sampler", None)
    if isinstance(batch_sampler, BatchSamplerShard):
        batch_sampler.num_processes = 1
        batch_sampler.process_index = 0
    return loader


class PackedSFTTrainer(SFTTrainer):
    """TRL's SFT trainer on one rank's packed shard, each step metered for the stop-loss rules."""

    def __init__(self, *args: Any, meter: StepMeter, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.meter = meter

    def get_train_dataloader(self) -> DataLoader[Any]:
        loader = keep_rank_shard(super().get_train_dataloader())
        shard: Dataset = self.train_dataset
        micro_batches = len(shard) // self.args.per_device_train_batch_size
        if len(loader) != micro_batches:
            raise RuntimeError(
                f"the training loader yields {len(loader)} micro-batches but this rank's shard "
                f"holds {micro_batches}; the data loader was split again"
            )
        return loader

    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        loss: torch.Tensor = super().training_step(*args, **kwargs)
        inputs = args[1] if len(args) > 1 else kwargs["inputs"]
        # Padding-free: one row of real tokens, no padding to leave out.
        self.meter.add(loss, int(inputs["input_ids"].numel()))
        return loss


class MeteredDPOTrainer(DPOTrainer):
    """TRL's DPO trainer, each step metered for the token count and the stop-loss rules.

    On a LoRA model TRL keeps the reference as a frozen copy of the adapter, named "ref", and
    checkpoints save it in a sub-folder. Resuming, transformers then loads only the sub-folder
    adapters and leaves the trained "default" one at its starting point; this trainer loads
    it too. ``drop_reference_adapter`` keeps the copy out of the phase's result.
    """

    def __init__(self, *args: Any, meter: StepMeter, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.meter = meter

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        target = model if model is not None else self.model
        if isinstance(target, PeftModel) and (Path(resume_from_checkpoint) / _ADAPTER).is_file():
            weights = load_peft_weights(resume_from_checkpoint, device="cpu")
            set_peft_model_state_dict(target, weights, adapter_name=_TRAINED_ADAPTER)

    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        loss: torch.Tensor = super().training_step(*args, **kwargs)
        inputs = args[1] if len(args) > 1 else kwargs["inputs"]
        mask = inputs.get("attention_mask")
        # A tensor sum, not .item(): no wait for the device on every micro-batch.
        self.meter.add(loss, mask.sum() if mask is not None else int(inputs["input_ids"].numel()))
        return loss


def drop_reference_adapter(model: Any) -> None:
    """Remove TRL's frozen "ref" adapter so the result holds only the trained one."""
    if isinstance(model, PeftModel) and _REFERENCE_ADAPTER in model.peft_config:
        model.delete_adapter(_REFERENCE_ADAPTER)
        model.set_adapter(_TRAINED_ADAPTER)


def trainable_parameters(model: torch.nn.Module) -> int:
    # Under ZeRO-3 a parameter holds only this rank's slice; ds_numel is its full size.
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad)
