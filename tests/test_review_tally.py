"""The blind review's arithmetic on known inputs: Wilson intervals, agreement, the plan, tally."""

from __future__ import annotations

import math
import re

import pytest

from tuneloop.review.store import VoteRow, plan
from tuneloop.review.tally import fleiss_kappa, pairwise_agreement, tally, wilson

# The fast tier: no pipeline, server or rank.
pytestmark = pytest.mark.fast


def test_wilson_by_hand() -> None:
    # 8 of 10 at 95 %: z = 1.959964, z^2 = 3.841459;
    # centre = (0.8 + z^2/20) / (1 + z^2/10) = 0.992073 / 1.384146 = 0.716738
    # half = z * sqrt(0.8 * 0.2 / 10 + z^2/400) / 1.384146 = 0.313610 / 1.384146 = 0.226573
    low, high = wilson(8, 10)
    assert low == pytest.approx(0.716738 - 0.226573, abs=1e-5)
    assert high == pytest.approx(0.716738 + 0.226573, abs=1e-5)


@pytest.mark.parametrize(
    ("successes", "trials", "expected"),
    [
        # Newcombe (1998), "Two-sided confidence intervals for the single proportion",
        # Table I, method 3 (the score interval without continuity correction).
        (81, 263, (0.2553, 0.3662)),
        (15, 148, (0.0624, 0.1605)),
        (0, 20, (0.0, 0.1611)),
        (1, 29, (0.0061, 0.1718)),
        (29, 29, (0.8830, 1.0)),
    ],
)
def test_wilson_matches_the_published_table(
    successes: int, trials: int, expected: tuple[float, float]
) -> None:
    low, high = wilson(successes, trials)
    assert (round(low, 4), round(high, 4)) == expected


def test_wilson_edges() -> None:
    assert wilson(0, 0) == (0.0, 1.0)
    narrow, wide = wilson(50, 100, 0.8), wilson(50, 100, 0.99)
    assert wide[0] < narrow[0] < 0.5 < narrow[1] < wide[1]
    with pytest.raises(ValueError):
        wilson(3, 2)


def test_fleiss_kappa_on_the_textbook_example() -> None:
    # Fleiss (1971) as Wikipedia's "Fleiss' kappa" works it: 10 subjects, 14 raters each,
    # 5 categories; P-bar = 0.378, P-bar-e = 0.213, kappa = 0.210.
    table = [
        [0, 0, 0, 0, 14],
        [0, 2, 6, 4, 2],
        [0, 0, 3, 5, 6],
        [0, 3, 9, 2, 0],
        [2, 2, 8, 1, 1],
        [7, 7, 0, 0, 0],
        [3, 2, 6, 3, 0],
        [2, 5, 3, 2, 2],
        [6, 5, 2, 1, 0],
        [0, 2, 2, 3, 7],
    ]
    assert fleiss_kappa(table) == pytest.approx(0.210, abs=5e-4)


def test_fleiss_kappa_limits() -> None:
    assert fleiss_kappa([[3, 0], [0, 3], [3, 0]]) == pytest.approx(1.0)
    assert fleiss_kappa([[3, 0], [3, 0]]) is None  # one category only: chance explains all
    assert fleiss_kappa([[1, 0], [0, 1]]) is None  # no item with two ratings
    # Two raters who always disagree on a balanced split: kappa -1.
    assert fleiss_kappa([[1, 1], [1, 1]]) == pytest.approx(-1.0)


def test_pairwise_agreement_by_hand() -> None:
    # [2, 1, 0, 0]: 3 pairs, 1 agreeing; [0, 0, 3, 0]: 3 pairs, 3 agreeing; [1]: no pair.
    assert pairwise_agreement([[2, 1, 0, 0], [0, 0, 3, 0], [1, 0, 0, 0]]) == (4, 6)


def test_plan_repeats_controls_late_and_is_the_reviewers_own() -> None:
    items = list(range(100, 112))
    alice = plan("secret", "alice", items, controls=3, gap=4)
    assert alice == plan("secret", "alice", items, controls=3, gap=4)
    assert [s[0] for s in alice] != [s[0] for s in plan("secret", "bob", items, 3, 4)]
    assert [s[0] for s in alice] != [s[0] for s in plan("other", "alice", items, 3, 4)]
    first = [item for item, control, _ in alice if not control]
    assert sorted(first) == items
    controls = [(i, item) for i, (item, control, _) in enumerate(alice) if control]
    assert len(controls) == 3
    for at, item in controls:
        shown = next(i for i, (it, c, _) in enumerate(alice) if it == item and not c)
        between = [s for s in alice[shown + 1 : at] if not s[1]]
        assert len(between) >= 4, "a control comes back after at least `gap` other items"
    # Both orders occur, over the plan's coins.
    assert {first for _, _, first in alice} == {True, False}
    # Too short to repeat that far apart: fewer controls, never an error.
    assert sum(c for _, c, _ in plan("s", "a", [1, 2, 3], controls=3, gap=2)) == 1
    assert sum(c for _, c, _ in plan("s", "a", [1, 2], controls=3, gap=3)) == 0


