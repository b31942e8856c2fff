"""Hand-made per-item scores for the gate's tests (``test_gate``, ``test_fixed_badcases``)."""

from __future__ import annotations

from typing import Any

from tuneloop.judge.decision import Decision
from tuneloop.judge.gate import BASE, CANDIDATE, FP8, SuiteItems, decide
from tuneloop.params import GateParams

SUITE, GENERAL = "support_demo", "general_demo"
DIRECTIONS = {
    SUITE: {"accuracy": True, "format_compliance": True, "hallucination_rate": False},
    GENERAL: {"accuracy": True},
}
GATE = GateParams(
    primary_metric="accuracy",
    min_gain=0.05,
    max_regression=0.02,
    fp8_max_drop=0.02,
    fp4_max_drop=0.05,
    max_forgetting=0.05,
    max_slice_regression=None,
    max_broken_fixes=3,
    confidence=0.95,
    bootstrap_samples=2000,
    seed=0,
)
N = 200
IDS = [str(i) for i in range(N)]
LANG = ["zh" if i % 4 == 0 else "en" for i in range(N)]  # 50 zh items, 150 en
UNANSWERABLE = [i % 5 == 0 for i in range(N)]  # 40 items the hallucination rate counts


def right(*indices: range | list[int]) -> list[float]:
    """1.0 on the given items, 0.0 elsewhere."""
    hit = {i for group in indices for i in group}
    return [1.0 if i in hit else 0.0 for i in range(N)]


def suite(accuracy: list[float], hallucinated: list[float] | None = None) -> SuiteItems:
    """A support_demo-shaped suite: accuracy as given, every reply well formed."""
    invented = hallucinated or [0.0] * N
    return SuiteItems.of(
        IDS,
        {"accuracy": accuracy, "format_compliance": [1.0] * N, "hallucination_rate": invented},
        weights={"hallucination_rate": [1.0 if u else 0.0 for u in UNANSWERABLE]},
        slices={"lang": LANG},
    )


def general(accuracy: list[float]) -> SuiteItems:
    return SuiteItems.of(IDS, {"accuracy": accuracy})


def a_decision(**judged: Any) -> Decision:
    """A real decision (the candidate well past the base), with ``judged``'s evaluation fields
    (``champion``, ``candidate_key``, ``backend``, ``engines``) as ``stages/evaluate.py`` sets
    them."""
    base, candidate = suite(right(range(80))), suite(right(range(160)))
    items = {BASE: {SUITE: base}, CANDIDATE: {SUITE: candidate}, FP8: {SUITE: candidate}}
    found = decide(items, DIRECTIONS, GATE, [SUITE])
    given = {"champion": None, "candidate_key": "abc123", "backend": "hf", "engines": {}} | judged
    return found.judged(**given)
