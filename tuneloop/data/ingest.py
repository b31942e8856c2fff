"""Ingest: sort incoming lines into the pool's records, its quarantine, or duplicates.

The logic of stage ``ingest`` (``stages/ingest.py``, which holds the pool's lock, loads the
params and writes the metrics). Every non-blank line ends in exactly one of: accepted,
quarantined, or counted as a duplicate of a record already in the pool, so
``lines = accepted + quarantined + duplicates`` holds on every run, and for each task's
folder on its own.

A line is decided by what it means, never by where it stands: by its bytes (a byte-order
mark before a line is dropped wherever it stands) and by the task its folder gives it
(``<incoming>/<task>/``). The same bytes in two tasks' folders are two records, one per
task, each deduplicated within its task. "Seen before" is the pair (folder's task, bytes)
too: a quarantined line is not ingested again from the same task's folder (the same
mistake twice is a duplicate), but refiled where its reason says (another task's folder,
or corrected) it is a new line and is decided anew.

PII (e-mail, phone numbers, Chinese resident IDs, bank cards, IP addresses) is replaced by
typed placeholders before anything is hashed or stored: every text and metadata field of a
record (tags, source, ...), the file name, and what is kept of a rejected line (its excerpt
and reason). A line too long to scrub keeps no excerpt, only its sha256 and byte offset.
"""

from __future__ import annotations

import datetime as dt
import functools
import hashlib
import itertools
import json
import multiprocessing
import os
from collections import Counter
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from tuneloop.data import pii
from tuneloop.data import pool as pool_writes
from tuneloop.data.metrics import FolderCounts, IngestMetrics
from tuneloop.data.records import (
    IDS_SUFFIX,
    META_FIELDS,
    InvalidRecord,
    PlainRecord,
    content_hash,
    ids_index,
    parse_plain,
    parse_record,
    plain,
    pool_ids,
    task_records,
)
from tuneloop.io import jsonl_text, read_jsonl, usable_cores

# The project's tasks (``params.tasks``, at least one), which ingest routes each record to.
Tasks = tuple[str, ...]

# What a quarantine entry keeps of a bad line, after scrubbing: enough to see what is wrong.
EXCERPT_CHARS = 200
REASON_CHARS = 300
TOO_DEEP = "JSON nested too deeply to read; records are a few levels deep"
# A line's outcomes, and the name ``metrics`` gives the lines in no task's folder.
OUTCOMES = ("accepted", "quarantined", "duplicates", "blank")
ELSEWHERE = "elsewhere"


@dataclass(frozen=True)
class Line:
    file: str
    number: int
    raw: bytes
    offset: int = 0  # of the line's first byte in its file


@dataclass
class IngestResult:
    # Each accepted record as its pool line (bytes, not objects: a month can be a million).
    accepted: list[bytes] = field(default_factory=list)
    accepted_ids: list[str] = field(default_factory=list)  # their ids (content hashes)
    accepted_tasks: list[str] = field(default_factory=list)  # their tasks
    by_source: Counter[str] = field(default_factory=Counter)
    quarantined: list[dict[str, Any]] = field(default_factory=list)
    duplicates: int = 0
    blank: int = 0
    reasons: Counter[str] = field(default_factory=Counter)
    pii: Counter[str] = field(default_factory=Counter)
    # Each line's outcome by the task whose folder it lies in (None: no task's folder).
    by_folder: dict[str | None, Counter[str]] = field(default_factory=dict)

    def count(self, folder: str | None, outcome: str) -> None:
        self.by_folder.setdefault(folder, Counter())[outcome] += 1

    @property
    def lines(self) -> int:
        return len(self.accepted) + len(self.quarantined) + self.duplicates

    @property
    def reject_rate(self) -> float:
        return len(self.quarantined) / max(self.lines, 1)


class LinkedFolder(ValueError):
    """A folder under incoming/ that is a symbolic link: its files would be passed over."""


