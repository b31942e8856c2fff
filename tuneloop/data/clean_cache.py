"""clean over the whole pool, with each record's work and the decisions cached.

The pool only grows, so both kinds of ``tuneloop.data.clean`` work are kept in
``paths.clean_cache`` (a DVC out beside the pool), per pool *segment* (``SEGMENT_LINES``
lines of one pool batch file, which bounds the memory of every step whatever a month's
size):

- features, keyed by the batch file's md5, the segment's byte range and
  ``features_fingerprint``; computed on all usable cores when there are many;
- decisions, made segment after segment against the history of the segments before,
  keyed by a chain: the previous segment's key, this segment's source and features
  fingerprint, the thresholds, the eval questions and the split params. A change
  anywhere remakes exactly the decisions after it, and never reuses a stale one.

A month's run therefore computes features for its new records only and decides them
against the cached index of the earlier ones. The output is the same bytes whether an
entry came from the cache or not (``tests/test_clean_cache.py``). Beside train.jsonl goes
the key of each of its user turns (``tuneloop.data.turn_keys``), which preflight checks eval
contamination with, and beside each file where each segment's lines lie in it
(``tuneloop.data.clean_parts``), which pack packs by.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from collections import Counter
from collections.abc import Collection, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from itertools import pairwise
from multiprocessing import get_context
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from tuneloop.data import clean_parts, turn_keys
from tuneloop.data.chat import ChatTokenizer
from tuneloop.data.clean import (
    DPO_REASONS,
    NOT_REPLAYED,
    REASONS,
    TRAIN,
    VAL,
    Decisions,
    EvalSet,
    Features,
    History,
    decide,
    decisions_fingerprint,
    features,
    features_fingerprint,
    hash_fractions,
)
from tuneloop.data.metrics import CleanMetrics, ReplayMetrics
from tuneloop.data.records import pool_batches
from tuneloop.io import atomic_dir, file_stamp, read_json, usable_cores, write_json
from tuneloop.params import CleanParams

log = logging.getLogger(__name__)

# A pool batch file is cached in segments of this many lines.
SEGMENT_LINES = 50_000
# Lines per task of a worker process.
CHUNK_LINES = 4_000
# Below this many records to compute, starting worker processes costs more than it saves.
PARALLEL_MIN_RECORDS = 16_000


@dataclass(frozen=True)
class Segment:
    batch: Path
    number: int
    start: int  # byte range of its lines in the batch file
    end: int
    source_md5: str

    @property
    def name(self) -> str:
        return f"{self.batch.stem}.{self.number:05d}"


def _batch_segments(batch: Path, cache: Path) -> list[Segment]:
    """A batch file's segments; its md5 and line layout are remembered by its
    ``tuneloop.io.file_stamp``."""
    stat = batch.stat()
    meta_path = cache / "batches" / f"{batch.stem}.json"
    try:
        meta = read_json(meta_path)
        if (meta["stat"], meta["segment_lines"]) == (file_stamp(stat), SEGMENT_LINES):
            return [
                Segment(batch, i, start, end, meta["md5"])
                for i, (start, end) in enumerate(meta["segments"])
            ]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    data = batch.read_bytes()
    newlines = np.flatnonzero(np.frombuffer(data, dtype=np.uint8) == ord("\n")) + 1
    ends = newlines[SEGMENT_LINES - 1 :: SEGMENT_LINES].tolist()
    if not ends or ends[-1] != len(data):
        ends.append(len(data))
    bounds = list(zip([0, *ends[:-1]], ends, strict=True))
    md5 = hashlib.md5(data).hexdigest()
    write_json(
        meta_path,
        {
            "stat": file_stamp(stat),
            "segment_lines": SEGMENT_LINES,
            "md5": md5,
            "segments": bounds,
        },
    )
    return [Segment(batch, i, start, end, md5) for i, (start, end) in enumerate(bounds)]


def _entry(folder: Path) -> dict[str, Any] | None:
    try:
        entry = read_json(folder / "entry.json")
    except (OSError, ValueError):
        return None
    return entry if isinstance(entry, dict) else None


@dataclass
class CleanReport:
    records_in: int = 0
    train: int = 0
    val: int = 0
    dpo_pairs: int = 0
    train_tokens: int = 0
    removed: Counter[str] = field(default_factory=Counter)
    dpo_removed: Counter[str] = field(default_factory=Counter)
    cache: Counter[str] = field(default_factory=Counter)
    batches: list[str] = field(default_factory=list)  # the pool's, oldest first
    seen_batches: list[str] = field(default_factory=list)  # of those, the start trained on
    replayed: int = 0  # training chats of seen batches kept by the replay share
    replayed_pairs: int = 0

    def metrics(self, replay_fraction: float) -> CleanMetrics:
        return CleanMetrics(
            records_in=self.records_in,
            train=self.train,
            val=self.val,
            train_tokens=self.train_tokens,
            dpo_pairs=self.dpo_pairs,
            removed=dict(self.removed),
            dpo_removed=dict(self.dpo_removed),
            batches=tuple(self.batches),
            replay=ReplayMetrics(
                fraction=replay_fraction,
                seen_batches=tuple(self.seen_batches),
                new_batches=tuple(b for b in self.batches if b not in self.seen_batches),
                replayed_train=self.replayed,
                new_train=self.train - self.replayed,
                not_replayed=self.removed[NOT_REPLAYED],
                replayed_dpo_pairs=self.replayed_pairs,
            ),
        )


_WORKER: tuple[CleanParams, ChatTokenizer] | None = None


def _start_worker(params: CleanParams, tokenizer_folder: Path) -> None:
    global _WORKER
    # One process per core already: Rust thread pools in the worker would fight over them.
    os.environ["RAYON_NUM_THREADS"] = "1"
    _WORKER = (params, ChatTokenizer.from_folder(tokenizer_folder))


def _read_lines(batch: Path, start: int, end: int) -> list[bytes]:
    with batch.open("rb") as source:
        source.seek(start)
        data = source.read(end - start)
    return [line for line in data.split(b"\n") if line.strip()]


def _features_of(
    batch: Path, start: int, end: int, params: CleanParams, tokenizer: ChatTokenizer
) -> Features:
    try:
        return features(_read_lines(batch, start, end), params, tokenizer)
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(
            f"{batch} (bytes {start}-{end}) holds a line that is not a pool record ({error!r}); "
            "only ingest writes the pool: restore the file (dvc checkout) and run clean again"
        ) from error


def _worker_features(batch: Path, start: int, end: int) -> Features:
    assert _WORKER is not None, "worker not started"
    return _features_of(batch, start, end, *_WORKER)


def _chunks(segment: Segment) -> tuple[list[tuple[Path, int, int]], int]:
    """Byte ranges of about CHUNK_LINES lines each, cut at line ends; and the lines in all."""
    data = np.fromfile(
        segment.batch, dtype=np.uint8, count=segment.end - segment.start, offset=segment.start
    )
    line_ends = np.flatnonzero(data == ord("\n")) + 1 + segment.start
    bounds = [segment.start, *line_ends[CHUNK_LINES - 1 :: CHUNK_LINES].tolist()]
    if bounds[-1] != segment.end:
        bounds.append(segment.end)
    lines = len(line_ends) + int(bool(data.size) and data[-1] != ord("\n"))
    return [(segment.batch, a, b) for a, b in pairwise(bounds)], lines


def _compute_features(
    missing: list[Segment],
    params: CleanParams,
    tokenizer: ChatTokenizer,
    cache: Path,
    fingerprint: str,
) -> int:
    """Compute and cache the features of segments; returns the number of records.

    Over all usable cores when there is enough to do: worker processes (spawned, so no
    thread pool is forked mid-use) each load the tokenizer once and read their own byte
    ranges of the pool, so no line passes through this process.
    """
    cut = {segment: _chunks(segment) for segment in missing}
    chunks = {segment: ranges for segment, (ranges, _) in cut.items()}
    # The lines themselves: a month of small batch files is several short segments, which
    # counted as whole chunks would start worker processes for a few hundred lines.
    lines = sum(n for _, n in cut.values())
    workers = min(usable_cores(), sum(map(len, chunks.values())))
    if lines < PARALLEL_MIN_RECORDS or workers < 2 or tokenizer.folder is None:
        total = 0
        for segment in missing:
            f = _features_of(segment.batch, segment.start, segment.end, params, tokenizer)
            _write_features(cache, segment, fingerprint, f)
            total += len(f)
        return total
    log.info("clean: computing features of %d segment(s) on %d processes", len(missing), workers)
    tasks = [(segment, *chunk) for segment, ranges in chunks.items() for chunk in ranges]
    total = 0
    with ProcessPoolExecutor(
        workers,
        mp_context=get_context("spawn"),
        initializer=_start_worker,
        initargs=(params, tokenizer.folder),
    ) as pool:
        parts: list[Features] = []
        results = pool.map(_worker_features, *zip(*(t[1:] for t in tasks), strict=True))
        for (segment, *_), part in zip(tasks, results, strict=True):
            parts.append(part)
            if len(parts) == len(chunks[segment]):
                joined = Features.concatenate(parts)
                _write_features(cache, segment, fingerprint, joined)
                total += len(joined)
                parts = []
    return total


def _features_entry(segment: Segment, fingerprint: str) -> dict[str, Any]:
    return {
        "fingerprint": fingerprint,
        "source_md5": segment.source_md5,
        "bytes": [segment.start, segment.end],
    }


def _write_features(cache: Path, segment: Segment, fingerprint: str, f: Features) -> None:
    with atomic_dir(cache / segment.name / "features") as folder:
        f.save(folder)
        write_json(folder / "entry.json", _features_entry(segment, fingerprint))


def _load_features(folder: Path, expected: dict[str, Any]) -> Features | None:
    """The cached features, if the entry is this segment's under this fingerprint."""
    if _entry(folder) != expected:
        return None
    try:
        return Features.load(folder)
    except (OSError, ValueError) as error:
        log.warning("clean: cache entry %s is unreadable (%s); recomputing it", folder, error)
        return None


