"""DPO pairs pass the SFT filters: planted bad pairs are removed, each with its counted reason."""

from __future__ import annotations

from collections import Counter

from stages.clean import clean
from tests.conftest import ROOT
from tuneloop.params import CleanParams, load_params
from tuneloop.records import Message, PoolRecord

PARAMS = CleanParams(
    **load_params(ROOT / "params.yaml").clean.model_dump()
    | {"max_tokens": 64, "min_response_chars": 2, "pilot_fraction": 1.0}
)
EVAL = ["How long is the warranty on the Comet blender I bought last spring?"]
LONG_ANSWER = (
    "[shipping] The Summit tent ships from our northern warehouse within seven working days, "
    "and you will get a tracking number by e-mail as soon as the parcel leaves the building."
)


def words(messages: list[dict[str, str]]) -> int:
    """A stand-in tokenizer: one token a word."""
    return sum(len(m["content"].split()) for m in messages)


def badcase(pair_id: str, prompt: str, chosen: str | None, rejected: str) -> PoolRecord:
    return PoolRecord(
        id=pair_id,
        kind="badcase",
        messages=[Message(role="user", content=prompt)],
        bad_response=rejected,
        corrected_response=chosen,
        meta={},
        provenance={},
    )


GOOD = [
    badcase(
        "good-return",
        "Can I return the Aurora kettle after three weeks?",
        "[return] Yes, the Aurora kettle can be returned within 30 days of delivery.",
        "[return] No, kettles can never be returned once opened.",
    ),
    badcase(
        "good-shipping", "When will my Summit tent arrive?", LONG_ANSWER, "[shipping] Tomorrow."
    ),
]
SPEC = "[warranty] " + " ".join(f"part{n}" for n in range(70))  # 71 words, each different
EVAL_Q = EVAL[0]
# (id, prompt, chosen, rejected, why it must go)
PLANTED = [
    ("short-chosen", "Is the Zephyr fan quiet?", "k", "[unknown] Never heard of it.",
     "response_too_short"),
    ("short-rejected", "Is the Echo speaker loud?", "[warranty] It is rated at 85 dB.", "x",
     "response_too_short"),
    ("degenerate-chosen", "Can I cancel order 12345?", "sorry " * 20, "[return] No.",
     "degenerate_repetition"),
    ("degenerate-rejected", "Does the Orbit watch float?", "[unknown] Water resistant to 50 m.",
     "ha ha " * 20, "degenerate_repetition"),
    ("over-tokens", "Tell me everything about the Cedar chair.", SPEC, "[unknown] No.",
     "over_token_limit"),
    ("eval-exact", f"  {EVAL_Q.upper()} ", "[warranty] 18 months.", "[warranty] 2 years.",
     "eval_contamination"),
    ("eval-near", EVAL_Q + "?", "[warranty] 18 months.", "[warranty] 1 year.",
     "eval_contamination"),
    ("exact-dup", "can i return the aurora kettle  after three weeks?",
     GOOD[0].corrected_response, GOOD[0].bad_response, "exact_duplicate"),
    ("near-dup", "When will my Summit tent arrive?", LONG_ANSWER.replace("seven", "7"),
     "[shipping] Tomorrow.", "near_duplicate"),
]  # fmt: skip
PLANTED_RECORDS = [badcase(*spec[:4]) for spec in PLANTED]


def test_planted_bad_pairs_are_removed_with_their_reasons() -> None:
    no_correction = badcase("no-correction", "Is the Pixel camera waterproof?", None, "Yes.")
    records = [*GOOD, *PLANTED_RECORDS, no_correction]
    result = clean(records, EVAL, PARAMS, words)
    assert [pair["id"] for pair in result.dpo] == ["good-return", "good-shipping"]
    assert result.dpo_removed == Counter(spec[-1] for spec in PLANTED)
    # Every badcase with a correction is a pair kept or a pair removed; one without is neither.
    assert len(result.dpo) + sum(result.dpo_removed.values()) == len(GOOD) + len(PLANTED)
    pair = result.dpo[0]
    assert pair["prompt"] == [{"role": "user", "content": GOOD[0].messages[0].content}]
    assert (pair["chosen"], pair["rejected"]) == (
        GOOD[0].corrected_response,
        GOOD[0].bad_response,
    )


def test_pair_filters_leave_the_sft_accounting_alone() -> None:
    records = [*GOOD, *PLANTED_RECORDS]
    result = clean(records, EVAL, PARAMS, words)
    kept = len(result.train) + len(result.val)
    assert kept + sum(result.removed.values()) == result.records_in == len(records)
    # The SFT side sees prompt + correction only: a bad rejected answer does not remove it.
    sft_ids = {s["messages"][-1]["content"] for s in result.train + result.val}
    assert "[warranty] It is rated at 85 dB." in sft_ids