def incoming_files(incoming: Path) -> list[Path]:
    """Every ``*.jsonl`` under ``incoming``, in a stable order; ``LinkedFolder`` names a
    linked folder, whose files ``rglob`` would pass over without a word."""
    files: list[Path] = []
    for folder, subfolders, names in os.walk(incoming):
        for name in subfolders:
            if (Path(folder) / name).is_symlink():
                link = Path(folder) / name
                raise LinkedFolder(
                    f"{link} is a link to a folder ({os.readlink(link)}): ingest follows no "
                    "linked folder, so its files would never be read; copy or move them in"
                )
        files += [Path(folder) / name for name in names if name.endswith(".jsonl")]
    return sorted(files)


def read_lines(incoming: Path) -> Iterator[Line]:
    """Raw lines of every incoming file in a stable order; bytes, so bad UTF-8 is seen, not lost."""
    for path in incoming_files(incoming):
        name = str(path.relative_to(incoming))
        with path.open("rb") as lines:
            offset = 0
            for number, raw in enumerate(lines, start=1):
                yield Line(name, number, raw, offset)
                offset += len(raw)


def _text(line: Line, max_line_bytes: int) -> str:
    """The line as text, or InvalidRecord: over the size limit or not UTF-8."""
    raw = line.raw.rstrip(b"\r\n")
    if len(raw) > max_line_bytes:
        raise InvalidRecord(
            "line_too_long",
            f"line over the size limit: {len(raw)} bytes > ingest.max_line_bytes={max_line_bytes}",
        )
    # A UTF-8 byte-order mark that some exporters write; on any line, not only a file's
    # first: files joined with `cat` carry one where each began, and the same bytes must
    # mean the same record wherever they stand.
    raw = raw.removeprefix(b"\xef\xbb\xbf")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise InvalidRecord(
            "invalid_utf8", f"invalid UTF-8 at byte {error.start}; re-export the file as UTF-8"
        ) from None


def decode(line: Line, max_line_bytes: int) -> Any:
    """The JSON value of a line, or InvalidRecord saying why it has none."""
    return _decode_text(_text(line, max_line_bytes))


def _decode_text(text: str) -> Any:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise InvalidRecord("bad_json", f"bad JSON: {error.msg} at column {error.colno}") from None
    except RecursionError:
        raise InvalidRecord("too_deep", TOO_DEEP) from None
    if "\\u" in text and not _storable(value):
        # Only a JSON escape can put a lone surrogate in a string, and no file can hold one.
        raise InvalidRecord(
            "lone_surrogate", "a \\uD800-\\uDFFF escape without its pair; re-export the file"
        )
    return value


