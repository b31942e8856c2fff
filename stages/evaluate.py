"""Stage ``evaluate``: the business eval suites, every model side by side, and the gate.

Reads:  the base model; the registry's ``champion`` (``tracking.registered_model``),
        when there is one; ``paths.merged`` (the candidate); ``paths.fp8`` (its
        export); the suites named in ``evaluate.suites`` under ``paths.eval_suites``.
Writes: ``metrics/evaluate.json`` (model -> suite -> metric), ``metrics/decision.json``
        (the verdict, every check with its numbers, and a reason for each, pass
        or fail), ``reports/eval.md`` and ``reports/eval.png``.
Params: ``evaluate``, ``gate``, ``model.base``, ``tracking.registered_model``, ``paths``.

Scoring runs through lm-eval (its Hugging Face backend, or vLLM where it is
installed and a GPU is present), so a suite scores the same inside tuneloop and
under ``lm_eval --include_path eval/``. Whether a metric is better higher or
lower comes from the suite's own ``higher_is_better``, as lm-eval reports it.

The gate (params ``gate``), on every suite:

- the candidate beats the base by ``min_gain`` on ``primary_metric``;
- the candidate is behind the champion by at most ``max_regression`` on every
  metric (skipped when the registry has no champion yet);
- the FP8 export is behind the candidate by at most ``fp8_max_drop`` on every metric.

The champion is scored here, on today's suites, from its registered merged
folder: numbers stored when it was registered may come from an older suite.
Registering a candidate that passed is the retrain flow's job (see
``tuneloop/registry.py`` for why it is not done in this stage).
"""

from __future__ import annotations

import importlib.util
import logging
import tempfile
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import mlflow
from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager

from tuneloop import registry
from tuneloop.io import write_json, write_text
from tuneloop.models import base_model_ref
from tuneloop.params import GateParams, Params, load_params
from tuneloop.stage import setup_logging, write_metrics
from tuneloop.tracking import stage_run

STAGE = "evaluate"
BASE, CHAMPION, CANDIDATE, FP8 = "base", "champion", "candidate", "candidate-fp8"
# Scores are means over items: float error must not turn a tie into a failure.
EPS = 1e-9
log = logging.getLogger(__name__)
Scores = dict[str, dict[str, dict[str, float]]]  # model -> suite -> metric -> value
Directions = dict[str, dict[str, bool]]  # suite -> metric -> higher is better


class GateError(ValueError):
    """The scores cannot be judged as configured (a metric or a direction is missing)."""


# --- scoring ----------------------------------------------------------------------------------


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


# --- the gate ---------------------------------------------------------------------------------


def _better_by(value: float, reference: float, higher_is_better: bool) -> float:
    """How much ``value`` is better than ``reference`` (negative: worse), in metric units."""
    return value - reference if higher_is_better else reference - value


def _direction(directions: Directions, suite: str, metric: str) -> bool:
    try:
        return directions[suite][metric]
    except KeyError:
        raise GateError(
            f"suite {suite!r} does not say whether {metric!r} is better higher or lower; add "
            f"`higher_is_better: true|false` to its entry in metric_list of {suite}.yaml"
        ) from None


def _check(
    rule: str,
    suite: str,
    metric: str,
    higher: bool,
    model: tuple[str, float],
    reference: tuple[str, float],
    delta: float,
    limit: float,
    passed: bool,
) -> dict[str, Any]:
    arrow = "higher is better" if higher else "lower is better"
    if rule == "beats_base":
        what = f"gain {delta:+.3f} (needs >= {limit:+.3f})"
    elif rule == "no_regression":
        what = f"behind by {delta:+.3f} (allowed <= {limit:.3f})"
    else:
        what = f"drop {delta:+.3f} (allowed <= {limit:.3f})"
    reason = (
        f"{suite}/{metric} ({arrow}): {model[0]} {model[1]:.3f} vs {reference[0]} "
        f"{reference[1]:.3f}: {what}: {'pass' if passed else 'FAIL'}"
    )
    return {
        "rule": rule,
        "suite": suite,
        "metric": metric,
        "higher_is_better": higher,
        "model": model[0],
        "value": model[1],
        "reference": reference[0],
        "reference_value": reference[1],
        "delta": round(delta, 6),
        "limit": limit,
        "passed": passed,
        "reason": reason,
    }


