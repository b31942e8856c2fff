"""Stage ``clean``: pooled records into training chats, a validation split and DPO pairs.

Reads:  ``paths.pool`` records; eval suite items under ``paths.eval_suites``.
Writes: ``paths.clean``/train.jsonl, val.jsonl (``{"id", "messages"}``), dpo.jsonl
        (``{"id", "prompt", "chosen", "rejected"}``), manifest.json;
        ``metrics/clean.json``.
Params: ``clean``, ``paths``.

Every pooled record is accounted for: kept, or removed with a counted reason.
The split is by content hash, so a sample never moves between train and val
from one month to the next.
"""

from __future__ import annotations

import hashlib
import logging
import re
import unicodedata
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from tuneloop import lineage, suites
from tuneloop.io import atomic_dir, write_json, write_jsonl
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
    records_in: int = 0


def to_chat(record: PoolRecord) -> list[dict[str, str]] | None:
    """The conversation to learn from: a chat as is; a badcase with its correction as the reply."""
    messages = [m.model_dump() for m in record.messages]
    if record.kind == "chat":
        return messages
    if record.corrected_response is None:
        return None
    return [*messages, {"role": "assistant", "content": record.corrected_response}]


def clean(records: list[PoolRecord], eval_questions: set[str], params: CleanParams) -> CleanResult:
    result = CleanResult(records_in=len(records))
    seen: set[str] = set()
    for record in records:
        if record.kind == "badcase" and record.corrected_response is not None:
            prompt = [m.model_dump() for m in record.messages]
            result.dpo.append(
                {
                    "id": record.id,
                    "prompt": prompt,
                    "chosen": record.corrected_response,
                    "rejected": record.bad_response,
                }
            )
        messages = to_chat(record)
        if messages is None:
            result.removed["badcase_without_correction"] += 1
            continue
        replies = [m["content"] for m in messages if m["role"] == "assistant"]
        if min(len(r.strip()) for r in replies) < params.min_response_chars:
            result.removed["response_too_short"] += 1
            continue
        if any(normalise(m["content"]) in eval_questions for m in messages if m["role"] == "user"):
            result.removed["eval_contamination"] += 1
            continue
        key = text_key(messages)
        if key in seen:
            result.removed["exact_duplicate"] += 1
            continue
        seen.add(key)
        if hash_fraction(key, "pilot") >= params.pilot_fraction:
            result.removed["not_in_pilot"] += 1
            continue
        sample = {"id": key[:16], "messages": messages}
        (result.val if hash_fraction(key, "val") < params.val_fraction else result.train).append(
            sample
        )
    return result


def main() -> None:
    setup_logging()
    params = load_params()
    with stage_run(STAGE, params):
        records = list(pool_records(params.paths.pool))
        eval_questions = {normalise(q) for _, q in suites.questions(params.paths.eval_suites)}
        result = clean(records, eval_questions, params.clean)
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
        }
        write_metrics(params, STAGE, metrics)
        log.info("clean: %s", metrics)


if __name__ == "__main__":
    main()
