"""The eval gate: judge the candidate against the base, the champion and its FP8 export.

The rules (params ``gate``), on every suite:

- the candidate beats the base by ``min_gain`` on ``primary_metric``;
- the candidate is behind the champion by at most ``max_regression`` on every
  metric (skipped when the registry has no champion yet);
- the FP8 export is behind the candidate by at most ``fp8_max_drop`` on every metric.

``decide`` returns the verdict with every check, its numbers and a reason for each, pass or
fail; ``report`` and ``plot`` show the scores side by side. Whether a metric is better higher
or lower comes from the suite's own ``higher_is_better``, as lm-eval reports it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tuneloop.params import GateParams

BASE, CHAMPION, CANDIDATE, FP8 = "base", "champion", "candidate", "candidate-fp8"
# Scores are means over items: float error must not turn a tie into a failure.
EPS = 1e-9
Scores = dict[str, dict[str, dict[str, float]]]  # model -> suite -> metric -> value
Directions = dict[str, dict[str, bool]]  # suite -> metric -> higher is better


class GateError(ValueError):
    """The scores cannot be judged as configured (a metric or a direction is missing)."""


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
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

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
