"""Stage ``clean``: pooled records into training chats, a validation split and DPO pairs.

Reads:  ``paths.pool`` records; eval suite items under ``paths.eval_suites``; the
        base model's tokenizer (for the token limit).
Writes: ``paths.clean``/train.jsonl, val.jsonl (``{"id", "messages"}``), dpo.jsonl
        (``{"id", "prompt", "chosen", "rejected"}``), manifest.json;
        ``metrics/clean.json``.
Params: ``clean``, ``paths``.

Every pooled record is accounted for: kept, or removed with a counted reason
(reply too short, degenerate repetition, over the token limit, an eval item's
near-duplicate, an exact or near duplicate, outside the pilot sample). A DPO
pair (a badcase with its correction) passes the same filters, on its prompt
with each of its two answers, and its removals are counted apart
(``dpo_removed``).
The split is by content hash, so a sample never moves between train and val
from one month to the next.
"""

from __future__ import annotations

import hashlib
import logging
import re
import unicodedata
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tuneloop import lineage, suites
from tuneloop.chat import render
from tuneloop.io import atomic_dir, write_json, write_jsonl
from tuneloop.models import base_model_ref, load_tokenizer
from tuneloop.neardup import NearDupIndex
from tuneloop.params import CleanParams, load_params
from tuneloop.records import PoolRecord, pool_records
from tuneloop.stage import setup_logging, write_metrics
from tuneloop.tracking import stage_run

STAGE = "clean"
log = logging.getLogger(__name__)


def normalise(text: str) -> str:
    text = unicodedata.normalize("NFKC", text).lower()
    return re.sub(r"\s+", " ", text).strip()


def text_key(messages: list[dict[str, str]]) -> str:
    joined = "\n".join(f"{m['role']}: {normalise(m['content'])}" for m in messages)
    return hashlib.sha256(joined.encode()).hexdigest()


def hash_fraction(key: str, salt: str) -> float:
    """A stable number in [0, 1) from a key: the same sample lands on the same side every month."""
    return int(hashlib.sha256(f"{salt}:{key}".encode()).hexdigest()[:12], 16) / 16**12


@dataclass
class CleanResult:
    train: list[dict[str, Any]] = field(default_factory=list)
    val: list[dict[str, Any]] = field(default_factory=list)
    dpo: list[dict[str, Any]] = field(default_factory=list)
    removed: Counter[str] = field(default_factory=Counter)
    dpo_removed: Counter[str] = field(default_factory=Counter)
    records_in: int = 0


TokenCounter = Callable[[list[dict[str, str]]], int]


def to_chat(record: PoolRecord) -> list[dict[str, str]] | None:
    """The conversation to learn from: a chat as is; a badcase with its correction as the reply."""
    messages = [m.model_dump() for m in record.messages]
    if record.kind == "chat":
        return messages
    if record.corrected_response is None:
        return None
    return [*messages, {"role": "assistant", "content": record.corrected_response}]