def _storable(value: Any) -> bool:
    """Whether every string in a decoded value (keys too) can be written as UTF-8."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    except RecursionError:
        raise InvalidRecord("too_deep", TOO_DEEP) from None
    return True


def parse_line(line: Line, max_line_bytes: int) -> PlainRecord:
    """The record a line holds, or InvalidRecord saying why it holds none.

    A well-formed line is read by orjson and checked by ``parse_plain``, several times faster
    than ``json`` and pydantic; any line either refuses (bad JSON, a value orjson reads
    differently, such as a huge integer or an unpaired surrogate escape, or an invalid
    record) is read again the thorough way, whose result or error stands.
    """
    text = _text(line, max_line_bytes)
    try:
        fast = parse_plain(orjson.loads(text))
    except orjson.JSONDecodeError:
        fast = None
    if fast is not None:
        return fast
    return plain(parse_record(_decode_text(text)))


def scrub_plain(record: PlainRecord) -> tuple[PlainRecord, Counter[str]]:
    """The record with PII replaced by typed placeholders in every text field, and the counts.

    Every field is scrubbed (messages, metadata, tags, bad and corrected responses), all of
    them in one ``pii.scrub_fields`` pass.
    """
    meta = record.meta
    fields = [content for _, content in record.messages]
    fields += [meta[name] for name in META_FIELDS if meta[name] is not None]
    fields += meta["tags"]
    extra = [text for text in (record.bad_response, record.corrected_response) if text is not None]
    scrubbed, found = pii.scrub_fields(fields + extra)
    if not found:
        return record, found
    texts = iter(scrubbed)
    messages = [(role, next(texts)) for role, _ in record.messages]
    new_meta: dict[str, Any] = {
        name: None if meta[name] is None else next(texts) for name in META_FIELDS
    }
    new_meta["tags"] = [next(texts) for _ in meta["tags"]]
    bad = None if record.bad_response is None else next(texts)
    corrected = None if record.corrected_response is None else next(texts)
    return PlainRecord(record.kind, messages, bad, corrected, new_meta), found


def pool_line(record: PlainRecord, digest: str, provenance: dict[str, Any]) -> bytes:
    """The record's line in a pool batch file: ``PoolRecord.model_dump(mode="json")``'s keys,
    in its order, as ``tuneloop.io.jsonl_text`` writes them."""
    data = {
        "id": digest,
        "kind": record.kind,
        "messages": [{"role": role, "content": content} for role, content in record.messages],
        "bad_response": record.bad_response,
        "corrected_response": record.corrected_response,
        "meta": record.meta,
        "provenance": provenance,
    }
    return (json.dumps(data, ensure_ascii=False) + "\n").encode()


def quarantine_entry(
    line: Line,
    error: InvalidRecord,
    digest: str,
    max_line_bytes: int,
    now: str,
    folder: str | None = None,
) -> tuple[dict[str, Any], Counter[str]]:
    """What the quarantine keeps of a rejected line: where it is, why, and a scrubbed excerpt.

    ``digest`` is the line's ``raw:<sha256>``; with ``folder`` (the task its folder gives it)
    the entry marks the line as seen in that task's folder only (``seen_key``): the same
    bytes refiled elsewhere are ingested anew.

    The whole line is scrubbed before it is cut, so the cut cannot keep half an
    address the scrubber would no longer recognise. A line over the size limit
    is not scrubbed at all (that is the work the limit refuses) and keeps no
    excerpt: its file, byte offset and sha256 find it in the incoming file.
    """
    raw = line.raw.rstrip(b"\r\n")
    found: Counter[str] = Counter()
    excerpt: str | None = None
    if len(raw) <= max_line_bytes:
        text, found = pii.scrub_bytes(raw)
        excerpt = text[:EXCERPT_CHARS]
    # A reason may quote the line's keys or values.
    reason, in_reason = pii.scrub(str(error))
    file, in_name = pii.scrub(line.file)
    found.update(in_reason + in_name)
    entry = {
        "file": file,
        "line": line.number,
        "offset": line.offset,
        "bytes": len(raw),
        "reason": reason[:REASON_CHARS],
        "kind": error.kind,
        "excerpt": excerpt,
        "sha256": digest,
        "folder_task": folder,
        "ingested_at": now,
    }
    return entry, found


# A line's own work (parse, PII scrub, content hash, its pool line): what the workers do.
# ("record", digest, PII found, pool line, source, task) or ("invalid", kind, reason).
Sorted = tuple[Any, ...]
# Over this much incoming data (about 20,000 lines) a run spreads its lines' own work over the
# usable cores, a window of WINDOW_LINES at a time (one window's lines and results in memory,
# not the month's).
PARALLEL_MIN_BYTES = 6 << 20
WINDOW_LINES = 40_000


@functools.lru_cache(maxsize=4096)
def folder_task(file: str, tasks: Tasks) -> str | None:
    """The task a file's place gives its lines: ``<task>/...`` is that task's, and in a
    project of one task every file is its; None: no task's folder."""
    parts = Path(file).parts
    if len(parts) > 1 and parts[0] in tasks:
        return parts[0]
    return tasks[0] if len(tasks) == 1 else None


def seen_key(raw_hash: str, folder: str | None) -> str:
    """What marks a line as seen before: its bytes' sha256 and its folder's task.

    The same bytes in another task's folder are another line (a record refiled where its
    quarantine reason said); without a folder's task the key is the bytes' alone, as it
    always was, so the quarantine of earlier runs still marks its lines.
    """
    return f"raw:{raw_hash}" if folder is None else f"raw:{folder}/{raw_hash}"


