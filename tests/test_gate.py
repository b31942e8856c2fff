"""The gate's rules on hand-made per-item scores whose answer is known, and its statistics.

Every test builds items where the right verdict follows from the numbers: a gain far
past min_gain on 200 items, a 0.01 gain on 200 items, a drop of 30 points on a general
suite, a slice that lost what the rest gained.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.gate_helpers import (
    DIRECTIONS,
    GATE,
    GENERAL,
    IDS,
    LANG,
    SUITE,
    UNANSWERABLE,
    N,
    general,
    right,
    suite,
)
from tuneloop.judge import gate, gate_report, scoring, stats
from tuneloop.judge.decision import Champion, Decision, UnsettledRule
from tuneloop.judge.gate import BASE, CANDIDATE, CHAMPION, FP8, GateError, SuiteItems, decide
from tuneloop.params import BlindReviewParams, GateParams
from tuneloop.review.store import VoteRow
from tuneloop.review.tally import tally

# The fast tier: no pipeline, server or rank.
pytestmark = pytest.mark.fast


def judge(
    models: dict[str, SuiteItems],
    params: GateParams = GATE,
    general_items: dict[str, SuiteItems] | None = None,
    could_not_run: dict[str, str] | None = None,
    exports: tuple[str, ...] = ("fp8",),
) -> Decision:
    items = {name: {SUITE: found} for name, found in models.items()}
    for name, found in (general_items or {}).items():
        items[name][GENERAL] = found
    return decide(
        items,
        DIRECTIONS,
        params,
        [SUITE],
        [GENERAL] if general_items else [],
        could_not_run or {},
        exports=exports,
    )


def statuses(decision: Decision, rule: str) -> dict[str, str]:
    return {c.metric: c.status for c in decision.checks if c.rule == rule}


BASE_40 = suite(right(range(80)))  # 0.40
CANDIDATE_80 = suite(right(range(160)))  # 0.80, right wherever the base is, and on 80 more


# --- the rules --------------------------------------------------------------------------------


def test_a_clear_gain_over_the_base_passes() -> None:
    decision = judge({BASE: BASE_40, CANDIDATE: CANDIDATE_80, FP8: CANDIDATE_80})
    assert decision.verdict == "pass" and decision.passed is True
    assert not decision.failed and not decision.inconclusive
    [check] = [c for c in decision.checks if c.rule == "beats_base"]
    assert check.diff == pytest.approx(0.40)
    assert check.low >= 0.05 and check.low < 0.40 < check.high
    assert any("no champion" in reason for reason in decision.reasons)


def test_a_gain_below_min_gain_even_at_its_upper_bound_fails() -> None:
    # +0.01 on items that never disagree otherwise: certain, and too small.
    base = SuiteItems.of(IDS, {"accuracy": [0.70] * N}, slices={"lang": LANG})
    candidate = SuiteItems.of(IDS, {"accuracy": [0.71] * N}, slices={"lang": LANG})
    decision = judge({BASE: base, CANDIDATE: candidate, FP8: candidate})
    assert decision.verdict == "fail"
    assert statuses(decision, "beats_base") == {"accuracy": "fail"}
    assert "needs at least +0.050: FAIL" in decision.failed[0]


def test_a_gain_exactly_at_the_threshold_passes() -> None:
    # 0.75 - 0.70 is 0.04999999999999993 in floats; a tie must not fail.
    base = SuiteItems.of(IDS, {"accuracy": [0.70] * N})
    candidate = SuiteItems.of(IDS, {"accuracy": [0.75] * N})
    assert judge({BASE: base, CANDIDATE: candidate, FP8: candidate}).verdict == "pass"


def test_a_one_point_gain_over_the_champion_on_200_items_is_inconclusive() -> None:
    champion = suite(right(range(150)))  # 0.75
    # Right on 140 of the champion's items and 12 others: 0.76, ten losses and twelve wins.
    candidate = suite(right(range(140), range(150, 162)))
    decision = judge({BASE: BASE_40, CHAMPION: champion, CANDIDATE: candidate, FP8: candidate})
    assert decision.verdict == "inconclusive" and decision.passed is False
    assert statuses(decision, "beats_base")["accuracy"] == "pass"
    [check] = [c for c in decision.checks if c.rule == "no_regression" and c.metric == "accuracy"]
    assert check.status == "inconclusive" and check.blocking
    assert check.diff == pytest.approx(0.01)
    assert check.low < -0.02 < check.high
    assert check.more_items > 0
    assert decision.more_items == {SUITE: check.more_items}
    assert decision.inconclusive == [check.reason]
    assert f"about {check.more_items} more items would settle it" in check.reason


def test_a_one_point_gain_over_the_base_with_no_min_gain_is_inconclusive() -> None:
    base = suite(right(range(150)))
    candidate = suite(right(range(140), range(150, 162)))
    no_min = GATE.model_copy(update={"min_gain": 0.0})
    decision = judge({BASE: base, CANDIDATE: candidate, FP8: candidate}, no_min)
    assert decision.verdict == "inconclusive"
    assert statuses(decision, "beats_base") == {"accuracy": "inconclusive"}


def test_the_estimated_items_do_settle_it() -> None:
    """Repeating the observed pattern up to the estimate puts the interval clear of the limit."""
    pattern_champion = right(range(150))
    pattern_candidate = right(range(140), range(150, 162))
    first = judge(
        {
            BASE: BASE_40,
            CHAMPION: suite(pattern_champion),
            CANDIDATE: suite(pattern_candidate),
            FP8: suite(pattern_candidate),
        }
    )
    total = N + first.more_items[SUITE]
    copies = -(-total // N)
    ids = [str(i) for i in range(copies * N)]

    def grown(values: list[float]) -> SuiteItems:
        return SuiteItems.of(ids, {"accuracy": values * copies})

    items = {
        BASE: {SUITE: grown(right(range(80)))},
        CHAMPION: {SUITE: grown(pattern_champion)},
        CANDIDATE: {SUITE: grown(pattern_candidate)},
        FP8: {SUITE: grown(pattern_candidate)},
    }
    decision = decide(items, DIRECTIONS, GATE, [SUITE])
    assert decision.verdict == "pass", decision.reasons[:2]


def test_falling_behind_the_champion_past_the_limit_fails() -> None:
    champion = suite(right(range(160)))  # 0.80
    candidate = suite(right(range(120)))  # 0.60: 40 items lost, none won
    decision = judge({BASE: BASE_40, CHAMPION: champion, CANDIDATE: candidate, FP8: candidate})
    assert decision.verdict == "fail"
    assert statuses(decision, "no_regression")["accuracy"] == "fail"
    assert "candidate 0.600 vs champion 0.800: better by -0.200" in decision.failed[0]


def test_hallucinating_more_than_the_champion_fails_lower_is_better() -> None:
    unanswerable = [i for i in range(N) if UNANSWERABLE[i]]
    champion = suite(right(range(160)), right(unanswerable[:2]))  # 2 of 40: 0.05
    candidate = suite(right(range(160)), right(unanswerable[:20]))  # 20 of 40: 0.50
    decision = judge({BASE: BASE_40, CHAMPION: champion, CANDIDATE: candidate, FP8: candidate})
    assert decision.verdict == "fail"
    [check] = [c for c in decision.checks if c.status == "fail"]
    assert (check.rule, check.metric) == ("no_regression", "hallucination_rate")
    assert check.items == 40 and check.diff == pytest.approx(-0.45)
    assert "(lower is better)" in check.reason


def test_an_fp8_export_that_drops_past_the_limit_fails() -> None:
    fp8 = suite(right(range(130)))  # 0.65 against the candidate's 0.80
    decision = judge({BASE: BASE_40, CANDIDATE: CANDIDATE_80, FP8: fp8})
    assert decision.verdict == "fail"
    assert statuses(decision, "fp8_within")["accuracy"] == "fail"


def test_an_fp8_export_that_is_not_served_is_compared_but_decides_nothing() -> None:
    # Adapters on a shared base (the real-model demo's release) never ship the merged FP8 export.
    fp8 = suite(right(range(130)))  # the export that fails above
    decision = judge(
        {BASE: BASE_40, CANDIDATE: CANDIDATE_80, FP8: fp8},
        GATE.model_copy(update={"fp8_max_drop": None}),
    )
    assert decision.verdict == "pass" and decision.thresholds.fp8_max_drop is None
    assert not [c for c in decision.checks if c.rule == "fp8_within"]
    [compared] = [
        c
        for c in decision.comparisons
        if (c.model, c.reference, c.metric) == (FP8, CANDIDATE, "accuracy")
    ]
    assert compared.diff == pytest.approx(-0.15)
    scores = gate.scores_of(
        {m: {SUITE: found} for m, found in ((BASE, BASE_40), (CANDIDATE, CANDIDATE_80), (FP8, fp8))}
    )
    assert "candidate-fp8: compared below, not a rule" in gate_report.report(
        scores, decision, DIRECTIONS
    )


NVFP4, NVFP4A16 = gate.EXPORT_MODELS["nvfp4"], gate.EXPORT_MODELS["nvfp4a16"]
ALL_FORMATS = ("fp8", "nvfp4", "nvfp4a16")


def test_an_fp4_export_past_its_tolerance_is_refused_and_the_candidate_still_passes() -> None:
    # nvfp4 drops 0.15 (past fp4_max_drop 0.05); nvfp4a16 matches the candidate.
    models = {
        BASE: BASE_40,
        CANDIDATE: CANDIDATE_80,
        FP8: CANDIDATE_80,
        NVFP4: suite(right(range(130))),
        NVFP4A16: CANDIDATE_80,
    }
    decision = judge(models, exports=ALL_FORMATS)
    # FP4 judges the format, not the candidate: the verdict is FP8's and the candidate's.
    assert decision.verdict == "pass"
    assert not [c for c in decision.checks if c.rule.startswith("nvfp4")]
    exports = decision.exports
    assert (exports["nvfp4"].status, exports["nvfp4"].refused) == ("fail", True)
    assert (exports["nvfp4a16"].status, exports["nvfp4a16"].refused) == ("pass", False)
    assert (exports["fp8"].status, exports["fp8"].refused) == ("pass", False)
    [failed] = [c for c in exports["nvfp4"].checks if c.status == "fail"]
    assert (failed.rule, failed.metric, failed.threshold) == (
        "nvfp4_within", "accuracy", -0.05,
    )  # fmt: skip
    assert failed.diff == pytest.approx(-0.15)
    assert any(r.startswith("nvfp4 refused, not registered") for r in decision.reasons)
    assert decision.thresholds.fp4_max_drop == 0.05
    scores = gate.scores_of({m: {SUITE: found} for m, found in models.items()})
    text = gate_report.report(scores, decision, DIRECTIONS)
    assert f"{NVFP4} vs candidate" in text and f"{NVFP4A16} vs candidate" in text


def test_an_unsettled_fp4_rule_refuses_the_format_only_when_unsettled_rules_block() -> None:
    # 0.03 behind on 200 items: the interval straddles -0.05, so the rule cannot settle.
    close = suite(right(range(154)))
    models = {BASE: BASE_40, CANDIDATE: CANDIDATE_80, FP8: CANDIDATE_80, NVFP4: close}
    blocked = judge(models, exports=("fp8", "nvfp4"))
    assert blocked.exports["nvfp4"].status == "inconclusive"
    assert blocked.exports["nvfp4"].refused is True
    warned = judge(
        models, GATE.model_copy(update={"on_inconclusive": "warn"}), exports=("fp8", "nvfp4")
    )
    assert warned.exports["nvfp4"].refused is False


def test_an_fp4_export_with_a_null_tolerance_is_compared_not_ruled() -> None:
    models = {
        BASE: BASE_40,
        CANDIDATE: CANDIDATE_80,
        FP8: CANDIDATE_80,
        NVFP4: suite(right(range(130))),  # refused above
    }
    decision = judge(
        models, GATE.model_copy(update={"fp4_max_drop": None}), exports=("fp8", "nvfp4")
    )
    assert decision.verdict == "pass"
    nvfp4 = decision.exports["nvfp4"]
    assert (nvfp4.status, nvfp4.refused, nvfp4.checks) == ("not a rule", False, [])
    [compared] = [
        c
        for c in decision.comparisons
        if (c.model, c.reference, c.metric) == (NVFP4, CANDIDATE, "accuracy")
    ]
    assert compared.diff == pytest.approx(-0.15)
    scores = gate.scores_of({m: {SUITE: found} for m, found in models.items()})
    text = gate_report.report(scores, decision, DIRECTIONS)
    assert f"{NVFP4}: nvfp4: compared below, not a rule (gate.fp4_max_drop is null)" in text


def test_an_export_format_without_scores_is_an_error() -> None:
    with pytest.raises(GateError, match="no scores for 'candidate-nvfp4'"):
        judge({BASE: BASE_40, CANDIDATE: CANDIDATE_80, FP8: CANDIDATE_80}, exports=ALL_FORMATS)


def test_a_forgetting_drop_past_the_budget_fails() -> None:
    base_general = general(right(range(180)))  # 0.90
    forgot = general(right(range(120)))  # 0.60
    decision = judge(
        {BASE: BASE_40, CANDIDATE: CANDIDATE_80, FP8: CANDIDATE_80},
        general_items={BASE: base_general, CANDIDATE: forgot},
    )
    assert decision.verdict == "fail"
    [check] = [c for c in decision.checks if c.rule == "forgetting"]
    assert check.status == "fail" and check.reference == BASE
    assert check.diff == pytest.approx(-0.30)
    assert check.high < -0.05
    assert decision.forgetting.suites == [GENERAL]


def test_forgetting_is_judged_against_the_champion_when_there_is_one() -> None:
    base_general = general(right(range(100)))  # 0.50
    champion_general = general(right(range(190)))  # 0.95
    candidate_general = general(right(range(188)))  # 0.94: within the budget, surely
    champion = suite(right(range(160)))
    decision = judge(
        {BASE: BASE_40, CHAMPION: champion, CANDIDATE: CANDIDATE_80, FP8: CANDIDATE_80},
        general_items={
            BASE: base_general,
            CHAMPION: champion_general,
            CANDIDATE: candidate_general,
        },
    )
    [check] = [c for c in decision.checks if c.rule == "forgetting"]
    assert check.reference == CHAMPION and check.status == "pass"
    assert decision.verdict == "pass"


def _unsettled_forgetting(params: GateParams) -> Decision:
    # 20 items, the candidate lost 2: the interval reaches past the budget, but nothing
    # shows that it lost more than the budget.
    ids = [str(i) for i in range(20)]
    few = {
        BASE: SuiteItems.of(ids, {"accuracy": [1.0] * 20}),
        CANDIDATE: SuiteItems.of(ids, {"accuracy": [1.0] * 18 + [0.0] * 2}),
    }
    items = {
        name: {SUITE: found}
        for name, found in ((BASE, BASE_40), (CANDIDATE, CANDIDATE_80), (FP8, CANDIDATE_80))
    }
    for name, found in few.items():
        items[name][GENERAL] = found
    return decide(items, DIRECTIONS, params, [SUITE], [GENERAL])


def test_an_unsettled_forgetting_check_blocks_by_default() -> None:
    assert GATE.on_inconclusive == "block"
    decision = _unsettled_forgetting(GATE)
    assert decision.verdict == "inconclusive" and decision.passed is False
    [check] = [c for c in decision.checks if c.rule == "forgetting"]
    assert check.status == "inconclusive" and check.blocking
    assert check.more_items > 0 and decision.inconclusive == [check.reason]
    assert decision.more_items == {GENERAL: check.more_items}
    [listed] = decision.unsettled
    assert listed.rule == "forgetting" and listed.more_items == check.more_items


def test_with_warn_an_unsettled_rule_lets_the_candidate_through_and_is_listed() -> None:
    decision = _unsettled_forgetting(GATE.model_copy(update={"on_inconclusive": "warn"}))
    assert decision.verdict == "pass" and decision.passed is True
    assert decision.on_inconclusive == "warn" and not decision.inconclusive
    [check] = [c for c in decision.checks if c.rule == "forgetting"]
    assert check.status == "inconclusive" and not check.blocking
    [listed] = decision.unsettled
    assert listed == UnsettledRule(
        rule="forgetting",
        suite=GENERAL,
        metric="accuracy",
        slice=None,
        more_items=check.more_items,
        blocking=False,
        reason=check.reason,
        line="forgetting general_demo/accuracy: inconclusive, about "
        f"{check.more_items} more items would settle it",
    )
    assert "about" in listed.reason and str(check.more_items) in listed.reason
    assert any("gate.on_inconclusive: warn" in r for r in decision.reasons)


def test_warn_never_lets_a_failure_through() -> None:
    warn = GATE.model_copy(update={"on_inconclusive": "warn"})
    decision = judge({BASE: BASE_40, CANDIDATE: BASE_40, FP8: BASE_40}, warn)
    assert decision.verdict == "fail" and decision.passed is False


# --- the blind review's rule -------------------------------------------------------------------


def _review(wins: int, losses: int, ties: int = 0) -> dict:
    """Three reviewers' first-showing votes: ``wins`` for the candidate, ``losses`` for the
    champion, ``ties`` neither; each on an item of its own."""
    prefs = ["candidate"] * wins + ["champion"] * losses + ["tie"] * ties
    rows = [
        VoteRow(f"reviewer-{i % 3}", i, False, p, {"language": "en"}, False)
        for i, p in enumerate(prefs)
    ]
    info = {"name": "m1", "champion": "v1", "candidate": "v2", "items": len(rows), "reviewers": {}}
    return tally(rows, review=info).as_dict()


REVIEWED = GATE.model_copy(update={"blind_review": BlindReviewParams(min_votes=30, margin=0.1)})


def test_the_review_blocks_without_enough_votes_whatever_on_inconclusive_says() -> None:
    for mode in ("block", "warn"):
        params = REVIEWED.model_copy(update={"on_inconclusive": mode})
        check = gate.review_check(_review(wins=20, losses=0), params)
        assert check.status == "inconclusive" and check.blocking
        assert check.more_items == 10 and "10 more votes needed" in check.reason


def test_the_review_passes_a_clear_win_and_fails_a_clear_loss() -> None:
    won = gate.review_check(_review(wins=40, losses=8, ties=12), REVIEWED)
    assert won.status == "pass" and won.low >= 0.4 and not won.blocking
    lost = gate.review_check(_review(wins=6, losses=44, ties=10), REVIEWED)
    assert lost.status == "fail" and lost.high < 0.4 and lost.blocking
    assert lost.reason.endswith("FAIL")


def test_a_review_too_close_to_call_says_how_many_more_votes_settle_it() -> None:
    # 22 of 40 decisive votes: the interval straddles 0.4.
    close = gate.review_check(_review(wins=22, losses=18), REVIEWED)
    assert close.status == "inconclusive" and close.blocking
    assert close.low < 0.4 < close.high and close.more_items > 0
    warn = REVIEWED.model_copy(update={"on_inconclusive": "warn"})
    assert not gate.review_check(_review(wins=22, losses=18), warn).blocking
    with pytest.raises(GateError, match="blind_review is not set"):
        gate.review_check(_review(wins=22, losses=18), GATE)


def test_a_general_suite_that_could_not_run_is_named_not_dropped() -> None:
    why = "could not run: ConnectionError: Couldn't reach 'cais/mmlu' on the Hub"
    decision = judge(
        {BASE: BASE_40, CANDIDATE: CANDIDATE_80, FP8: CANDIDATE_80},
        could_not_run={"mmlu_stem": why},
    )
    assert decision.forgetting.could_not_run == {"mmlu_stem": why}
    assert f"general suite mmlu_stem: {why}" in decision.reasons
    assert "forgetting budget not enforced: no general suite could run" in decision.reasons
    text = gate_report.report(
        gate.scores_of(
            {
                m: {SUITE: s}
                for m, s in ((BASE, BASE_40), (CANDIDATE, CANDIDATE_80), (FP8, CANDIDATE_80))
            }
        ),
        decision,
        DIRECTIONS,
    )
    assert f"- mmlu_stem: {why}" in text


# --- slices -----------------------------------------------------------------------------------

ZH = [i for i in range(N) if LANG[i] == "zh"]
EN = [i for i in range(N) if LANG[i] == "en"]


def regressed_in_zh() -> dict[str, SuiteItems]:
    """Better overall than the champion, but 25 of the 50 Chinese items lost."""
    champion = suite(right(ZH[:45], EN[:90]))  # zh 0.90, en 0.60: 0.675
    candidate = suite(right(ZH[:20], EN[:145]))  # zh 0.40, en 0.97: 0.825
    return {BASE: BASE_40, CHAMPION: champion, CANDIDATE: candidate, FP8: candidate}


def test_a_slice_that_regressed_is_named_even_when_the_whole_passes() -> None:
    decision = judge(regressed_in_zh())
    assert decision.verdict == "pass"
    assert decision.regressed_slices == ["support_demo/accuracy [lang=zh]"]
    [zh] = [s for s in decision.slices if s.slice == "lang=zh" and s.metric == "accuracy"]
    assert zh.items == 50 and zh.diff == pytest.approx(-0.50) and zh.regressed
    assert any(
        r.startswith("slice regressed (reported only): support_demo/accuracy [lang=zh]")
        for r in decision.reasons
    )
    [en] = [s for s in decision.slices if s.slice == "lang=en" and s.metric == "accuracy"]
    assert not en.regressed and en.diff == pytest.approx(0.3667, abs=1e-3)
    # Unanswerable items fall in both languages: every metric has figures in both slices.
    assert {s.slice for s in decision.slices} == {"lang=zh", "lang=en"}


def test_max_slice_regression_makes_a_regressed_slice_block() -> None:
    strict = GATE.model_copy(update={"max_slice_regression": 0.10})
    decision = judge(regressed_in_zh(), strict)
    assert decision.verdict == "fail"
    [check] = [c for c in decision.checks if c.status == "fail"]
    assert (check.rule, check.slice) == ("slice_regression", "lang=zh")


def test_the_report_shows_intervals_slices_and_general_suites() -> None:
    models = regressed_in_zh()
    general_items = {
        BASE: general(right(range(180))),
        CHAMPION: general(right(range(180))),
        CANDIDATE: general(right(range(179))),
    }
    champion = Champion(name="m", version="3", run_id="", source="")
    decision = judge(models, general_items=general_items).judged(champion, "", "hf", {})
    items = {name: {SUITE: found} for name, found in models.items()}
    for name, found in general_items.items():
        items[name][GENERAL] = found
    text = gate_report.report(gate.scores_of(items), decision, DIRECTIONS)
    assert f"Gate: **{decision.verdict.upper()}**" in text and "Champion: m v3" in text
    header = next(line for line in text.splitlines() if line.startswith("| metric"))
    assert "candidate vs champion" in header and "candidate-fp8 vs candidate" in header
    row = next(line for line in text.splitlines() if line.startswith("| accuracy ↑"))
    assert row.startswith("| accuracy ↑ | 0.400 | 0.675 | 0.825 | 0.825 | +0.425 [")
    assert (
        "| lang=zh | accuracy | 50 | 0.900 | 0.400 | -0.500 [" in text and "**regressed**" in text
    )
    assert "## Forgetting: general suites, candidate vs champion" in text
    assert "| general_demo | accuracy | 0.900 | 0.900 | 0.895 |" in text


# --- statistics -------------------------------------------------------------------------------


def test_the_same_seed_gives_the_same_interval_and_another_seed_another() -> None:
    models = regressed_in_zh()
    first, again = judge(models), judge(models)
    assert first.checks == again.checks
    other = judge(models, GATE.model_copy(update={"seed": 1}))
    lows = [(c.low, c.high) for c in first.checks]
    assert lows != [(c.low, c.high) for c in other.checks]


def test_bootstrap_means_are_weighted_and_paired() -> None:
    rng = np.random.default_rng(3)
    values = rng.random((500, 2))
    weights = np.stack([np.ones(500), (rng.random(500) < 0.3).astype(float)], axis=1)
    reps = stats.bootstrap_means(values, weights, 400, 0)
    assert reps.shape == (400, 2)
    for j in range(2):
        exact = stats.weighted_mean(values[:, j], weights[:, j])
        assert exact is not None and abs(reps[:, j].mean() - exact) < 0.01
    # Identical columns: every paired difference is exactly zero.
    same = stats.bootstrap_means(values[:, [0, 0]], np.ones((500, 2)), 200, 0)
    assert np.all(same[:, 0] == same[:, 1])
    # A column no resample can weigh is NaN, and has no interval.
    empty = stats.bootstrap_means(values[:, :1], np.zeros((500, 1)), 50, 0)
    assert np.isnan(empty).all() and stats.interval(0.0, empty[:, 0], 0.95) is None


def test_the_gate_judges_ten_thousand_items_a_model() -> None:
    # How fast is benchmarks/gate.py's question; here, that the figures at this size are right.
    n = 10_000
    ids = [str(i) for i in range(n)]
    rng = np.random.default_rng(0)
    items = {
        name: {
            SUITE: SuiteItems.of(
                ids,
                {m: (rng.random(n) < p).astype(float) for m in DIRECTIONS[SUITE]},
                slices={"lang": [LANG[i % N] for i in range(n)]},
            )
        }
        for name, p in ((BASE, 0.4), (CHAMPION, 0.7), (CANDIDATE, 0.72), (FP8, 0.72))
    }
    decision = decide(items, DIRECTIONS, GATE, [SUITE])
    # Accuracy 0.72 against 0.40 on 10,000 paired items is far outside any interval's width;
    # every metric of the suite is held to the champion and to the FP8 export.
    assert statuses(decision, "beats_base") == {"accuracy": "pass"}
    for rule in ("no_regression", "fp8_within"):
        assert set(statuses(decision, rule)) == set(DIRECTIONS[SUITE]), rule


# --- input errors -----------------------------------------------------------------------------


def test_a_primary_metric_no_suite_reports_is_an_error() -> None:
    with pytest.raises(GateError, match=r"gate.primary_metric='f1' is not reported"):
        judge(
            {BASE: BASE_40, CANDIDATE: CANDIDATE_80, FP8: CANDIDATE_80},
            GATE.model_copy(update={"primary_metric": "f1"}),
        )


def test_a_metric_without_a_direction_is_an_error() -> None:
    items = {
        m: {SUITE: s} for m, s in ((BASE, BASE_40), (CANDIDATE, CANDIDATE_80), (FP8, CANDIDATE_80))
    }
    with pytest.raises(GateError, match="higher_is_better"):
        decide(items, {SUITE: {"accuracy": True}}, GATE, [SUITE])


def test_models_scored_on_other_items_is_an_error() -> None:
    other = SuiteItems.of([str(i + 1) for i in range(N)], {"accuracy": [0.0] * N})
    with pytest.raises(GateError, match="scored on other items than the candidate"):
        judge({BASE: other, CANDIDATE: CANDIDATE_80, FP8: CANDIDATE_80})


# --- reading lm-eval's per-item values --------------------------------------------------------


def test_per_item_values_are_read_as_lm_eval_aggregates_them() -> None:
    assert scoring.per_item(True) == (1.0, 1.0)
    assert scoring.per_item(0.25) == (0.25, 1.0)
    assert scoring.per_item((True, False)) == (0.0, 1.0)  # counted, not invented
    assert scoring.per_item((False, True)) == (0.0, 0.0)  # not in the subset
    assert scoring.per_item([True, False, True, True]) == (0.75, 4.0)  # IFEval instructions
    assert scoring.per_item("a string") is None
    assert scoring.per_item({"f1": 1}) is None


def lm_eval_results(samples: list[dict], figures: dict[str, float]) -> dict:
    return {
        "samples": {"suite": samples},
        "results": {"suite": figures},
        "higher_is_better": {"suite": {"accuracy": True, "bleu": True}},
    }


def test_a_metric_lm_eval_does_not_average_is_refused_on_a_business_suite() -> None:
    samples = [
        {
            "doc_id": i,
            "doc": {"lang": "en"},
            "filter": "none",
            "metrics": ["accuracy", "bleu"],
            "accuracy": float(i % 2),
            "bleu": ("ref", "hyp"),
        }
        for i in range(4)
    ]
    results = lm_eval_results(samples, {"accuracy,none": 0.5, "bleu,none": 12.0})
    with pytest.raises(GateError, match=r"metric 'bleu'.*process_results must return"):
        scoring._read_suite(results, "suite", ("lang",), True, scoring.Scored())
    out = scoring.Scored()
    scoring._read_suite(results, "suite", (), False, out)
    assert set(out.items["suite"].values) == {"accuracy"}
    assert out.not_judged["suite/bleu"].startswith("not judged: per-item values of type tuple")
    assert out.scores["suite"] == {"accuracy": 0.5}


def test_per_item_means_must_reproduce_lm_eval_figures() -> None:
    samples = [
        {
            "doc_id": i,
            "doc": {"id": f"q{i}", "lang": "zh" if i else "en"},
            "filter": "none",
            "metrics": ["accuracy"],
            "accuracy": float(i % 2),
        }
        for i in range(4)
    ]
    out = scoring.Scored()
    scoring._read_suite(
        lm_eval_results(samples, {"accuracy,none": 0.5}), "suite", ("lang", "month"), True, out
    )
    found = out.items["suite"]
    assert found.ids == ("q0", "q1", "q2", "q3")  # the suite's own ids
    assert found.slices == {"lang": ("en", "zh", "zh", "zh")}  # no item has a month
    with pytest.raises(GateError, match="is not lm-eval's figure"):
        scoring._read_suite(
            lm_eval_results(samples, {"accuracy,none": 0.9}), "suite", (), True, scoring.Scored()
        )


def test_per_item_files_round_trip() -> None:
    found = regressed_in_zh()[CANDIDATE]
    back = scoring.items_from_records(scoring.item_records({SUITE: found}))[SUITE]
    assert back.ids == found.ids and back.slices == found.slices
    for metric in found.values:
        assert np.array_equal(back.values[metric], found.values[metric])
        assert np.array_equal(back.weights[metric], found.weights[metric])
