"""Pool records and clean params shared by the clean tests (cache, DPO, fixed badcases)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tuneloop.data.records import Badcase, PoolRecord, content_hash, parse_record, task_records
from tuneloop.io import write_jsonl
from tuneloop.params import CleanParams

PARAMS = CleanParams(
    val_fraction=0.1,
    min_response_chars=2,
    max_tokens=96,
    min_distinct_ngrams=0.3,
    near_dup_threshold=0.9,
    decontam_threshold=0.8,
    pilot_fraction=1.0,
    replay_fraction=0.25,
)


def pool_line(data: dict[str, Any]) -> dict[str, Any]:
    record = parse_record(data)
    badcase = isinstance(record, Badcase)
    return PoolRecord(
        id=content_hash(record),
        kind="badcase" if badcase else "chat",
        messages=record.messages,
        bad_response=record.bad_response if isinstance(record, Badcase) else None,
        corrected_response=record.corrected_response if isinstance(record, Badcase) else None,
        meta={"source": record.source},
        provenance={},
    ).model_dump(mode="json")


def write_pool(pool: Path, batches: list[list[dict[str, Any]]], task: str = "support") -> None:
    """The batches as ingest pools them for ``task`` (params.yaml's one task)."""
    for number, batch in enumerate(batches):
        write_jsonl(task_records(pool, task) / f"2026{number:02d}01T000000000000Z.jsonl", batch)