def route(record: PlainRecord, folder: str | None, tasks: Tasks) -> None:
    """Set the task ``record`` is for, from its ``task`` field or its ``folder``'s task
    (``folder_task``), or raise InvalidRecord saying why it belongs to none of ``tasks``.

    A file under ``<incoming>/<task>/`` (where the router of several tasks writes each
    task's flags) is that task's; a record may name its task itself, and must then agree
    with its folder. A project of one task takes every record without a task.
    """
    named = record.meta.get("task")
    if named is not None and named not in tasks:
        raise InvalidRecord(
            "unknown_task", f"task {named!r} is none of params.yaml's tasks {list(tasks)}"
        )
    if named is not None and folder is not None and named != folder:
        raise InvalidRecord(
            "task_mismatch",
            f"the record is for task {named!r} but lies in {folder}/, task {folder!r}'s "
            f"folder: move the line to {named}/ (it is ingested anew there), or correct its "
            "'task'",
        )
    task = named or folder
    if task is None:
        raise InvalidRecord(
            "no_task",
            f"no task: the file is in no task's folder ({', '.join(t + '/' for t in tasks)}) "
            "and the record has no 'task' field",
        )
    record.meta["task"] = task


def sort_one(line: Line, max_line_bytes: int, now: str, tasks: Tasks) -> Sorted:
    """What a line is on its own, before the run's deduplication decides whether it counts."""
    try:
        record = parse_line(line, max_line_bytes)
        route(record, folder_task(line.file, tasks), tasks)
    except InvalidRecord as error:
        return ("invalid", error.kind, str(error))
    record, found = scrub_plain(record)
    digest = content_hash(record)
    provenance = {"file": _scrubbed_name(line.file), "line": line.number, "sha256": digest}
    provenance["ingested_at"] = now
    source = str(record.meta["source"] or "unknown")
    pooled = pool_line(record, digest, provenance)
    return ("record", digest, tuple(found.items()), pooled, source, record.meta["task"])


@functools.lru_cache(maxsize=1024)
def _scrubbed_name(name: str) -> str:
    return pii.scrub(name)[0]


def _sort_many(lines: list[Line], max_line_bytes: int, now: str, tasks: Tasks) -> list[Sorted]:
    return [sort_one(line, max_line_bytes, now, tasks) for line in lines]