def distinct_ngram_share(text: str, n: int = 4) -> float:
    """Share of distinct character n-grams: near 0 for 'ok ok ok ok ...', near 1 for prose."""
    grams = [text[i : i + n] for i in range(len(text) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 1.0


def filter_reason(
    messages: list[dict[str, str]], params: CleanParams, count_tokens: TokenCounter
) -> str | None:
    """Why a conversation is not fit to train on, or None."""
    replies = [m["content"].strip() for m in messages if m["role"] == "assistant"]
    if min(len(r) for r in replies) < params.min_response_chars:
        return "response_too_short"
    if any(len(r) >= 40 and distinct_ngram_share(r) < params.min_distinct_ngrams for r in replies):
        return "degenerate_repetition"
    if count_tokens(messages) > params.max_tokens:
        return "over_token_limit"
    return None


def user_text(messages: list[dict[str, str]]) -> str:
    return "\n".join(m["content"] for m in messages if m["role"] == "user")


def to_pair(record: PoolRecord) -> dict[str, Any] | None:
    """The DPO pair a badcase with a correction gives: its prompt, the correction, the bad reply."""
    if record.kind != "badcase" or record.corrected_response is None:
        return None
    return {
        "id": record.id,
        "prompt": [m.model_dump() for m in record.messages],
        "chosen": record.corrected_response,
        "rejected": record.bad_response,
    }


def pair_filter_reason(
    pair: dict[str, Any],
    params: CleanParams,
    count_tokens: TokenCounter,
    in_eval: Callable[[str], bool],
    seen: set[str],
    near_dups: NearDupIndex,
) -> str | None:
    """Why a DPO pair is not fit to train on, or None (then it is remembered for dedup).

    The SFT filters, each on the prompt with the chosen and with the rejected
    answer as its reply: both conversations are what DPO trains on.
    """
    prompt = pair["prompt"]
    for reply in (pair["chosen"], pair["rejected"]):
        messages = [*prompt, {"role": "assistant", "content": reply}]
        if reason := filter_reason(messages, params, count_tokens):
            return reason
    if any(in_eval(m["content"]) for m in prompt if m["role"] == "user"):
        return "eval_contamination"
    both = [*prompt, {"role": "chosen", "content": pair["chosen"]}]
    both.append({"role": "rejected", "content": pair["rejected"]})
    key = text_key(both)
    if key in seen:
        return "exact_duplicate"
    seen.add(key)
    text = "\n".join(m["content"] for m in both)
    if near_dups.query(text):
        return "near_duplicate"
    near_dups.add(key, text)
    if hash_fraction(key, "pilot") >= params.pilot_fraction:
        return "not_in_pilot"
    return None


def clean(
    records: list[PoolRecord],
    eval_questions: list[str],
    params: CleanParams,
    count_tokens: TokenCounter,
) -> CleanResult:
    """Every pooled record ends kept (train or val) or removed with a counted reason."""
    result = CleanResult(records_in=len(records))
    exact_eval = {normalise(q) for q in eval_questions}
    eval_index = NearDupIndex(params.decontam_threshold)
    for number, question in enumerate(eval_questions):
        eval_index.add(str(number), question)
    near_dups = NearDupIndex(params.near_dup_threshold)
    seen: set[str] = set()
    dpo_near_dups = NearDupIndex(params.near_dup_threshold)
    dpo_seen: set[str] = set()

    def in_eval(user: str) -> bool:
        return normalise(user) in exact_eval or bool(eval_index.query(user))

    for record in records:
        if pair := to_pair(record):
            reason = pair_filter_reason(
                pair, params, count_tokens, in_eval, dpo_seen, dpo_near_dups
            )
            if reason:
                result.dpo_removed[reason] += 1
            else:
                result.dpo.append(pair)
        messages = to_chat(record)
        if messages is None:
            result.removed["badcase_without_correction"] += 1
            continue
        if reason := filter_reason(messages, params, count_tokens):
            result.removed[reason] += 1
            continue
        users = [m["content"] for m in messages if m["role"] == "user"]
        if any(in_eval(u) for u in users):
            result.removed["eval_contamination"] += 1
            continue
        key = text_key(messages)
        if key in seen:
            result.removed["exact_duplicate"] += 1
            continue
        seen.add(key)
        text = "\n".join(m["content"] for m in messages)
        if near_dups.query(text):
            result.removed["near_duplicate"] += 1
            continue
        near_dups.add(key, text)
        if hash_fraction(key, "pilot") >= params.pilot_fraction:
            result.removed["not_in_pilot"] += 1
            continue
        sample = {"id": key[:16], "messages": messages}
        is_val = hash_fraction(key, "val") < params.val_fraction
        (result.val if is_val else result.train).append(sample)
    return result


def main() -> None:
    setup_logging()
    params = load_params()
    with stage_run(STAGE, params):
        records = list(pool_records(params.paths.pool))
        eval_questions = [q for _, q in suites.questions(params.paths.eval_suites)]
        tokenizer = load_tokenizer(base_model_ref(params))

        def count_tokens(messages: list[dict[str, str]]) -> int:
            return len(tokenizer(render(tokenizer, messages), add_special_tokens=False).input_ids)

        result = clean(records, eval_questions, params.clean, count_tokens)
        if not result.train:
            raise SystemExit(
                f"clean: no training sample left from {result.records_in} pooled records "
                f"(removed: {dict(result.removed)}); ingest more data or relax params 'clean'"
            )
        with atomic_dir(params.paths.clean) as out:
            write_jsonl(out / "train.jsonl", result.train)
            write_jsonl(out / "val.jsonl", result.val)
            write_jsonl(out / "dpo.jsonl", result.dpo)
            write_json(
                out / "manifest.json",
                lineage.manifest(STAGE, params, inputs={"pool": params.paths.pool}),
            )
        metrics = {
            "records_in": result.records_in,
            "train": len(result.train),
            "val": len(result.val),
            "dpo_pairs": len(result.dpo),
            "removed": dict(result.removed),
            "dpo_removed": dict(result.dpo_removed),
        }
        write_metrics(params, STAGE, metrics)
        log.info("clean: %s", metrics)


if __name__ == "__main__":
    main()
