"""The gate's report: ``reports/eval.md`` and ``reports/eval.png``.

``report`` writes the verdict of ``tuneloop.judge.gate.decide`` and its reasons, every model x
metric with the paired differences and their intervals, the slices, the fixed badcases and
the general suites; ``plot`` draws every model's figures per suite. Both only show what the
decision holds: no rule is judged here.
"""

from __future__ import annotations

from pathlib import Path

from tuneloop.judge.decision import Check, Comparison, Decision
from tuneloop.judge.gate import (
    BASE,
    CANDIDATE,
    CHAMPION,
    EXPORT_MODELS,
    FP4_FORMATS,
    FP8,
    NOT_A_RULE,
    Directions,
    Scores,
    plain,
)


def _cell(c: Comparison | Check | None) -> str:
    if c is None:
        return ""
    if c.diff is None:
        return "n/a"
    return f"{c.diff:+.3f} [{c.low:+.3f}, {c.high:+.3f}]"


def _find(
    decision: Decision, suite: str, metric: str, model: str, reference: str
) -> Comparison | None:
    for c in decision.comparisons:
        if (c.suite, c.metric, c.model, c.reference) == (suite, metric, model, reference):
            return c
    return None


def report(scores: Scores, decision: Decision, directions: Directions) -> str:
    """Markdown: the verdict and its reasons, every model x metric with the paired
    differences and their intervals, the slices, and the general suites."""
    verdict = decision.verdict.upper()
    conf = decision.statistics
    lines = ["# Evaluation", "", f"Gate: **{verdict}**", ""]
    if champion := decision.champion:
        lines += [f"Champion: {champion.name} v{champion.version}", ""]
    lines += [
        f'Differences are paired, item by item, and read "better by" (positive: the first '
        f"model is better, whichever way the metric points), with {conf.confidence:.0%} "
        f"intervals from a {conf.method} ({conf.samples} resamples, seed {conf.seed}).",
        "",
    ]
    lines += [f"- {reason}" for reason in decision.reasons]
    if decision.thresholds.fp8_max_drop is None and FP8 in scores:
        lines.append(
            f"- {FP8}: compared below, not a rule (gate.fp8_max_drop is null: the FP8 export "
            "is not what is served)"
        )
    for fmt in FP4_FORMATS:
        if (standing := decision.export(fmt)) is not None and standing.status == NOT_A_RULE:
            lines.append(f"- {EXPORT_MODELS[fmt]}: {standing.reason}")
    lines += _scored_by(decision)
    general = set(decision.forgetting.suites)
    pairs = [(CANDIDATE, BASE), (CANDIDATE, CHAMPION), (FP8, CANDIDATE)]
    pairs += [(EXPORT_MODELS[fmt], CANDIDATE) for fmt in FP4_FORMATS]
    for suite in scores[CANDIDATE]:
        if suite in general or suite == decision.fixed_badcases.suite:
            continue
        models = [m for m in scores if suite in scores[m]]
        shown = [(m, r) for m, r in pairs if m in models and r in models]
        header = ["metric", *models, *(f"{m} vs {r}" for m, r in shown)]
        count = decision.items.get(suite, "?")
        lines += ["", f"## {suite} ({count} items)", "", _row(header), "|---" * len(header) + "|"]
        for metric in sorted(scores[CANDIDATE][suite]):
            arrow = "↑" if directions.get(suite, {}).get(metric, True) else "↓"
            cells = [f"{metric} {arrow}"]
            cells += [plain(scores[m][suite].get(metric)) for m in models]
            cells += [_cell(_find(decision, suite, metric, m, r)) for m, r in shown]
            lines.append(_row(cells))
        parts = [s for s in decision.slices if s.suite == suite]
        if parts:
            lines += [
                "",
                f"### {suite} by slice: {CANDIDATE} vs {decision.reference}",
                "",
                _row(["slice", "metric", "items", decision.reference, CANDIDATE, "better by"]),
                "|---" * 6 + "|",
            ]
            for s in parts:
                mark = " **regressed**" if s.regressed else ""
                lines.append(
                    _row(
                        [
                            s.slice or "",
                            s.metric,
                            str(s.items),
                            plain(s.reference_value),
                            plain(s.value),
                            _cell(s) + mark,
                        ]
                    )
                )
    fixed = decision.fixed_badcases
    if fixed.suite:
        lines += [
            "",
            f"## Fixed badcases: {fixed.suite} ({fixed.items} items, "
            f"max_broken_fixes {fixed.max_broken_fixes})",
            "",
            f"The champion answers {fixed.fixed_by_champion} right; the candidate breaks "
            f"{fixed.broken} of them: **{fixed.status}**.",
        ]
    forgetting = decision.forgetting
    if forgetting.suites or forgetting.could_not_run:
        budget = decision.thresholds.max_forgetting
        lines += [
            "",
            f"## Forgetting: general suites, {CANDIDATE} vs {forgetting.reference} "
            f"(max_forgetting {budget:.3f})",
            "",
        ]
        rows = [c for c in decision.checks if c.rule == "forgetting"]
        if rows:
            models = [m for m in (BASE, CHAMPION, CANDIDATE) if m in scores]
            header = ["suite", "metric", *models, "better by", "check"]
            lines += [_row(header), "|---" * len(header) + "|"]
            for c in rows:
                cells = [c.suite, c.metric]
                cells += [plain(scores[m].get(c.suite, {}).get(c.metric)) for m in models]
                lines.append(_row([*cells, _cell(c), c.status]))
        for suite, why in forgetting.could_not_run.items():
            lines.append(f"\n- {suite}: {why}")
    return "\n".join(lines) + "\n"


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def plot(scores: Scores, directions: Directions, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    suites = list(scores[CANDIDATE])
    fig, axes = plt.subplots(1, len(suites), figsize=(6 * len(suites), 4), squeeze=False)
    for ax, suite in zip(axes[0], suites, strict=True):
        metrics = sorted(scores[CANDIDATE][suite])
        models = [m for m in scores if suite in scores[m]]
        width = 0.8 / len(models)
        for i, model in enumerate(models):
            values = [scores[model][suite].get(m, 0.0) for m in metrics]
            ax.bar([x + i * width for x in range(len(metrics))], values, width, label=model)
        labels = [f"{m} {'↑' if directions[suite].get(m, True) else '↓'}" for m in metrics]
        ax.set_xticks([x + width * (len(models) - 1) / 2 for x in range(len(metrics))], labels)
        ax.set_ylim(0, 1)
        ax.set_title(suite)
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _scored_by(decision: Decision) -> list[str]:
    """Which engine scored each export: vLLM as served, or transformers' decompressed path."""
    engines = decision.engines
    exported = [m for m in EXPORT_MODELS.values() if m in engines]
    if not exported:
        return []
    return ["", "Scored by:", *(f"- {m}: {engines[m]}" for m in exported)]
