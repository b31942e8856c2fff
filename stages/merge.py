"""Stage ``merge``: fold the LoRA adapter into the base weights, and prove nothing changed.

Reads:  ``paths.adapter``; the base model; eval suite questions (the probe set).
Writes: ``paths.merged`` (a standard Hugging Face folder with tokenizer and chat
        template, plus manifest.json); ``metrics/merge.json``.
Params: ``merge``, ``model.base``, ``paths``.

Equivalence gate: on the probe prompts the merged model's logits must match
the adapter model's within ``merge.max_abs_logit_diff`` and its greedy
generations must be identical; past that the stage fails and says by how much.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from peft import PeftModel
from transformers import PreTrainedModel

from tuneloop import lineage, suites
from tuneloop.io import atomic_dir, write_json
from tuneloop.models import base_model_ref, load_causal_lm, load_tokenizer
from tuneloop.params import Params, load_params
from tuneloop.stage import setup_logging, write_metrics
from tuneloop.tracking import stage_run

STAGE = "merge"
PROBES = 16
log = logging.getLogger(__name__)


def probe_batch(tokenizer: Any, questions: list[str]) -> dict[str, torch.Tensor]:
    tokenizer.padding_side = "left"
    return tokenizer.apply_chat_template(
        [[{"role": "user", "content": q}] for q in questions],
        add_generation_prompt=True,
        padding=True,
        return_tensors="pt",
        return_dict=True,
    )


@torch.no_grad()
def outputs(model: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits on the probes (where attended) and greedy continuations."""
    logits = model(**batch).logits.float()
    logits = logits[batch["attention_mask"].bool()]
    generated = model.generate(**batch, max_new_tokens=32, do_sample=False)
    return logits, generated[:, batch["input_ids"].shape[1] :]


def compare(
    adapter_out: tuple[torch.Tensor, torch.Tensor], merged_out: tuple[torch.Tensor, torch.Tensor]
) -> dict[str, float]:
    diff = (adapter_out[0] - merged_out[0]).abs()
    same = (adapter_out[1] == merged_out[1]).all(dim=1)
    return {
        "max_abs_logit_diff": float(diff.max()),
        "mean_abs_logit_diff": float(diff.mean()),
        "identical_generations": float(same.float().mean()),
    }


def merge(params: Params) -> tuple[PreTrainedModel, Any, dict[str, Any]]:
    ref = base_model_ref(params)
    tokenizer = load_tokenizer(params.paths.adapter)
    base = load_causal_lm(ref, params.merge.dtype)
    model = PeftModel.from_pretrained(base, str(params.paths.adapter))
    model.eval()
    questions = [q for _, q in suites.questions(params.paths.eval_suites)][:PROBES]
    batch = probe_batch(tokenizer, questions)
    adapter_out = outputs(model, batch)
    merged = model.merge_and_unload()
    metrics: dict[str, Any] = compare(adapter_out, outputs(merged, batch))
    metrics["probes"] = len(questions)
    return merged, tokenizer, metrics


def check(metrics: dict[str, Any], tolerance: float) -> None:
    problems = []
    if metrics["max_abs_logit_diff"] > tolerance:
        problems.append(
            f"logits differ by up to {metrics['max_abs_logit_diff']:.3g} "
            f"(> merge.max_abs_logit_diff={tolerance:g})"
        )
    if metrics["identical_generations"] < 1.0:
        problems.append(
            f"only {metrics['identical_generations']:.0%} of greedy generations are identical"
        )
    if problems:
        raise SystemExit(
            "merge: the merged model is not equivalent to the adapter: " + "; ".join(problems)
        )


def main() -> None:
    setup_logging()
    params = load_params()
    with stage_run(STAGE, params):
        merged, tokenizer, metrics = merge(params)
        write_metrics(params, STAGE, metrics)
        check(metrics, params.merge.max_abs_logit_diff)
        with atomic_dir(params.paths.merged) as out:
            merged.save_pretrained(out)
            tokenizer.save_pretrained(out)
            write_json(
                out / "manifest.json",
                lineage.manifest(
                    STAGE, params, inputs={"adapter": params.paths.adapter}, **metrics
                ),
            )
        log.info("merge: %s", metrics)


if __name__ == "__main__":
    main()