def ingest(
    lines: Iterator[Line],
    known: set[str],
    max_line_bytes: int,
    now: str,
    tasks: Tasks,
    workers: int = 1,
) -> IngestResult:
    """Sort every line into accepted, quarantined or duplicate.

    ``known`` holds the content hashes of the pool's records and the ``seen_key`` of lines
    quarantined before: a line seen before, good or bad, is a duplicate, so ingesting the
    same file twice adds nothing.

    With ``workers`` > 1 a window of lines is screened first (blank, seen before, a repeat
    of a line already sent): the rest are sorted by ``sort_one`` in worker processes, and
    the window is then decided line by line in order exactly as one process decides it, so
    the pool and quarantine get the same bytes either way (``tests/test_ingest.py``).
    """
    run = _Run(set(known), max_line_bytes, now, tasks)
    if workers <= 1:
        for line in lines:
            run.decide(line)
        return run.result
    context = multiprocessing.get_context("fork" if os.name == "posix" else "spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=context) as executor:
        # Window N+1 is sorted by the workers while this process decides window N.
        in_flight: Sending | None = None
        for window in iter(lambda: list(itertools.islice(lines, WINDOW_LINES)), []):
            sending = run.send(window, executor, workers)
            if in_flight is not None:
                run.settle(in_flight)
            in_flight = sending
        if in_flight is not None:
            run.settle(in_flight)
    return run.result


@dataclass
class Sending:
    """A window of lines whose own work is with the workers."""

    window: list[Line]
    keys: list[str | None]  # each line's seen_key (None: blank)
    todo: list[int]  # the window's lines sent, in order
    parts: list[Future[list[Sorted]]]  # their outcomes, a consecutive share of todo each


@dataclass
class _Run:
    """One ingest's decisions, line by line in order, and what they remember."""

    seen: set[str]
    max_line_bytes: int
    now: str
    tasks: Tasks
    result: IngestResult = field(default_factory=IngestResult)
    # A line whose bytes were parsed earlier in this run in the same task's folder (into a
    # record, so its record's hash is in ``seen``) is a duplicate with the same PII counts:
    # those are remembered, by the line's ``seen_key``, rather than worked out again. The
    # folder's task is part of the key: the same bytes in another task's folder are another
    # record, and may be another outcome (a task mismatch in one, accepted in the other).
    earlier: dict[str, tuple[tuple[str, int], ...]] = field(default_factory=dict)

    def key_of(self, line: Line) -> str:
        raw_hash = hashlib.sha256(line.raw.rstrip(b"\r\n")).hexdigest()
        return seen_key(raw_hash, folder_task(line.file, self.tasks))

    def decide(self, line: Line, key: str | None = None, outcome: Sorted | None = None) -> None:
        """The line's fate, in order; ``outcome`` is its ``sort_one`` if a worker did it."""
        folder = folder_task(line.file, self.tasks)
        result = self.result
        if not line.raw.strip():
            result.blank += 1
            result.count(folder, "blank")
            return
        key = key or self.key_of(line)
        remembered = self.earlier.get(key)
        if key in self.seen or remembered is not None:
            result.pii.update(dict(remembered or ()))
            self.duplicate(folder)
            return
        if outcome is None:
            outcome = sort_one(line, self.max_line_bytes, self.now, self.tasks)
        if outcome[0] == "invalid":
            self.quarantine(line, InvalidRecord(outcome[1], outcome[2]), key, folder)
            return
        _, digest, found_items, pooled, source, task = outcome
        result.pii.update(dict(found_items))
        self.earlier[key] = found_items
        if digest in self.seen:
            self.duplicate(folder)
            return
        self.seen.add(digest)
        result.accepted.append(pooled)
        result.accepted_ids.append(digest)
        result.accepted_tasks.append(task)
        result.by_source[source] += 1
        result.count(folder, "accepted")

    def duplicate(self, folder: str | None) -> None:
        self.result.duplicates += 1
        self.result.count(folder, "duplicates")

    def quarantine(self, line: Line, error: InvalidRecord, key: str, folder: str | None) -> None:
        self.result.reasons[error.kind] += 1
        self.seen.add(key)
        raw_digest = "raw:" + hashlib.sha256(line.raw.rstrip(b"\r\n")).hexdigest()
        entry, found = quarantine_entry(
            line, error, raw_digest, self.max_line_bytes, self.now, folder
        )
        self.result.pii.update(found)
        self.result.quarantined.append(entry)
        self.result.count(folder, "quarantined")

    def send(self, window: list[Line], executor: ProcessPoolExecutor, workers: int) -> Sending:
        """Screen a window and hand the lines that need their own work to the workers.

        The screen is conservative (``decide`` makes the exact decision, in order): blank
        lines, lines seen before and repeats of a line already sent are not sent. It may
        run on the state of a window ago, which only sends a little more work.
        """
        keys: list[str | None] = []
        todo: list[int] = []
        sent: set[str] = set()
        for index, line in enumerate(window):
            key = self.key_of(line) if line.raw.strip() else None
            keys.append(key)
            if key is None or key in self.seen or key in self.earlier or key in sent:
                continue
            sent.add(key)
            todo.append(index)
        share = -(-len(todo) // workers) or 1
        args = (self.max_line_bytes, self.now, self.tasks)
        parts = [
            executor.submit(_sort_many, [window[i] for i in todo[k : k + share]], *args)
            for k in range(0, len(todo), share)
        ]
        return Sending(window, keys, todo, parts)

    def settle(self, sending: Sending) -> None:
        outcomes = (outcome for part in sending.parts for outcome in part.result())
        done = dict(zip(sending.todo, outcomes, strict=True))
        for index, line in enumerate(sending.window):
            self.decide(line, sending.keys[index], done.pop(index, None))


def known_hashes(pool: Path, tasks: Tasks) -> tuple[set[str], int]:
    """Content hashes of pooled records and the ``seen_key`` of each quarantined line; how
    many of them are pooled records.

    An entry written before entries named their folder's task (``folder_task``) gets it
    from its file's place, as ``ingest`` would give it today.
    """
    known = pool_ids(pool)
    pooled = len(known)
    for path in sorted((pool / "quarantine").glob("*.jsonl")):
        for entry in read_jsonl(path):
            folder = entry.get("folder_task", folder_task(entry["file"], tasks))
            known.add(seen_key(entry["sha256"].removeprefix("raw:"), folder))
    return known, pooled


def ingest_folder(
    incoming: Path, known: set[str], max_line_bytes: int, now: str, tasks: Tasks
) -> IngestResult:
    """``ingest`` every ``*.jsonl`` under ``incoming``, over the usable cores when it is large;
    each record routed to one of ``tasks``."""
    size = sum(path.stat().st_size for path in incoming_files(incoming))
    workers = usable_cores() if size > PARALLEL_MIN_BYTES else 1
    return ingest(read_lines(incoming), known, max_line_bytes, now, tasks, workers=workers)


def metrics(result: IngestResult, pooled: int) -> IngestMetrics:
    """The run's numbers for ``metrics/ingest.json``; ``pooled`` records were in the pool before."""
    return IngestMetrics(
        lines=result.lines,
        accepted=len(result.accepted),
        accepted_by_source=dict(result.by_source),
        accepted_by_task=dict(Counter(result.accepted_tasks)),
        quarantined=len(result.quarantined),
        duplicates=result.duplicates,
        blank_lines=result.blank,
        reject_rate=round(result.reject_rate, 6),
        quarantine_reasons=dict(result.reasons),
        pii_scrubbed={kind: result.pii.get(kind, 0) for kind in pii.PII_TYPES},
        pool_records=pooled + len(result.accepted),
        by_task_folder={
            folder or ELSEWHERE: FolderCounts(
                lines=sum(counts.values()),
                **{outcome: counts.get(outcome, 0) for outcome in OUTCOMES},
            )
            for folder, counts in sorted(result.by_folder.items(), key=lambda i: i[0] or "")
        },
    )


def add_batch(
    pool: Path,
    now: dt.datetime,
    result: IngestResult,
    tasks: Sequence[str],
    everyone: Sequence[str] = (),
) -> None:
    """Add the run's records and quarantined lines to the pool as one batch, all or nothing.

    Each of ``tasks`` gets its records in a folder of its own (``task_records``): the
    task's stages depend on that folder alone (dvc.yaml), so a month that brings one task
    new records reruns that task's pipeline and no other. A task of ``everyone`` (``records:
    all``) gets every task's records in its folder too: a copy, so that its folder is still
    the one dep its stages need, and a new record of any task reruns it.
    """
    batch = now.strftime("%Y%m%dT%H%M%S%fZ")
    # DVC needs the out (and each task's folder, a dep) to exist even when a run adds nothing.
    for folder in (task_records(pool, t) for t in tasks):
        folder.mkdir(mode=pool_writes.FOLDER_MODE, parents=True, exist_ok=True)
    by_task: dict[str, tuple[list[bytes], list[str]]] = {}
    for line, digest, task in zip(
        result.accepted, result.accepted_ids, result.accepted_tasks, strict=True
    ):
        for owner in {task, *(e for e in everyone if e != task)}:
            lines, ids = by_task.setdefault(owner, ([], []))
            lines.append(line)
            ids.append(digest)
    files: dict[str, bytes | list[bytes]] = {}
    for task, (lines, ids) in sorted(by_task.items()):
        name = (task_records(pool, task) / f"{batch}_{task}").relative_to(pool).as_posix()
        files[f"{name}.jsonl"] = lines
        files[f"{name}{IDS_SUFFIX}"] = ids_index(lines, ids)
    if result.quarantined:
        files[f"quarantine/{batch}.jsonl"] = jsonl_text(result.quarantined).encode()
    if files:
        pool_writes.commit(pool, batch, files)
