"""DPO pairs pass the filters SFT records pass, and each removal is counted with its reason.

A badcase with a correction gives an SFT chat (prompt + correction) and a preference pair
(chosen: the correction, rejected: the bad reply). The pair goes wherever its chat goes
(length, repetition, token limit, eval contamination, duplicates), and its rejected side is
filtered on its own. Real records through ``clean_pool`` and the tiny tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.clean_helpers import PARAMS, pool_line, write_pool
from tuneloop.data.chat import ChatTokenizer
from tuneloop.data.clean import DPO_CODE, dpo_pair, pair_verdicts
from tuneloop.data.clean_cache import CleanReport, clean_pool
from tuneloop.demo import domain

# The fast tier: no pipeline, server or rank.
pytestmark = pytest.mark.fast

GOOD = "[return] The Aurora kettle can be returned within 30 days."
EVAL_QUESTION = domain.eval_items(0, 1)[0].question


def badcase(question: str, bad: str, corrected: str | None = GOOD) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": question}],
        "bad_response": bad,
        "corrected_response": corrected,
        "source": "router-feedback",
    }


# question -> (badcase, what happens to its pair, and to its SFT chat)
CASES: dict[str, tuple[dict[str, Any], str, str]] = {
    "good": (badcase("Can I return the Aurora kettle?", "[return] 7 days."), "kept", "kept"),
    "short": (badcase("Return window, kettle?", "x"), "rejected_response_too_short", "kept"),
    "degenerate": (
        badcase("Kettle returns please", "no no no no no no no no no no no no no no no no"),
        "rejected_degenerate_repetition",
        "kept",
    ),
    "long": (
        badcase(
            "How long to return a kettle?", " ".join(str(i * 7919 % 10007) for i in range(150))
        ),
        "rejected_over_token_limit",
        "kept",
    ),
    "same": (badcase("kettle return time?", GOOD.upper()), "chosen_equals_rejected", "kept"),
    # The chat's own filters remove the pair with it, under the chat's reason.
    "short_fix": (
        badcase("kettle return days?", "[return] 7 days.", corrected="k"),
        "response_too_short",
        "response_too_short",
    ),
    "eval": (
        badcase(EVAL_QUESTION, "[return] 7 days."),
        "eval_contamination",
        "eval_contamination",
    ),
    "no_fix": (
        badcase("kettle?", "[return] 7 days.", corrected=None),
        None,
        "badcase_without_correction",
    ),
}


def clean(
    tmp_path: Path, tokenizer: ChatTokenizer, records: list[dict[str, Any]]
) -> tuple[CleanReport, list[dict[str, Any]], list[dict[str, Any]]]:
    write_pool(tmp_path / "pool", [[pool_line(r) for r in records]])
    out = tmp_path / "out"
    out.mkdir()
    report = clean_pool(
        tmp_path / "pool", tmp_path / "cache", out, [EVAL_QUESTION], PARAMS, tokenizer
    )
    read = [
        [json.loads(line) for line in (out / name).read_text().splitlines()]
        for name in ("train.jsonl", "dpo.jsonl")
    ]
    val = [json.loads(line) for line in (out / "val.jsonl").read_text().splitlines()]
    return report, read[0] + val, read[1]


def test_each_pair_is_kept_or_removed_with_its_reason(
    tmp_path: Path, tokenizer: ChatTokenizer
) -> None:
    report, chats, pairs = clean(tmp_path, tokenizer, [case for case, _, _ in CASES.values()])
    prompts = {p["prompt"][-1]["content"] for p in pairs}
    assert prompts == {CASES["good"][0]["messages"][0]["content"]}
    assert report.dpo_pairs == 1
    expected_pairs = [fate for _, fate, _ in CASES.values() if fate not in (None, "kept")]
    assert dict(report.dpo_removed) == {reason: 1 for reason in expected_pairs}
    # A pair removed for its rejected side leaves its SFT chat (the correction) in training.
    questions = {c["messages"][0]["content"] for c in chats}
    kept_chats = {
        case["messages"][0]["content"] for case, _, chat in CASES.values() if chat == "kept"
    }
    assert questions == kept_chats
    removed = [chat for _, _, chat in CASES.values() if chat != "kept"]
    assert dict(report.removed) == {reason: removed.count(reason) for reason in removed}
    # Every badcase with a correction is a pair: kept, or counted once.
    with_pair = sum(1 for case, _, _ in CASES.values() if case["corrected_response"] is not None)
    assert report.dpo_pairs + sum(report.dpo_removed.values()) == with_pair


def test_a_pair_whose_chat_repeats_an_earlier_one_is_a_duplicate(
    tmp_path: Path, tokenizer: ChatTokenizer
) -> None:
    first = badcase("Can I return the Aurora kettle?", "[return] 7 days.")
    again = badcase("Can I return the Aurora kettle?", "[return] 90 days.")  # same chat
    report, chats, pairs = clean(tmp_path, tokenizer, [first, again])
    assert len(pairs) == 1 and pairs[0]["rejected"] == "[return] 7 days."
    assert dict(report.dpo_removed) == {"exact_duplicate": 1}
    assert len(chats) == 1


def test_pair_verdicts_check_the_rejected_side_only_where_the_chat_passed(
    tokenizer: ChatTokenizer,
) -> None:
    records = [pool_line(CASES[name][0]) for name in ("short", "long", "good")]
    pairs = [dpo_pair(r) for r in records]
    passed = pair_verdicts(pairs, np.zeros(3, dtype=np.uint8), PARAMS, tokenizer)
    assert passed.tolist() == [
        DPO_CODE["rejected_response_too_short"],
        DPO_CODE["rejected_over_token_limit"],
        0,
    ]
    # A chat already removed decides for its pair: no second verdict.
    removed = pair_verdicts(pairs, np.array([3, 3, 3], dtype=np.uint8), PARAMS, tokenizer)
    assert removed.tolist() == [0, 0, 0]
