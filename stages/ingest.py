"""Stage ``ingest``: production badcases and exports into the append-only pool.

Reads:  every ``*.jsonl`` under ``paths.incoming``; the pool so far.
Writes: one new batch file under ``paths.pool``/records (accepted records, each
        with its provenance) and one under ``paths.pool``/quarantine (rejected
        lines with file, line number and reason); ``metrics/ingest.json``.
Params: ``ingest``, ``paths``.

PII (e-mail, phone numbers, Chinese resident IDs, bank cards, IP addresses) is
replaced by typed placeholders before a record is hashed or stored.

Every non-blank line ends in exactly one of: accepted, quarantined, or counted
as a duplicate of a record already in the pool, so
``lines = accepted + quarantined + duplicates`` holds on every run. Nothing in
the pool is ever rewritten: a run adds new files, atomically, or nothing.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tuneloop import pii
from tuneloop.io import read_jsonl, write_jsonl
from tuneloop.params import load_params
from tuneloop.records import (
    Badcase,
    Chat,
    InvalidRecord,
    Message,
    PoolRecord,
    content_hash,
    parse_record,
    pool_ids,
)
from tuneloop.stage import logged_after, setup_logging, write_metrics

STAGE = "ingest"
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Line:
    file: str
    number: int
    raw: bytes


@dataclass
class IngestResult:
    accepted: list[PoolRecord] = field(default_factory=list)
    quarantined: list[dict[str, Any]] = field(default_factory=list)
    duplicates: int = 0
    blank: int = 0
    reasons: Counter[str] = field(default_factory=Counter)
    pii: Counter[str] = field(default_factory=Counter)

    @property
    def lines(self) -> int:
        return len(self.accepted) + len(self.quarantined) + self.duplicates


def read_lines(incoming: Path) -> Iterator[Line]:
    """Raw lines of every incoming file in a stable order; bytes, so bad UTF-8 is seen, not lost."""
    for path in sorted(incoming.rglob("*.jsonl")):
        with path.open("rb") as lines:
            for number, raw in enumerate(lines, start=1):
                yield Line(str(path.relative_to(incoming)), number, raw)


def decode(line: Line, max_line_bytes: int) -> Any:
    """The JSON value of a line, or InvalidRecord saying why it has none."""
    raw = line.raw.rstrip(b"\r\n")
    if len(raw) > max_line_bytes:
        raise InvalidRecord(
            "line_too_long",
            f"line over the size limit: {len(raw)} bytes > ingest.max_line_bytes={max_line_bytes}",
        )
    if line.number == 1 and raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]  # a UTF-8 byte-order mark that some exporters write
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise InvalidRecord(
            "invalid_utf8", f"invalid UTF-8 at byte {error.start}; re-export the file as UTF-8"
        ) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise InvalidRecord("bad_json", f"bad JSON: {error.msg} at column {error.colno}") from None


def scrub_record(record: Chat | Badcase) -> tuple[Chat | Badcase, Counter[str]]:
    """The record with PII replaced by typed placeholders in every text field, and the counts."""
    found: Counter[str] = Counter()

    def clean(text: str) -> str:
        scrubbed, counts = pii.scrub(text)
        found.update(counts)
        return scrubbed

    messages = [Message(role=m.role, content=clean(m.content)) for m in record.messages]
    if isinstance(record, Badcase):
        corrected = record.corrected_response
        return record.model_copy(
            update={
                "messages": messages,
                "bad_response": clean(record.bad_response),
                "corrected_response": clean(corrected) if corrected is not None else None,
            }
        ), found
    return record.model_copy(update={"messages": messages}), found


def ingest(lines: Iterator[Line], known: set[str], max_line_bytes: int, now: str) -> IngestResult:
    """Sort every line into accepted, quarantined or duplicate.

    ``known`` holds the content hashes of the pool's records and the raw-line
    hashes of lines quarantined before: a line seen before, good or bad, is a
    duplicate, so ingesting the same file twice adds nothing.
    """
    result = IngestResult()
    seen = set(known)
    for line in lines:
        if not line.raw.strip():
            result.blank += 1
            continue
        raw_digest = "raw:" + hashlib.sha256(line.raw.rstrip(b"\r\n")).hexdigest()
        if raw_digest in seen:
            result.duplicates += 1
            continue
        try:
            record = parse_record(decode(line, max_line_bytes))
        except InvalidRecord as error:
            reason = str(error)
            result.reasons[error.kind] += 1
            excerpt = line.raw[:200].decode("utf-8", errors="replace")
            seen.add(raw_digest)
            result.quarantined.append(
                {
                    "file": line.file,
                    "line": line.number,
                    "reason": reason,
                    "kind": error.kind,
                    "excerpt": excerpt,
                    "sha256": raw_digest,
                    "ingested_at": now,
                }
            )
            continue
        record, found = scrub_record(record)
        result.pii.update(found)
        digest = content_hash(record)
        if digest in seen:
            result.duplicates += 1
            continue
        seen.add(digest)
        meta = record.model_dump(include={"source", "model_version", "arm", "created_at", "tags"})
        result.accepted.append(
            PoolRecord(
                id=digest,
                kind="badcase" if isinstance(record, Badcase) else "chat",
                messages=record.messages,
                bad_response=record.bad_response if isinstance(record, Badcase) else None,
                corrected_response=(
                    record.corrected_response if isinstance(record, Badcase) else None
                ),
                meta=meta,
                provenance={
                    "file": line.file,
                    "line": line.number,
                    "sha256": digest,
                    "ingested_at": now,
                },
            )
        )
    return result


def known_hashes(pool: Path) -> set[str]:
    """Content hashes of pooled records and raw hashes of quarantined lines."""
    known = pool_ids(pool)
    for path in sorted((pool / "quarantine").glob("*.jsonl")):
        known.update(entry["sha256"] for entry in read_jsonl(path))
    return known


def main() -> None:
    setup_logging()
    params = load_params()
    pool = params.paths.pool
    with logged_after(STAGE, params):
        known = known_hashes(pool)
        pooled = sum(1 for key in known if not key.startswith("raw:"))
        now = dt.datetime.now(dt.UTC)
        result = ingest(
            read_lines(params.paths.incoming),
            known,
            params.ingest.max_line_bytes,
            now.isoformat(timespec="seconds"),
        )
        reject_rate = len(result.quarantined) / max(result.lines, 1)
        metrics = {
            "lines": result.lines,
            "accepted": len(result.accepted),
            "quarantined": len(result.quarantined),
            "duplicates": result.duplicates,
            "blank_lines": result.blank,
            "reject_rate": round(reject_rate, 6),
            "quarantine_reasons": dict(result.reasons),
            "pii_scrubbed": {kind: result.pii.get(kind, 0) for kind in pii.PII_TYPES},
            "pool_records": pooled + len(result.accepted),
        }
        log.info(
            "ingest: %d lines -> %d accepted, %d quarantined, %d duplicates",
            result.lines,
            len(result.accepted),
            len(result.quarantined),
            result.duplicates,
        )
        if reject_rate > params.ingest.max_reject_rate:
            # Nothing enters the pool from a batch this bad: fix the export, then ingest again.
            rejected = params.paths.reports / "ingest-rejected.jsonl"
            write_jsonl(rejected, result.quarantined)
            write_metrics(params, STAGE, metrics | {"pool_records": pooled})
            raise SystemExit(
                f"ingest: {reject_rate:.1%} of lines were rejected, over "
                f"ingest.max_reject_rate={params.ingest.max_reject_rate:.1%}; the pool is "
                f"unchanged. Each rejected line and its reason: {rejected}"
            )
        batch = now.strftime("%Y%m%dT%H%M%S%fZ")
        (pool / "records").mkdir(parents=True, exist_ok=True)
        if result.quarantined:
            write_jsonl(pool / "quarantine" / f"{batch}.jsonl", result.quarantined)
        if result.accepted:
            write_jsonl(
                pool / "records" / f"{batch}.jsonl",
                (r.model_dump(mode="json") for r in result.accepted),
            )
        write_metrics(params, STAGE, metrics)


if __name__ == "__main__":
    main()
