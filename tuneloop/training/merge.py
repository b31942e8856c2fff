"""Merge: fold a LoRA adapter into the weights it was trained on, and prove nothing changed.

The logic of stage ``merge`` (``stages/merge.py``). Equivalence gate: on probe prompts spread
over every eval suite, the merged model's logits must match the adapter model's within
``merge.max_abs_logit_diff``, on the prompts and on the adapter model's greedy answers, and at
every step of those answers it must choose the same token (``check``). Merge and check run in
float32 (host memory: 4 bytes a parameter); the result is cast to ``merge.dtype`` after the
check. A full fine-tune has nothing to merge: its folder is copied through (``pass_through``).
"""

from __future__ import annotations

import copy
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from peft import PeftModel
from pydantic import BaseModel, ConfigDict, Field, RootModel
from transformers import PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from tuneloop.judge import suites
from tuneloop.models import DTYPES, load_causal_lm, load_tokenizer
from tuneloop.params import Params
from tuneloop.tracking import init_from

MAX_NEW_TOKENS = 32
ADAPTER_CONFIG = "adapter_config.json"
WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin")
FULL_FINE_TUNE = "full fine-tune"
log = logging.getLogger(__name__)


class MergeMetrics(BaseModel):
    """``metrics/merge.json`` after a merge: how far the merged model's outputs are from the
    adapter model's on the probe prompts, and whether that is within the tolerance."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_abs_logit_diff: float = Field(
        description="the largest logit difference from the adapter model on the probes"
    )
    mean_abs_logit_diff: float = Field(description="the mean logit difference on the probes")
    max_rel_logit_diff: float = Field(
        description="max_abs_logit_diff / max_abs_logit: reads the same on models of any size"
    )
    max_abs_logit: float = Field(description="the adapter model's largest logit magnitude")
    identical_generations: float = Field(
        description="share of probes whose greedy answer the merged model chooses at every step"
    )
    probes: int = Field(description="probe prompts, spread over every eval suite")
    saved_dtype: str = Field(description="merge.dtype: what the merged model is saved in")
    tolerance: float = Field(description="merge.max_abs_logit_diff: the most allowed")
    passed: bool = Field(
        description="max_abs_logit_diff within tolerance and every greedy generation identical"
    )


class CopiedThrough(BaseModel):
    """``metrics/merge.json`` of a full fine-tune: a whole model, copied, with nothing to merge."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    skipped: str = Field(description='why nothing was merged: "full fine-tune"')
    probes: int = Field(default=0, description="probe prompts: none, nothing was compared")


class MergeFile(RootModel[MergeMetrics | CopiedThrough]):
    """``metrics/merge.json``, either kind, as ``read_model`` reads it."""


class NotEquivalent(RuntimeError):
    """The merged model differs from the adapter model past ``merge.max_abs_logit_diff``."""


def is_full_model(folder: Path) -> bool:
    """Whether ``folder`` holds a whole model (a full fine-tune) rather than a LoRA adapter."""
    if (folder / ADAPTER_CONFIG).exists():
        return False
    has_weights = any(any(folder.glob(pattern)) for pattern in WEIGHT_FILES)
    return (folder / "config.json").exists() and has_weights


