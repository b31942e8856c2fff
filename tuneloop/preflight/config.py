"""Preflight's config checks: learning rate, warm-up, LoRA shape, batch and epochs.

Each against the starting points of the field guide (``references/``): outside the usual band
warns, at a value that only a units mistake gives it fails.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from tuneloop.judge.verdict import Check, Status, worst
from tuneloop.params import BatchParams
from tuneloop.preflight.data import StepPlan


@dataclass(frozen=True)
class LrBand:
    low: float
    high: float
    absurd: float
    source: str


# Learning-rate starting points per (phase, method). Outside [low, high] warns (a tiny model
# from random init, like the demo's, wants more); at or above ``absurd`` the run diverges on
# any pretrained model, so it fails. A new method or phase adds its rows here.
_GUIDE = "references/b300-finetuning-guide"
LR_BANDS: dict[tuple[str, str], LrBand] = {
    ("sft", "lora"): LrBand(1e-4, 2e-4, 0.1, f"{_GUIDE}, LoRA"),
    ("sft", "qlora"): LrBand(1e-4, 2e-4, 0.1, f"{_GUIDE}, LoRA; QLoRA trains the same adapter"),
    ("sft", "full"): LrBand(1e-5, 2e-5, 1e-2, f"{_GUIDE}, full fine-tuning"),
    # DPO moves a model that already follows instructions: ~10x below SFT (TRL's default 1e-6
    # is a full-weight value).
    ("dpo", "lora"): LrBand(5e-6, 5e-5, 1e-2, "params.yaml, DPO with LoRA"),
    ("dpo", "qlora"): LrBand(5e-6, 5e-5, 1e-2, "params.yaml, DPO with LoRA"),
    ("dpo", "full"): LrBand(5e-7, 5e-6, 1e-3, "params.yaml, full-weight DPO; TRL default 1e-6"),
}
# Methods that train an adapter on a frozen base: checkpoints hold the adapter, not the model.
ADAPTER_METHODS = frozenset({"lora", "qlora"})
WARMUP_BAND = (0.03, 0.10)  # guide: warmup 3-10 %
WARMUP_ABSURD = 0.5  # half the run ramping up is a units mistake (steps given as a ratio)
LORA_RANK_BAND = (16, 64)  # guide: r = 16-64
LORA_ALPHA_RATIO_BAND = (1.0, 4.0)  # guide: alpha = 2 r
LORA_ALPHA_RATIO_ABSURD = 16.0  # the update scale is alpha / r: 16x the usual multiplies the LR
SAMPLES_PER_STEP_BAND = (64, 256)  # guide: effective batch 64-256 samples
EPOCH_BAND = (1.0, 3.0)  # guide: 1-3 epochs, watch val loss after the 2nd
EPOCHS_ABSURD = 10.0  # past this an SFT run memorises its data; usually steps given as epochs


# --- config checks ---------------------------------------------------------------------


def check_learning_rate(method: str, rates: Mapping[str, tuple[str, float]]) -> Check:
    """``rates``: phase -> (its param key, its learning rate), for each phase the run trains."""
    name = "learning_rate"
    statuses: list[Status] = []
    notes = []
    for phase, (key, rate) in rates.items():
        band = LR_BANDS.get((phase, method))
        if band is None:
            statuses.append("fail")
            notes.append(f"no learning-rate band for {phase} with {method}; add it to LR_BANDS")
            continue
        usual = f"usual {band.low:g}-{band.high:g} ({band.source})"
        if rate >= band.absurd:
            statuses.append("fail")
            notes.append(f"{key}={rate:g} >= {band.absurd:g} diverges ({usual})")
        elif not band.low <= rate <= band.high:
            statuses.append("warn")
            notes.append(
                f"{key}={rate:g} is outside the {usual}: fine for a tiny model from random "
                "init, otherwise expect a forgetful or unmoved model"
            )
        else:
            statuses.append("pass")
            notes.append(f"{key}={rate:g} within the {usual}")
    return Check(name, worst(statuses), "; ".join(notes))


def check_warmup(warmup_ratio: float, total_steps: int) -> Check:
    name = "warmup"
    steps = math.ceil(warmup_ratio * total_steps)
    shown = f"train.warmup_ratio={warmup_ratio:g} ({steps} of {total_steps} steps)"
    low, high = WARMUP_BAND
    if warmup_ratio >= WARMUP_ABSURD:
        return Check(name, "fail", f"{shown}: the learning rate would ramp for most of the run")
    if not low <= warmup_ratio <= high:
        return Check(name, "warn", f"{shown} is outside the usual {low:g}-{high:g}")
    return Check(name, "pass", shown)


def check_lora_shape(method: str, rank: int, alpha: int) -> Check:
    name = "lora_shape"
    if method not in ADAPTER_METHODS:
        return Check(name, "skip", f"method {method!r} trains no adapter")
    shown = f"train.lora_r={rank}, alpha={alpha} (alpha/r {alpha / rank:g})"
    if alpha <= 0 or alpha / rank >= LORA_ALPHA_RATIO_ABSURD:
        return Check(
            name,
            "fail",
            f"{shown}: the adapter's update is scaled by alpha/r, so this "
            f"{'freezes it' if alpha <= 0 else 'multiplies the learning rate'}; "
            "usual alpha = 2 x r (leave train.lora_alpha null)",
        )
    ratio_low, ratio_high = LORA_ALPHA_RATIO_BAND
    rank_low, rank_high = LORA_RANK_BAND
    notes = []
    if not ratio_low <= alpha / rank <= ratio_high:
        notes.append(f"alpha/r outside the usual {ratio_low:g}-{ratio_high:g} (guide: 2)")
    if not rank_low <= rank <= rank_high:
        notes.append(f"r outside the guide's {rank_low}-{rank_high}")
    if notes:
        return Check(name, "warn", f"{shown}: {'; '.join(notes)}")
    return Check(name, "pass", shown)


def check_effective_batch(batch: BatchParams, plan: StepPlan) -> Check:
    name = "effective_batch"
    shown = (
        f"batch.effective_batch={batch.effective_batch} bins x "
        f"{plan.samples_per_step / batch.effective_batch if batch.effective_batch else 0:.1f} "
        f"samples per bin = {plan.samples_per_step:.0f} samples per optimizer step"
    )
    if plan.steps_per_epoch == 0:
        return Check(
            name, "fail", f"{shown}, but the shards give no whole optimizer step; add data"
        )
    low, high = SAMPLES_PER_STEP_BAND
    if not low <= plan.samples_per_step <= high:
        return Check(
            name,
            "warn",
            f"{shown}, outside the usual {low}-{high} (guide); raise or lower "
            "batch.effective_batch (gradient accumulation follows)",
        )
    return Check(name, "pass", shown)


def check_epochs(epochs: float, max_steps: int, plan: StepPlan) -> Check:
    name = "epochs"
    if not plan.steps_per_epoch:
        return Check(name, "skip", "the shards give no optimizer step (see effective_batch)")
    if max_steps > 0:
        shown = (
            f"train.max_steps={max_steps} = {plan.epochs:.2f} epochs of "
            f"{plan.steps_per_epoch} steps"
        )
    else:
        shown = f"train.epochs={epochs:g} = {plan.total_steps} optimizer steps"
    if plan.epochs > EPOCHS_ABSURD:
        return Check(
            name,
            "fail",
            f"{shown}: more than {EPOCHS_ABSURD:g} passes memorise the data (steps given as "
            "epochs?)",
        )
    low, high = EPOCH_BAND
    if not low <= plan.epochs <= high:
        return Check(
            name, "warn", f"{shown}, outside the usual {low:g}-{high:g}; watch the val loss"
        )
    return Check(name, "pass", shown)
