"""Stage ``train``: supervised fine-tuning with TRL and a LoRA adapter from peft.

Reads:  ``paths.packed`` (this rank's shard and val.parquet); the base model.
Writes: ``paths.adapter`` (the adapter, the tokenizer and manifest.json);
        ``metrics/train.json`` (losses, steps, tokens/s, GPU-hours).
Params: ``train``, ``batch``, ``pack``, ``model.base``, ``paths``.

The data arrives packed and rank-balanced by ``pack`` and checked by
``preflight``; the trainer only reads it (no re-packing inside), through TRL's
padding-free collator, so the micro-batches preflight counted are the ones
that run. Loss, learning rate and grad-norm curves reach MLflow through the
transformers MLflow callback.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from peft import LoraConfig
from trl import SFTConfig, SFTTrainer

from tuneloop import lineage
from tuneloop.io import atomic_dir, write_json
from tuneloop.models import base_model_ref, load_causal_lm, load_tokenizer
from tuneloop.params import Params, load_params
from tuneloop.shards import VAL_SHARD, shard_name
from tuneloop.stage import setup_logging, write_metrics
from tuneloop.tracking import stage_run

STAGE = "train"
CHECKPOINTS = Path("checkpoints/train")
log = logging.getLogger(__name__)


def device_supports_bf16() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def training_config(params: Params, output_dir: Path, has_val: bool) -> SFTConfig:
    train, batch = params.train, params.batch
    on_gpu = torch.cuda.is_available()
    return SFTConfig(
        output_dir=str(output_dir),
        learning_rate=train.learning_rate,
        num_train_epochs=train.epochs,
        max_steps=train.max_steps,
        warmup_steps=train.warmup_ratio,  # a float below 1 is a ratio of the total steps
        lr_scheduler_type=train.lr_scheduler,
        weight_decay=train.weight_decay,
        per_device_train_batch_size=batch.micro_batch_size,
        per_device_eval_batch_size=batch.micro_batch_size,
        gradient_accumulation_steps=batch.gradient_accumulation_steps,
        # TRL defaults both on; on a CPU they only cost time (about 2.3x here).
        bf16=device_supports_bf16(),
        gradient_checkpointing=on_gpu,
        padding_free=True,
        max_length=None,  # bins are already cut to pack.seq_len
        dataset_kwargs={"skip_prepare_dataset": True},
        remove_unused_columns=False,  # the collator needs seq_lengths
        eval_strategy="epoch" if has_val else "no",
        save_strategy="no",
        logging_steps=train.logging_steps,
        report_to=["mlflow"],
        run_name=STAGE,
        seed=train.seed,
        data_seed=train.seed,
        dataloader_num_workers=0,
        use_cpu=not on_gpu,
    )


def lora_config(params: Params) -> LoraConfig:
    return LoraConfig(
        r=params.train.lora_r,
        lora_alpha=params.train.resolved_lora_alpha,
        lora_dropout=params.train.lora_dropout,
        target_modules=list(params.train.target_modules),
        task_type="CAUSAL_LM",
    )


def train(params: Params, adapter_dir: Path) -> dict[str, Any]:
    rank = 0
    shard = Dataset.from_parquet(str(params.paths.packed / shard_name(rank)))
    val_path = params.paths.packed / VAL_SHARD
    val = Dataset.from_parquet(str(val_path)) if val_path.exists() else None
    has_val = val is not None and len(val) > 0
    ref = base_model_ref(params)
    tokenizer = load_tokenizer(ref)
    model = load_causal_lm(ref)
    trainer = SFTTrainer(
        model=model,
        args=training_config(params, CHECKPOINTS, has_val),
        train_dataset=shard,
        eval_dataset=val if has_val else None,
        processing_class=tokenizer,
        peft_config=lora_config(params),
    )
    started = time.perf_counter()
    output = trainer.train()
    seconds = time.perf_counter() - started
    epochs = output.metrics.get("epoch", params.train.epochs)
    real_tokens = sum(sum(lengths) for lengths in shard["seq_lengths"])
    tokens = real_tokens * epochs * params.batch.world_size
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    eval_losses = [e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e]
    trained: Any = trainer.model  # the PeftModel wrapping the base
    trained.save_pretrained(adapter_dir)
    tokenizer.save_pretrained(adapter_dir)
    devices = max(torch.cuda.device_count(), 1) if torch.cuda.is_available() else 0
    metrics: dict[str, Any] = {
        "method": params.train.method,
        "train_loss": round(float(output.training_loss), 6),
        "first_logged_loss": losses[0] if losses else None,
        "last_logged_loss": losses[-1] if losses else None,
        "eval_loss": eval_losses[-1] if eval_losses else None,
        "global_steps": trainer.state.global_step,
        "epochs": epochs,
        "seconds": round(seconds, 2),
        "tokens_per_second": round(tokens / seconds, 1),
        "gpu_hours": round(devices * seconds / 3600, 6),
        "trainable_parameters": sum(p.numel() for p in trained.parameters() if p.requires_grad),
        "lora_alpha": params.train.resolved_lora_alpha,
        "gradient_accumulation_steps": params.batch.gradient_accumulation_steps,
    }
    return metrics


def main() -> None:
    setup_logging()
    params = load_params()
    with stage_run(STAGE, params):
        with atomic_dir(params.paths.adapter) as out:
            metrics = train(params, out)
            write_json(
                out / "manifest.json",
                lineage.manifest(
                    STAGE,
                    params,
                    inputs={"packed": params.paths.packed},
                    base=params.model.base,
                    **metrics,
                ),
            )
        write_metrics(params, STAGE, metrics)
        log.info("train: %s", metrics)


if __name__ == "__main__":
    main()