def probe_questions(suites_root: Path, count: int) -> list[str]:
    """``count`` suite questions spread evenly over every suite (not just the first items).

    Spreading them reaches every suite and both answerable and refused items,
    so a merge that breaks one kind of answer shows up.
    """
    items = [question for _, question in suites.questions(suites_root)]
    if not items:
        raise FileNotFoundError(
            f"no eval suite items under {suites_root} (paths.eval_suites): the merge check "
            "runs on suite questions; add a suite (see eval/README.md)"
        )
    count = min(count, len(items))
    return [items[i * len(items) // count] for i in range(count)]


def probe_batch(tokenizer: PreTrainedTokenizerBase, questions: list[str]) -> dict[str, Any]:
    # A copy: padding settings stick to the fast tokenizer's backend, and the
    # original is saved with the merged model.
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.padding_side = "left"  # generation appends on the right of every row
    batch: Any = tokenizer.apply_chat_template(
        [[{"role": "user", "content": q}] for q in questions],
        add_generation_prompt=True,
        padding=True,
        return_tensors="pt",
        return_dict=True,
    )
    return dict(batch)


@dataclass(frozen=True)
class Answers:
    """The adapter model's greedy answers to the probes, as both models are read on them."""

    inputs: dict[str, torch.Tensor]
    prompt_length: int
    lengths: list[int]
    """each answer's tokens, up to and including its end-of-sequence token"""


@dataclass(frozen=True)
class Probed:
    """A model's outputs on the probes followed by the adapter model's greedy answers."""

    logits: torch.Tensor
    """float32 logits on the attended tokens: the prompt, then the answer up to its end"""
    choices: list[torch.Tensor]
    """per probe, the model's greedy choice at each step of the answer"""


@torch.no_grad()
def greedy_answers(model: Any, batch: dict[str, Any], pad_token_id: int | None) -> Answers:
    """The adapter model's greedy answers to the probes, ready for both models to read."""
    sequences = model.generate(
        **batch, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, pad_token_id=pad_token_id
    )
    prompt_length = batch["input_ids"].shape[1]
    answers = sequences[:, prompt_length:]
    eos = model.generation_config.eos_token_id
    ends = torch.tensor([] if eos is None else [eos] if isinstance(eos, int) else list(eos))
    lengths = []
    for row in answers:
        stops = torch.isin(row, ends).nonzero()
        lengths.append(int(stops[0]) + 1 if len(stops) else len(row))
    # What generate wrote after an answer ended is padding: masked, as the prompts' is.
    steps = torch.arange(answers.shape[1]).expand_as(answers)
    answered = (steps < torch.tensor(lengths).unsqueeze(1)).to(batch["attention_mask"].dtype)
    mask = torch.cat([batch["attention_mask"], answered], dim=1)
    # Positions as generate counts them: from each row's first token, not from its padding.
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    inputs = {"input_ids": sequences, "attention_mask": mask, "position_ids": positions}
    return Answers(inputs, prompt_length, lengths)


@torch.no_grad()
def probed(model: Any, answers: Answers) -> Probed:
    """One forward pass over the probes and their answers (teacher forcing): the logits, and
    the token the model chooses at each step of each answer.

    The same check as generating again, for one pass instead of one a token: a model that
    chooses the adapter model's token at every step of its greedy answer generates that
    answer. On a large model, in float32 on the host, that is most of the merge's time.
    """
    logits = model(**answers.inputs).logits.float()
    # Step k of an answer is chosen on the logits of the token before it.
    start = answers.prompt_length - 1
    choices = [
        logits[row, start : start + length].argmax(dim=-1)
        for row, length in enumerate(answers.lengths)
    ]
    return Probed(logits[answers.inputs["attention_mask"].bool()], choices)


def compare(reference: Probed, merged: Probed) -> dict[str, float]:
    """How far the merged model's outputs are from the adapter model's.

    ``max_rel_logit_diff`` is the largest difference over the largest logit magnitude: float32
    rounding grows with the logits' scale, so it reads the same on models of any size.
    """
    diff = (reference.logits - merged.logits).abs()
    pairs = zip(reference.choices, merged.choices, strict=True)
    same = [bool(torch.equal(ours, theirs)) for ours, theirs in pairs]
    largest = float(reference.logits.abs().max())
    return {
        "max_abs_logit_diff": float(diff.max()),
        "mean_abs_logit_diff": float(diff.mean()),
        "max_rel_logit_diff": float(diff.max()) / largest if largest > 0 else 0.0,
        "max_abs_logit": largest,
        "identical_generations": sum(same) / len(same),
    }


def load_adapter_model(params: Params) -> tuple[PeftModel, PreTrainedTokenizerBase]:
    tokenizer = load_tokenizer(params.paths.adapter)
    # float32 whatever merge.dtype says: a bf16 weight cannot hold a LoRA delta below
    # its last bit, so a bf16 merge loses part of the update, and the check would
    # measure that rounding (greedy choices flip on near-ties) instead of the merge.
    base = load_causal_lm(init_from.model_ref(params), "float32")
    model = PeftModel.from_pretrained(base, str(params.paths.adapter))
    model.eval()
    return model, tokenizer


def merge(params: Params) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, MergeMetrics]:
    """The merged model, its tokenizer, and how far its outputs are from the adapter model's
    (``passed``: within ``merge.max_abs_logit_diff``, every generation the same)."""
    model, tokenizer = load_adapter_model(params)
    questions = probe_questions(params.paths.eval_suites, params.merge.probes)
    batch = probe_batch(tokenizer, questions)
    # Before merging: merge_and_unload changes the base weights in place.
    answers = greedy_answers(model, batch, tokenizer.pad_token_id)
    reference = probed(model, answers)
    merged = model.merge_and_unload()
    compared = compare(reference, probed(merged, answers))
    tolerance = params.merge.max_abs_logit_diff
    metrics = MergeMetrics(
        **compared,
        probes=len(questions),
        saved_dtype=params.merge.dtype,
        tolerance=tolerance,
        passed=compared["max_abs_logit_diff"] <= tolerance
        and compared["identical_generations"] == 1.0,
    )
    log.info(
        "merge: logits differ by up to %.3g (mean %.3g; %.3g of the largest logit, %.3g) on %d "
        "probes, tolerance %g; greedy generations identical: %.0f%%",
        metrics.max_abs_logit_diff,
        metrics.mean_abs_logit_diff,
        metrics.max_rel_logit_diff,
        metrics.max_abs_logit,
        metrics.probes,
        tolerance,
        100 * metrics.identical_generations,
    )
    # Cast once, after the check: the saved checkpoint rounds like any bf16 checkpoint.
    return merged.to(DTYPES[params.merge.dtype]), tokenizer, metrics


def check(metrics: MergeMetrics, tolerance: float) -> None:
    """Raise :class:`NotEquivalent`, saying by how much, when the merge changed the model."""
    problems = []
    worst = metrics.max_abs_logit_diff
    if worst > tolerance:
        problems.append(
            f"logits differ by up to {worst:.3g} (mean {metrics.mean_abs_logit_diff:.3g}, "
            f"{metrics.max_rel_logit_diff:.3g} of the largest logit), "
            f"{worst / tolerance:.1f}x merge.max_abs_logit_diff={tolerance:g}"
        )
    if metrics.identical_generations < 1.0:
        differ = round((1 - metrics.identical_generations) * metrics.probes)
        problems.append(f"{differ} of {metrics.probes} greedy generations differ")
    if problems:
        raise NotEquivalent(
            "merge: the merged model is not equivalent to the adapter model: "
            + "; ".join(problems)
            + ". Check that the adapter was trained on this base (model.base)"
        )


def pass_through(adapter: Path, out: Path) -> CopiedThrough:
    """Copy a full fine-tune's model folder (all but train's manifest) into ``out``."""
    for item in adapter.iterdir():
        if item.name == "manifest.json":
            continue
        if item.is_dir():
            shutil.copytree(item, out / item.name)
        else:
            shutil.copy2(item, out / item.name)
    load_tokenizer(out)  # the merged folder must carry the chat template, as after a merge
    return CopiedThrough(skipped=FULL_FINE_TUNE)