def row(reviewer: str, item: int, preference: str, **kw: object) -> VoteRow:
    slices = {"intent": "refund" if item % 2 else "order", "language": "zh" if item < 3 else "en"}
    return VoteRow(reviewer, item, bool(kw.get("control", False)), preference, slices,
                   bool(kw.get("revoked", False)))  # fmt: skip


REVIEW = {"name": "r", "champion": "v3", "candidate": "v4", "items": 6, "reviewers": {}}


def test_tally_counts_rates_slices_agreement_and_consistency() -> None:
    rows = [
        row("ann", 0, "candidate"),
        row("ann", 1, "candidate"),
        row("ann", 2, "tie"),
        row("ann", 3, "champion"),
        row("ann", 0, "candidate", control=True),  # consistent
        row("ann", 3, "tie", control=True),  # not
        row("bob", 0, "candidate"),
        row("bob", 1, "champion"),
        row("bob", 2, "tie"),
        row("bob", 3, "both_wrong"),
    ]
    results = tally(rows, review=REVIEW | {"reviewers": {"ann": False, "bob": False}})
    overall = results.overall
    assert (results.votes, results.items_voted, results.items) == (8, 4, 6)
    assert (overall.win.count, overall.tie.count, overall.loss.count) == (3, 2, 2)
    assert overall.both_wrong.count == 1 and overall.win.n == 8
    assert overall.win.value == pytest.approx(3 / 8)
    assert (overall.win.low, overall.win.high) == wilson(3, 8)
    assert (overall.decisive.count, overall.decisive.n) == (3, 5)
    by = {(s.key, s.value): s for s in results.slices}
    assert [k for k, _ in by] == ["intent", "intent", "language", "language"]
    assert by[("intent", "refund")].votes == 4 and by[("intent", "refund")].win.count == 1
    assert by[("language", "zh")].votes == 6 and by[("language", "zh")].win.count == 3
    # Items 0 and 2 agree (2 pairs), items 1 and 3 do not: 2 of 4 pairs.
    assert (results.agreement.agreeing_pairs, results.agreement.pairs) == (2, 4)
    assert results.agreement.items == 4
    assert results.agreement.fleiss_kappa is not None
    ann, bob = results.reviewers
    assert (ann.name, ann.votes, ann.controls, ann.consistency.count) == ("ann", 4, 2, 1)
    assert (bob.controls, bob.consistency.value) == (0, None)
    as_dict = results.as_dict()
    assert as_dict["overall"]["win"]["value"] == pytest.approx(0.375)
    assert as_dict["agreement"]["pairwise"] == pytest.approx(0.5)
    assert "| all | 8 | 38% [" in results.table()
    metrics = results.metrics()
    assert metrics["review.win"] == pytest.approx(0.375)
    assert metrics["review.decisive_low"] == pytest.approx(wilson(3, 5)[0])
    assert metrics["review.intent.refund.win"] == pytest.approx(0.25)
    assert metrics["review.votes"] == 8 and metrics["review.consistency"] == 0.5
    assert all(re.fullmatch(r"[A-Za-z0-9_\-. /]+", name) for name in metrics)


def test_tally_keeps_or_leaves_out_revoked_reviewers() -> None:
    rows = [row("ann", 0, "candidate"), row("eve", 0, "champion", revoked=True)]
    review = REVIEW | {"reviewers": {"ann": False, "eve": True}}
    kept = tally(rows, review=review)
    assert (kept.votes, kept.revoked_votes) == (2, 1)
    assert [r.revoked for r in kept.reviewers] == [False, True]
    assert "revoked since" in kept.table()
    left_out = tally(rows, review=review, include_revoked=False)
    assert (left_out.votes, left_out.revoked_votes) == (1, 0)
    assert [r.name for r in left_out.reviewers] == ["ann"]


def test_tally_of_no_votes() -> None:
    results = tally([], review=REVIEW)
    assert results.votes == 0 and results.overall.win.value is None
    assert (results.overall.win.low, results.overall.win.high) == (0.0, 1.0)
    assert results.agreement.pairwise is None and results.agreement.fleiss_kappa is None
    assert not math.isnan(results.confidence)
    with pytest.raises(ValueError):
        tally([], review=REVIEW, confidence=1.5)