def _load_decisions(folder: Path, chain: str) -> Decisions | None:
    if _entry(folder) != {"chain": chain}:
        return None
    try:
        return Decisions.load(folder)
    except (OSError, ValueError) as error:
        log.warning("clean: cache entry %s is unreadable (%s); recomputing it", folder, error)
        return None


def _lines(blob: np.ndarray, offsets: np.ndarray, rows: np.ndarray) -> bytes:
    """The lines ``rows`` (ascending) of a blob, one slice per run of consecutive rows: most
    of a segment is kept, and a slice per line was a million slices a month."""
    if not len(rows):
        return b""
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    firsts = rows[np.concatenate([[0], breaks])]
    lasts = rows[np.concatenate([breaks - 1, [len(rows) - 1]])]
    starts, ends = offsets[firsts].tolist(), offsets[lasts + 1].tolist()
    data = np.asarray(blob).data
    return b"".join(data[s:e] for s, e in zip(starts, ends, strict=True))


def _copy_lines(blob: np.ndarray, offsets: np.ndarray, rows: np.ndarray, out: BinaryIO) -> int:
    out.write(_lines(blob, offsets, rows))
    return len(rows)


def clean_pool(
    pool: Path,
    cache: Path,
    out: Path,
    eval_questions: Sequence[str],
    params: CleanParams,
    tokenizer: ChatTokenizer,
    seen_batches: Collection[str] = (),
    task: str | None = None,
) -> CleanReport:
    """Clean every pooled record, oldest first, into ``out``/train.jsonl, val.jsonl, dpo.jsonl.

    Reuses what ``cache`` holds for this pool and these params, computes the rest, and leaves
    the cache holding exactly this run's entries.

    ``seen_batches`` are the pool batches the starting model already trained on (the
    champion's; none for the base). Their records are cleaned and deduplicated like the rest
    (a new record that repeats one of them is still a duplicate), but of their kept training
    chats and DPO pairs only ``params.replay_fraction`` is trained on again: chosen by a hash
    of the sample's key salted with the newest batch, so the same pool gives the same set, a
    new month draws a fresh one, and the cached decisions (which do not depend on which
    batches are new) stay valid. With ``params.replay_corrections`` their corrected badcases
    are all trained on again (chat and pair), the items the fixed-badcase suite tests. Their
    validation chats all stay, so the validation loss also watches what earlier months taught.

    ``task``: clean that task's records only (its folder, ``records.task_records``).
    """
    cache.mkdir(parents=True, exist_ok=True)
    batches = pool_batches(pool, task)
    segments = [s for batch in batches for s in _batch_segments(batch, cache)]
    report = CleanReport()
    report.batches = [b.stem for b in batches]
    report.seen_batches = [b for b in report.batches if b in set(seen_batches)]
    salt = f"replay:{report.batches[-1] if report.batches else ''}"
    fingerprint = features_fingerprint(params, tokenizer)
    missing = [
        s
        for s in segments
        if _load_features(cache / s.name / "features", _features_entry(s, fingerprint)) is None
    ]
    report.cache["records_computed"] = _compute_features(
        missing, params, tokenizer, cache, fingerprint
    )

    evals = EvalSet(eval_questions, params.decontam_threshold)
    chain = decisions_fingerprint(params, evals)
    history = History(params.near_dup_threshold)
    user_turns = turn_keys.TurnKeysWriter()
    parts: dict[str, list[clean_parts.Part]] = {"train": [], "val": []}
    with (
        (out / "train.jsonl").open("wb") as train,
        (out / "val.jsonl").open("wb") as val,
        (out / "dpo.jsonl").open("wb") as dpo,
    ):
        for segment in segments:
            f = _load_features(
                cache / segment.name / "features", _features_entry(segment, fingerprint)
            )
            if f is None:
                raise RuntimeError(f"clean: the features of {segment.name} vanished from {cache}")
            source = f"{segment.name}\0{segment.source_md5}\0{segment.start}-{segment.end}"
            chain = hashlib.sha256(f"{chain}\0{fingerprint}\0{source}".encode()).hexdigest()
            folder = cache / segment.name / "decisions"
            decided = _load_decisions(folder, chain)
            if decided is not None:
                decided.extend(history, f)
                report.cache["segments_reused"] += 1
            else:
                decided = decide(f, history, evals, params)
                with atomic_dir(folder) as tmp:
                    decided.save(tmp)
                    write_json(tmp / "entry.json", {"chain": chain})
                report.cache["segments_decided"] += 1
            codes = np.asarray(decided.codes)
            replayed = np.ones(len(codes), dtype=bool)
            if segment.batch.stem in report.seen_batches:
                replayed = hash_fractions(np.asarray(f.key), salt) < params.replay_fraction
                if params.replay_corrections:  # a corrected badcase is the record with a pair
                    replayed |= np.diff(f.dpo_offsets) > 0
            train_rows = np.flatnonzero((codes == TRAIN) & replayed)
            val_rows = np.flatnonzero(codes == VAL)
            report.records_in += len(codes)
            lines = _lines(f.lines, f.line_offsets, train_rows)
            train.write(lines)
            parts["train"].append(clean_parts.Part(segment.name, len(train_rows), len(lines)))
            user_rows, turns_per_line = f.user_rows(train_rows)
            user_turns.add(lines, len(train_rows), turns_per_line, f.user_key[user_rows])
            report.train += len(train_rows)
            val_lines = _lines(f.lines, f.line_offsets, val_rows)
            val.write(val_lines)
            parts["val"].append(clean_parts.Part(segment.name, len(val_rows), len(val_lines)))
            report.val += len(val_rows)
            report.train_tokens += int(np.asarray(f.tokens)[train_rows].sum())
            if skipped := int(((codes == TRAIN) & ~replayed).sum()):
                report.removed[NOT_REPLAYED] += skipped
            if segment.batch.stem in report.seen_batches:
                report.replayed += len(train_rows)
            # A pair passes the same filters as the SFT chat its badcase gives (its prompt with
            # the correction): length, repetition, token limit, eval contamination, exact and
            # near duplicates, pilot; a removed chat removes its pair, counted apart with the
            # chat's reason. Then its rejected side passes the reply filters on its own
            # (``cleaning.pair_verdicts``), and a pair of a seen batch the replay share.
            has_pair = np.flatnonzero(np.diff(f.dpo_offsets) > 0)
            chat_kept = np.isin(codes[has_pair], (TRAIN, VAL))
            own = np.asarray(f.dpo_verdict)[has_pair]
            pair_kept = chat_kept & (own == 0) & replayed[has_pair]
            report.dpo_pairs += _copy_lines(f.dpo, f.dpo_offsets, has_pair[pair_kept], dpo)
            if segment.batch.stem in report.seen_batches:
                report.replayed_pairs += int(pair_kept.sum())
            for code, verdict, again in zip(codes[has_pair], own, replayed[has_pair], strict=True):
                if code >= 2:
                    report.dpo_removed[REASONS[int(code) - 2]] += 1
                elif verdict:
                    report.dpo_removed[DPO_REASONS[int(verdict) - 1]] += 1
                elif not again:
                    report.dpo_removed[NOT_REPLAYED] += 1
            for code, count in zip(*np.unique(codes, return_counts=True), strict=True):
                if code >= 2:
                    report.removed[REASONS[int(code) - 2]] += int(count)
    user_turns.save(out / turn_keys.NAME)
    for split, split_parts in parts.items():
        clean_parts.write(out / f"{split}.jsonl", split_parts)
    _prune(cache, segments)
    report.cache["records_reused"] = report.records_in - report.cache["records_computed"]
    return report


def _prune(cache: Path, segments: list[Segment]) -> None:
    """Drop entries of segments no longer in the pool, so the cache holds this run's only."""
    keep = {s.name for s in segments}
    batches = {s.batch.stem for s in segments}
    for entry in cache.iterdir():
        if entry.is_dir() and entry.name != "batches" and entry.name not in keep:
            shutil.rmtree(entry)
        elif entry.name in keep:
            # What an interrupted write left beside the two entries.
            for part in entry.iterdir():
                if part.name in ("features", "decisions"):
                    continue
                if part.is_dir():
                    shutil.rmtree(part)
                else:
                    part.unlink()
    for meta in (cache / "batches").glob("*.json"):
        if meta.stem not in batches:
            meta.unlink()
