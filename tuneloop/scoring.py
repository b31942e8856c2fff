"""Scoring a model on the eval suites through lm-eval.

lm-eval's Hugging Face backend, or vLLM where it is installed and a GPU is present, so a
suite scores the same inside tuneloop and under ``lm_eval --include_path eval/``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager

from tuneloop.gate import Directions
from tuneloop.params import Params


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def backend(params: Params) -> str:
    """The lm-eval backend ``evaluate.backend`` asks for, resolved for this machine."""
    has_vllm = importlib.util.find_spec("vllm") is not None
    if params.evaluate.backend == "vllm" and not has_vllm:
        raise RuntimeError(
            "evaluate.backend=vllm but vllm is not installed in this environment; install it "
            "(it pins its own torch: see README) or set evaluate.backend to hf or auto"
        )
    if params.evaluate.backend == "auto":
        return "vllm" if has_vllm and _cuda() else "hf"
    return params.evaluate.backend


def model_args(kind: str, ref: str | Path) -> dict[str, Any]:
    if kind == "vllm":
        # dtype auto keeps an FP8 checkpoint in FP8; vLLM reads its compressed-tensors config.
        return {"pretrained": str(ref), "dtype": "auto", "gpu_memory_utilization": 0.8}
    # float32 on CPU (bf16 matmuls are slow there); the checkpoint's own dtype on a GPU.
    return {"pretrained": str(ref), "dtype": "auto" if _cuda() else "float32"}


def score(
    model_ref: str | Path, params: Params, tasks: TaskManager, kind: str = "hf"
) -> tuple[dict[str, dict[str, float]], Directions]:
    """Every metric of every suite for one model, and each metric's direction, from lm-eval."""
    results = simple_evaluate(
        model=kind,
        model_args=model_args(kind, model_ref),
        tasks=list(params.evaluate.suites),
        task_manager=tasks,
        apply_chat_template=True,
        batch_size=params.evaluate.batch_size,
        limit=params.evaluate.limit,
        device="cuda" if _cuda() else "cpu",
        log_samples=False,
    )
    if results is None:  # only on non-zero ranks of a distributed run, which this is not
        raise RuntimeError(f"evaluate: lm-eval returned no results for {model_ref}")
    per_suite: dict[str, dict[str, float]] = {}
    directions: Directions = {}
    for suite in params.evaluate.suites:
        raw = results["results"][suite]
        per_suite[suite] = {
            key.split(",")[0]: float(value)
            for key, value in raw.items()
            if "," in key and "_stderr" not in key and isinstance(value, int | float)
        }
        directions[suite] = dict(results.get("higher_is_better", {}).get(suite, {}))
    return per_suite, directions
