"""Fixed badcases stay fixed: the regression suite from the pool, and the gate's rule on it.

The suite is built by the real ``fixed_badcases`` stage from a pool of ingested records; the
gate's rule runs on per-item scores whose answer is known; clean is run for real to show a
correction in the suite is still trained on (the suite is not a held-out one).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stages import fixed_badcases
from tests.clean_helpers import PARAMS, pool_line, write_pool
from tests.gate_helpers import DIRECTIONS, GATE, IDS, SUITE, N, right, suite
from tests.helpers import ROOT, write_params
from tuneloop.data.chat import ChatTokenizer
from tuneloop.data.clean_cache import clean_pool
from tuneloop.demo import domain, tiny
from tuneloop.io import read_jsonl, read_model, write_json
from tuneloop.judge import suites
from tuneloop.judge.decision import FixedBadcases
from tuneloop.judge.fixed_badcases import FixedBadcasesMetrics
from tuneloop.judge.gate import (
    BASE,
    CANDIDATE,
    CHAMPION,
    FP8,
    SuiteItems,
    decide,
    scores_of,
)
from tuneloop.judge.gate_report import report
from tuneloop.params import load_params
from tuneloop.tracking import init_from

# The fast tier: no pipeline, server or rank.
pytestmark = pytest.mark.fast

FIXED = "fixed_badcases"
MONTH1, MONTH2 = "20260001T000000000000Z", "20260101T000000000000Z"  # write_pool's names


def feedback(question: str, corrected: str | None, **extra: Any) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": question}],
        "bad_response": "[unknown] We do not sell that.",
        "corrected_response": corrected,
        "source": "router-feedback",
        "arm": "champion",
        "model_version": "1",
        **extra,
    }


KETTLE = "[return] The Aurora kettle can be returned within 30 days."
MONTH_1 = [
    feedback("My Aurora kettle leaks, may it still go back to you?", KETTLE),
    feedback("Warranty of the Nimbus vacuum?", "[warranty] 24 months."),
    feedback("Shipping time, Zephyr fan?", "[shipping] 1 day."),
    feedback("Is the Echo speaker waterproof?", None),  # no correction: not a test
    {
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "[greeting] Hello!"},
            {"role": "user", "content": "Return the Comet blender?"},
        ],
        "bad_response": "no",
        "corrected_response": "[return] 30 days.",
        "source": "router-feedback",
    },
]
MONTH_2 = [
    # The same fix again: it stays dated from month 1.
    feedback("my aurora kettle leaks, may it still go back to you?", KETTLE, arm="challenger"),
    # The policy changed: the newer correction replaces the old item, and is not a test yet.
    feedback("Warranty of the Nimbus vacuum?", "[warranty] 36 months."),
    feedback("Shipping time for Nova earbuds?", "[shipping] 2 days."),  # new this month
]


@pytest.fixture
def project(tmp_path: Path) -> Iterator[Path]:
    shutil.copytree(ROOT / "eval", tmp_path / "eval", ignore=shutil.ignore_patterns("test.jsonl"))
    for name in ("support_demo", "general_demo"):
        shutil.copy(ROOT / "eval" / name / "test.jsonl", tmp_path / "eval" / name / "test.jsonl")
    write_params(tmp_path)
    write_pool(
        tmp_path / "data/pool", [[pool_line(r) for r in MONTH_1], [pool_line(r) for r in MONTH_2]]
    )
    previous = Path.cwd()
    os.chdir(tmp_path)
    try:
        yield tmp_path
    finally:
        os.chdir(previous)


def built(version: str | None, *batches: str) -> tuple[list[dict[str, Any]], FixedBadcasesMetrics]:
    """The suite for the champion ``version`` (None: none yet) that trained on ``batches``."""
    params = load_params()
    start = init_from.Start("base", "train.init_from is base")
    champion = None if version is None else init_from.Champion(version, None, batches)
    init = init_from.stage_metrics(start, champion)
    write_json(params.paths.metrics / "init.json", init.model_dump())
    fixed_badcases.main()
    items = list(read_jsonl(params.paths.fixed_badcases / "test.jsonl"))
    return items, read_model(params.paths.metrics / "fixed_badcases.json", FixedBadcasesMetrics)


def test_the_suite_holds_the_corrections_the_champion_trained_on(project: Path) -> None:
    items, metrics = built("2", MONTH1)
    assert sorted((i["question"], i["answer"]) for i in items) == [
        ("My Aurora kettle leaks, may it still go back to you?", KETTLE),
        ("Shipping time, Zephyr fan?", "[shipping] 1 day."),
    ]
    assert all(i["batch"] == MONTH1 and i["source"] == "router-feedback" for i in items)
    assert metrics.items == 2 and metrics.champion_version == "2"
    assert metrics.left_out == {
        "not_one_user_turn": 1,
        "superseded_by_a_newer_correction": 1,
        # the new warranty answer and the earbuds: training data this month, tests next month
        "not_trained_on_by_the_champion": 2,
    }
    # The next month: the champion trained on both batches, and the suite grew.
    grown, _ = built("3", MONTH1, MONTH2)
    assert len(grown) == 4
    assert {i["answer"] for i in grown} >= {"[warranty] 36 months.", "[shipping] 2 days."}
    assert "[warranty] 24 months." not in {i["answer"] for i in grown}


def test_no_champion_means_an_empty_suite(project: Path) -> None:
    items, metrics = built(None)
    assert items == [] and metrics.items == 0 and metrics.champion_version is None
    # The registered base as champion trained on no pool batch: empty too.
    assert built("1")[0] == []


def test_corrections_in_the_suite_are_still_trained_on(project: Path, tmp_path: Path) -> None:
    built("2", MONTH1)
    params = load_params()
    questions = [
        q
        for _, q in suites.held_out_questions(params.paths.eval_suites, params.paths.fixed_badcases)
    ]
    assert "My Aurora kettle leaks, may it still go back to you?" not in questions
    assert len(questions) == sum(
        1 for _ in suites.questions(params.paths.eval_suites, skip=(FIXED,))
    )
    folder = tmp_path / "tokenizer"
    tiny.build_tokenizer(domain.tokenizer_corpus(0), 512).save_pretrained(folder)
    out = tmp_path / "out"
    out.mkdir()
    report_ = clean_pool(
        params.paths.pool,
        tmp_path / "cache",
        out,
        questions,
        PARAMS,
        ChatTokenizer.from_folder(folder),
    )
    trained = {
        json.loads(line)["messages"][0]["content"]
        for name in ("train.jsonl", "val.jsonl")
        for line in (out / name).read_text().splitlines()
    }
    assert "My Aurora kettle leaks, may it still go back to you?" in trained
    assert "eval_contamination" not in report_.removed
    # Held out as the other suites are, the same corrections would be removed.
    fixed = params.paths.fixed_badcases / "test.jsonl"
    everything = [*questions, *(json.loads(line)["question"] for line in fixed.open())]
    shutil.rmtree(out)
    out.mkdir()
    leaked = clean_pool(
        params.paths.pool,
        tmp_path / "cache",
        out,
        everything,
        PARAMS,
        ChatTokenizer.from_folder(folder),
    )
    assert leaked.removed["eval_contamination"] >= 2


# --- the gate's rule --------------------------------------------------------------------------


def items_with_fixed(
    champion: list[float], candidate: list[float]
) -> dict[str, dict[str, SuiteItems]]:
    good = suite(right(range(150)))
    ids = [f"fix-{i}" for i in range(len(champion))]
    return {
        BASE: {SUITE: suite(right(range(100)))},
        CHAMPION: {SUITE: good, FIXED: SuiteItems.of(ids, {"accuracy": champion})},
        CANDIDATE: {SUITE: good, FIXED: SuiteItems.of(ids, {"accuracy": candidate})},
        FP8: {SUITE: good},
    }


def test_breaking_more_fixes_than_allowed_fails_the_gate() -> None:
    # The champion answers 8 of 10 right; the candidate breaks 4 of those (and fixes one more).
    champion = [1.0] * 8 + [0.0] * 2
    candidate = [0.0] * 4 + [1.0] * 4 + [1.0, 0.0]
    decision = decide(
        items_with_fixed(champion, candidate),
        DIRECTIONS | {FIXED: {"accuracy": True}},
        GATE,
        [SUITE],
        fixed_badcases=FIXED,
    )
    assert decision.verdict == "fail"
    fixed_ = decision.fixed_badcases
    assert (fixed_.items, fixed_.fixed_by_champion, fixed_.broken) == (10, 8, 4)
    assert fixed_.broken_ids == ["fix-0", "fix-1", "fix-2", "fix-3"]
    assert decision.failed == [
        f"{FIXED}: the champion answers 8 of 10 corrected badcases right; the candidate breaks "
        "4 of them, allowed 3: FAIL (broken: fix-0, fix-1, fix-2, fix-3)"
    ]
    assert decision.thresholds.max_broken_fixes == 3
    text = report(scores_of(items_with_fixed(champion, candidate)), decision, DIRECTIONS)
    assert "## Fixed badcases: fixed_badcases (10 items, max_broken_fixes 3)" in text
    assert "breaks 4 of them: **fail**" in text


def test_breaking_up_to_the_allowance_passes() -> None:
    champion = [1.0] * 8 + [0.0] * 2
    candidate = [0.0] * 3 + [1.0] * 7  # 3 broken; the 2 the champion missed do not count
    decision = decide(
        items_with_fixed(champion, candidate),
        DIRECTIONS | {FIXED: {"accuracy": True}},
        GATE,
        [SUITE],
        fixed_badcases=FIXED,
    )
    assert decision.verdict == "pass", decision.failed
    assert decision.fixed_badcases.broken == 3
    check = next(c for c in decision.checks if c.rule == "fixed_badcases")
    assert check.status == "pass" and check.items == 8
    assert any(r.startswith(f"{FIXED}: the champion answers 8 of 10") for r in decision.reasons)


def test_an_empty_suite_is_said_and_judges_nothing() -> None:
    good = suite(right(range(150)))
    items = {BASE: {SUITE: suite(right(range(100)))}, CANDIDATE: {SUITE: good}, FP8: {SUITE: good}}
    decision = decide(items, DIRECTIONS, GATE, [SUITE])
    assert decision.verdict == "pass"
    assert decision.fixed_badcases == FixedBadcases(suite=None, items=0, status="empty")
    assert any("fixed badcases: the suite is empty" in r for r in decision.reasons)
    assert not [c for c in decision.checks if c.rule == "fixed_badcases"]
    assert len(IDS) == N


def test_fixes_are_judged_on_the_answer_whatever_the_primary_metric() -> None:
    """A team gating on the reply format still keeps corrected answers correct: the suite
    scores accuracy only, and the rule reads it (it once asked for the primary metric)."""
    champion = [1.0] * 8 + [0.0] * 2
    candidate = [0.0] * 4 + [1.0] * 4 + [1.0, 0.0]
    decision = decide(
        items_with_fixed(champion, candidate),
        DIRECTIONS | {FIXED: {"accuracy": True}},
        GATE.model_copy(update={"primary_metric": "format_compliance"}),
        [SUITE],
        fixed_badcases=FIXED,
    )
    fixed_ = decision.fixed_badcases
    assert (fixed_.fixed_by_champion, fixed_.broken, fixed_.status) == (8, 4, "fail")
