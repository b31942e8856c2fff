"""Stage ``evaluate``: the business eval suites, every model side by side, and the gate.

Reads:  the base model, ``paths.merged`` (the candidate), ``paths.fp8`` (its
        export), the suites named in ``evaluate.suites`` under ``paths.eval_suites``.
Writes: ``metrics/evaluate.json`` (model -> suite -> metric), ``metrics/decision.json``
        (the verdict and every reason), ``reports/eval.md`` and ``reports/eval.png``.
Params: ``evaluate``, ``gate``, ``model.base``, ``paths``.

Scoring runs through lm-eval (its Hugging Face backend), so a suite scores the
same inside tuneloop and under ``lm_eval --include_path eval/``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import mlflow
from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager

from tuneloop.io import write_json, write_text
from tuneloop.models import base_model_ref
from tuneloop.params import Params, load_params
from tuneloop.stage import setup_logging, write_metrics
from tuneloop.tracking import stage_run

STAGE = "evaluate"
log = logging.getLogger(__name__)
Scores = dict[str, dict[str, dict[str, float]]]  # model -> suite -> metric -> value


def score(model_ref: str | Path, params: Params, tasks: TaskManager) -> dict[str, dict[str, float]]:
    """Every metric of every suite for one model, as lm-eval reports them."""
    results = simple_evaluate(
        model="hf",
        model_args={"pretrained": str(model_ref), "dtype": "float32"},
        tasks=list(params.evaluate.suites),
        task_manager=tasks,
        apply_chat_template=True,
        batch_size=params.evaluate.batch_size,
        limit=params.evaluate.limit,
        device="cuda" if _cuda() else "cpu",
        log_samples=False,
    )
    assert results is not None  # None only on non-zero ranks of a distributed run
    per_suite: dict[str, dict[str, float]] = {}
    for suite in params.evaluate.suites:
        raw = results["results"][suite]
        per_suite[suite] = {
            key.split(",")[0]: float(value)
            for key, value in raw.items()
            if "," in key and "_stderr" not in key and isinstance(value, int | float)
        }
    return per_suite


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def decide(scores: Scores, params: Params) -> dict[str, Any]:
    """The gate: the candidate must beat the base by ``gate.min_gain`` on the primary metric."""
    metric, reasons, passed = params.gate.primary_metric, [], True
    for suite in params.evaluate.suites:
        if metric not in scores["base"][suite]:
            raise SystemExit(
                f"evaluate: gate.primary_metric={metric!r} is not reported by suite {suite!r}; "
                f"it reports {sorted(scores['base'][suite])}"
            )
        base = scores["base"][suite][metric]
        candidate = scores["candidate"][suite][metric]
        gain = candidate - base
        ok = gain >= params.gate.min_gain
        passed &= ok
        reasons.append(
            f"{suite}: candidate {metric} {candidate:.3f} vs base {base:.3f} "
            f"(gain {gain:+.3f}, needs >= {params.gate.min_gain:+.3f}): {'pass' if ok else 'FAIL'}"
        )
    return {"passed": passed, "primary_metric": metric, "reasons": reasons}


def report(scores: Scores, decision: dict[str, Any]) -> str:
    models = list(scores)
    lines = ["# Evaluation", "", f"Gate: **{'PASS' if decision['passed'] else 'FAIL'}**", ""]
    lines += [f"- {reason}" for reason in decision["reasons"]]
    for suite in scores[models[0]]:
        metrics = sorted(scores[models[0]][suite])
        lines += ["", f"## {suite}", "", "| model | " + " | ".join(metrics) + " |"]
        lines.append("|---" * (len(metrics) + 1) + "|")
        base = scores["base"][suite]
        for model in models:
            cells = []
            for m in metrics:
                value = scores[model][suite][m]
                delta = "" if model == "base" else f" ({value - base[m]:+.3f})"
                cells.append(f"{value:.3f}{delta}")
            lines.append(f"| {model} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(scores: Scores, path: Path) -> None:
    suites = list(next(iter(scores.values())))
    fig, axes = plt.subplots(1, len(suites), figsize=(6 * len(suites), 4), squeeze=False)
    for ax, suite in zip(axes[0], suites, strict=True):
        metrics = sorted(scores["base"][suite])
        width = 0.8 / len(scores)
        for i, (model, per_suite) in enumerate(scores.items()):
            values = [per_suite[suite][m] for m in metrics]
            ax.bar([x + i * width for x in range(len(metrics))], values, width, label=model)
        ax.set_xticks([x + width * (len(scores) - 1) / 2 for x in range(len(metrics))], metrics)
        ax.set_ylim(0, 1)
        ax.set_title(suite)
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    setup_logging()
    params = load_params()
    with stage_run(STAGE, params):
        tasks = TaskManager(include_path=str(params.paths.eval_suites))
        models: dict[str, str | Path] = {
            "base": base_model_ref(params),
            "candidate": params.paths.merged,
            "candidate-fp8": params.paths.fp8,
        }
        scores: Scores = {}
        for name, ref in models.items():
            log.info("evaluate: scoring %s (%s)", name, ref)
            scores[name] = score(ref, params, tasks)
        decision = decide(scores, params)
        write_json(params.paths.metrics / "decision.json", decision)
        write_metrics(params, STAGE, scores)
        text = report(scores, decision)
        write_text(params.paths.reports / "eval.md", text)
        plot(scores, params.paths.reports / "eval.png")
        mlflow.log_artifact(str(params.paths.reports / "eval.md"))
        mlflow.log_artifact(str(params.paths.reports / "eval.png"))
        mlflow.set_tag("gate.passed", str(decision["passed"]).lower())
        log.info("evaluate:\n%s", text)


if __name__ == "__main__":
    main()