def decide(scores: Scores, directions: Directions, gate: GateParams) -> dict[str, Any]:
    """The gate's verdict on ``scores`` (``base``, ``candidate``, ``candidate-fp8``, maybe
    ``champion``), with every check it made and a reason for each, pass or fail."""
    for needed in (BASE, CANDIDATE, FP8):
        if needed not in scores:
            raise GateError(f"evaluate: no scores for {needed!r} (got {sorted(scores)})")
    metric = gate.primary_metric
    checks: list[dict[str, Any]] = []
    notes: list[str] = []
    for suite, candidate in sorted(scores[CANDIDATE].items()):
        if metric not in candidate:
            raise GateError(
                f"gate.primary_metric={metric!r} is not reported by suite {suite!r}; it reports "
                f"{sorted(candidate)}"
            )
        higher = _direction(directions, suite, metric)
        base = scores[BASE][suite][metric]
        gain = _better_by(candidate[metric], base, higher)
        checks.append(
            _check(
                "beats_base",
                suite,
                metric,
                higher,
                (CANDIDATE, candidate[metric]),
                (BASE, base),
                gain,
                gate.min_gain,
                gain >= gate.min_gain - EPS,
            )
        )
        for name in sorted(candidate):
            higher = _direction(directions, suite, name)
            value = candidate[name]
            if CHAMPION in scores:
                champion = scores[CHAMPION][suite][name]
                behind = _better_by(champion, value, higher)
                checks.append(
                    _check(
                        "no_regression",
                        suite,
                        name,
                        higher,
                        (CANDIDATE, value),
                        (CHAMPION, champion),
                        behind,
                        gate.max_regression,
                        behind <= gate.max_regression + EPS,
                    )
                )
            fp8 = scores[FP8][suite][name]
            drop = _better_by(value, fp8, higher)
            checks.append(
                _check(
                    "fp8_within",
                    suite,
                    name,
                    higher,
                    (FP8, fp8),
                    (CANDIDATE, value),
                    drop,
                    gate.fp8_max_drop,
                    drop <= gate.fp8_max_drop + EPS,
                )
            )
    if CHAMPION not in scores:
        notes.append("no champion in the registry yet (first release): no regression check")
    passed = all(check["passed"] for check in checks)
    failed = [check["reason"] for check in checks if not check["passed"]]
    return {
        "passed": passed,
        "primary_metric": metric,
        "thresholds": {
            "min_gain": gate.min_gain,
            "max_regression": gate.max_regression,
            "fp8_max_drop": gate.fp8_max_drop,
        },
        # Failures first: the first lines are the ones a person acts on.
        "reasons": failed + [c["reason"] for c in checks if c["passed"]] + notes,
        "failed": failed,
        "checks": checks,
        "higher_is_better": directions,
    }


# --- report -----------------------------------------------------------------------------------


def _delta(scores: Scores, model: str, reference: str, suite: str, metric: str) -> str:
    if model not in scores or reference not in scores:
        return ""
    return f"{scores[model][suite][metric] - scores[reference][suite][metric]:+.3f}"


def report(scores: Scores, decision: dict[str, Any]) -> str:
    """Markdown: the verdict and its reasons, then every model x metric with the gate's deltas."""
    models = list(scores)
    verdict = "PASS" if decision["passed"] else "FAIL"
    lines = ["# Evaluation", "", f"Gate: **{verdict}**", ""]
    if champion := decision.get("champion"):
        lines += [f"Champion: {champion['name']} v{champion['version']}", ""]
    lines += [f"- {reason}" for reason in decision["reasons"]]
    directions = decision["higher_is_better"]
    deltas = [(CANDIDATE, BASE), (CANDIDATE, CHAMPION), (FP8, CANDIDATE)]
    deltas = [(m, r) for m, r in deltas if m in scores and r in scores]
    for suite in scores[CANDIDATE]:
        header = ["metric", *models, *(f"{m} - {r}" for m, r in deltas)]
        lines += ["", f"## {suite}", "", "| " + " | ".join(header) + " |"]
        lines.append("|---" * len(header) + "|")
        for metric in sorted(scores[CANDIDATE][suite]):
            arrow = "↑" if directions.get(suite, {}).get(metric, True) else "↓"
            cells = [f"{metric} {arrow}"]
            cells += [f"{scores[m][suite][metric]:.3f}" for m in models]
            cells += [_delta(scores, m, r, suite, metric) for m, r in deltas]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(scores: Scores, directions: Directions, path: Path) -> None:
    suites = list(scores[CANDIDATE])
    fig, axes = plt.subplots(1, len(suites), figsize=(6 * len(suites), 4), squeeze=False)
    for ax, suite in zip(axes[0], suites, strict=True):
        metrics = sorted(scores[CANDIDATE][suite])
        width = 0.8 / len(scores)
        for i, (model, per_suite) in enumerate(scores.items()):
            values = [per_suite[suite][m] for m in metrics]
            ax.bar([x + i * width for x in range(len(metrics))], values, width, label=model)
        labels = [f"{m} {'↑' if directions[suite].get(m, True) else '↓'}" for m in metrics]
        ax.set_xticks([x + width * (len(scores) - 1) / 2 for x in range(len(metrics))], labels)
        ax.set_ylim(0, 1)
        ax.set_title(suite)
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


# --- stage ------------------------------------------------------------------------------------


def main() -> None:
    setup_logging()
    params = load_params()
    with stage_run(STAGE, params):
        tasks = TaskManager(include_path=str(params.paths.eval_suites))
        kind = backend(params)
        champion = registry.find_alias(params.tracking.registered_model, registry.CHAMPION)
        scores: Scores = {}
        directions: Directions = {}
        # The champion's folder is fetched for this evaluation only, not kept as an output.
        with tempfile.TemporaryDirectory(prefix="tuneloop-champion-") as tmp:
            models: dict[str, str | Path] = {BASE: base_model_ref(params)}
            if champion is not None:
                models[CHAMPION] = registry.download_folder(champion, registry.MERGED, Path(tmp))
            models |= {CANDIDATE: params.paths.merged, FP8: params.paths.fp8}
            for name, ref in models.items():
                log.info("evaluate: scoring %s (%s) with %s", name, ref, kind)
                scores[name], found = score(ref, params, tasks, kind)
                directions |= found
        decision = decide(scores, directions, params.gate)
        decision["champion"] = registry.describe(champion)
        # Which merged folder was judged: registration refuses any other.
        decision["candidate_key"] = registry.candidate_key(params.paths.merged)
        decision["backend"] = kind
        write_json(params.paths.metrics / "decision.json", decision)
        write_metrics(params, STAGE, scores)
        text = report(scores, decision)
        write_text(params.paths.reports / "eval.md", text)
        plot(scores, directions, params.paths.reports / "eval.png")
        for path in (
            params.paths.reports / "eval.md",
            params.paths.reports / "eval.png",
            params.paths.metrics / "decision.json",
        ):
            mlflow.log_artifact(str(path))
        mlflow.set_tag("gate.passed", str(decision["passed"]).lower())
        if champion is not None:
            mlflow.set_tag("gate.champion_version", str(champion.version))
        log.info("evaluate:\n%s", text)


if __name__ == "__main__":
    main()
