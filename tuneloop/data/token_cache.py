"""Tokenized chats of clean's files, kept from one ``pack`` to the next, by line.

clean's train.jsonl changes month to month in two ways: new lines (the new pool batches), and,
once training continues from last month's champion, another replay share of the older lines
(``clean.replay_fraction``, drawn again each month). So the tokens of a line are kept by the
line's own bytes, wherever it stands in the file: a segment of the cache holds its lines'
token ids, labels and lengths and each line's key (xxh3-128 of its bytes). A run keys every
line it is given (pack gives it the lines of the parts it holds no packed bins of,
``tuneloop.data.pack_cache``), takes the tokens of each line some segment holds, and tokenizes only
the others, into one new segment. A line is the same record as the month before wherever clean
puts it, so the cache grows with the distinct lines clean has written (the pool's kept
records), not with the months. A different tokenizer or tokenization code (the fingerprint)
starts from nothing; a segment that cannot be read, or does not add up, is dropped and its
lines tokenized again. The tokens are the same as a run without the cache makes
(``tests/test_tokencache.py``).
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

import numpy as np
import orjson
import xxhash

from tuneloop.data.chat import ChatTokenizer, tokenize_chats
from tuneloop.data.pack import gather_runs
from tuneloop.io import read_json, remove_all_but, usable_cores, write_json

log = logging.getLogger(__name__)

# Chats tokenized per batch call; bounds the Python objects alive at once.
CHUNK = 4096
# Below this many lines to tokenize, starting worker processes costs more than it saves.
PARALLEL_MIN_LINES = 16_000
_ARRAYS = ("ids", "labels", "lengths", "keys")


@dataclass(frozen=True)
class Tokens:
    ids: np.ndarray  # int32, every line's tokens one after the other
    labels: np.ndarray  # int32
    offsets: np.ndarray  # int64: line i is [offsets[i], offsets[i + 1])
    lines_tokenized: int
    """Lines tokenized by this run (the others came from the cache)."""


def split_lines(data: bytes) -> list[bytes]:
    """The lines of a chats file, blank ones left out (a line's index is its sample's)."""
    return [line for line in data.split(b"\n") if line.strip()]


def _tokenize_chunk(
    lines: list[bytes], tokenizer: ChatTokenizer
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    chats = [orjson.loads(line)["messages"] for line in lines]
    ids, labels, offsets = tokenize_chats(tokenizer, chats)
    return ids, labels, np.diff(offsets)


_WORKER: ChatTokenizer | None = None


def _start_worker(folder: Path) -> None:
    global _WORKER
    # One process per core already: Rust thread pools in the worker would fight over them.
    os.environ["RAYON_NUM_THREADS"] = "1"
    _WORKER = ChatTokenizer.from_folder(folder)


def _worker_chunk(lines: list[bytes]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    assert _WORKER is not None, "worker not started"
    return _tokenize_chunk(lines, _WORKER)


def tokenize_lines(
    lines: list[bytes], tokenizer: ChatTokenizer
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Lines of a chats file (``{"messages": ...}`` each) as ``tokenize_chats`` arrays.

    Over all usable cores when there are many lines (rendering the chat template is
    Python, most of the time): spawned worker processes load the tokenizer once each and
    tokenize chunks of lines, returned in order, so the result is the same either way.
    """
    chunks = [lines[start : start + CHUNK] for start in range(0, len(lines), CHUNK)]
    workers = min(usable_cores(), len(chunks))
    parts: Iterable[tuple[np.ndarray, np.ndarray, np.ndarray]]
    if len(lines) < PARALLEL_MIN_LINES or workers < 2 or tokenizer.folder is None:
        parts = (_tokenize_chunk(chunk, tokenizer) for chunk in chunks)
        return _join(parts)
    log.info("pack: tokenizing %d lines on %d processes", len(lines), workers)
    with ProcessPoolExecutor(
        workers,
        mp_context=get_context("spawn"),
        initializer=_start_worker,
        initargs=(tokenizer.folder,),
    ) as pool:
        return _join(pool.map(_worker_chunk, chunks))


def _join(
    parts: Iterable[tuple[np.ndarray, np.ndarray, np.ndarray]],
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    ids, labels, lengths = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
    for chunk_ids, chunk_labels, chunk_lengths in parts:
        ids.append(chunk_ids)
        labels.append(chunk_labels)
        lengths.append(chunk_lengths)
    counts = np.concatenate(lengths)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return np.concatenate(ids), np.concatenate(labels), offsets


def fingerprint(tokenizer: ChatTokenizer) -> str:
    """The tokenizer's files and the code that turns chats into tokens."""
    code = Path(__file__).parent
    digest = hashlib.sha256(tokenizer.fingerprint.encode())
    for name in ("chat.py", "shards.py", "token_cache.py"):
        digest.update((code / name).read_bytes())
    return digest.hexdigest()


@dataclass(frozen=True)
class _Segment:
    name: str
    ids: np.ndarray  # int32
    labels: np.ndarray  # int32
    lengths: np.ndarray  # tokens of each line
    keys: np.ndarray  # (lines, 2) uint64: each line's xxh3-128


def line_keys(lines: list[bytes]) -> np.ndarray:
    """Each line's xxh3-128 as two uint64 (the first sorts, both must match)."""
    digests = b"".join(map(xxhash.xxh3_128_digest, lines))
    return np.frombuffer(digests, dtype="<u8").reshape(-1, 2)


def _segments(cache: Path, expected: str) -> list[_Segment]:
    """The cache's readable segments for this fingerprint (none for another)."""
    try:
        entry = read_json(cache / "entry.json")
        names = [str(s["name"]) for s in entry["segments"]]
        if entry.get("fingerprint") != expected:
            return []
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []
    found = []
    for name in names:
        try:
            arrays = {n: np.load(cache / f"{name}.{n}.npy", mmap_mode="r") for n in _ARRAYS}
            segment = _Segment(name=name, **arrays)
            lines = len(segment.lengths)
            if segment.keys.shape != (lines, 2) or segment.keys.dtype != np.dtype("<u8"):
                raise ValueError("keys do not match the lines")
            if (segment.lengths < 0).any() or not (
                len(segment.ids) == len(segment.labels) == int(segment.lengths.sum())
            ):
                raise ValueError("token counts do not add up")
        except (OSError, ValueError, KeyError, TypeError) as error:
            log.warning("pack: cached tokens %s in %s are unreadable (%s)", name, cache, error)
            continue
        found.append(segment)
    return found


def _find(cached: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """For each wanted key, the row of ``cached`` that holds it, or -1."""
    where = np.full(len(wanted), -1, dtype=np.int64)
    if not len(cached) or not len(wanted):
        return where
    # Sorted by the first 64 bits (a 16-byte sort is ten times slower), then both halves
    # compared: a match is all 128 bits, and a first-half collision is only a miss.
    order = np.argsort(cached[:, 0], kind="stable")
    first = cached[order, 0]
    at = np.minimum(np.searchsorted(first, wanted[:, 0]), len(first) - 1)
    rows = order[at]
    hit = np.all(cached[rows] == wanted, axis=1)
    where[hit] = rows[hit]
    return where


def tokens_of_lines(lines: list[bytes], cache: Path | None, tokenizer: ChatTokenizer) -> Tokens:
    """The tokens of each of ``lines`` (``split_lines`` of a chats file), from ``cache`` for
    the lines it holds.

    ``cache`` is the file's own folder (one for train.jsonl, one for val.jsonl); None
    tokenizes everything and keeps nothing.
    """
    if cache is None:
        ids, labels, offsets = tokenize_lines(lines, tokenizer)
        return Tokens(ids.astype(np.int32), labels.astype(np.int32), offsets, len(lines))
    expected = fingerprint(tokenizer)
    segments = _segments(cache, expected)
    keys = line_keys(lines)
    where = _find(np.concatenate([s.keys for s in segments] or [np.zeros((0, 2), "<u8")]), keys)
    fresh = np.flatnonzero(where < 0)
    # Every source's tokens one after the other (the segments, then this run's): each line
    # is a run of them, gathered in file order below.
    sources = [(s.ids, s.labels, s.lengths.astype(np.int64)) for s in segments]
    kept = [s.name for s in segments]
    if len(fresh) or not segments:
        ids, labels, offsets = tokenize_lines([lines[i] for i in fresh], tokenizer)
        arrays = (ids.astype(np.int32), labels.astype(np.int32), np.diff(offsets), keys[fresh])
        name = f"{_first_free(kept):06d}"
        cache.mkdir(parents=True, exist_ok=True)
        for suffix, values in zip(_ARRAYS, arrays, strict=True):
            np.save(cache / f"{name}.{suffix}.npy", values)
        sources.append(arrays[:3])
        kept.append(name)
        where[fresh] = sum(len(s.lengths) for s in segments) + np.arange(len(fresh))
    write_json(
        cache / "entry.json", {"fingerprint": expected, "segments": [{"name": n} for n in kept]}
    )
    remove_all_but(cache, [f"{n}.{a}.npy" for n in kept for a in _ARRAYS] + ["entry.json"])
    return _gather(sources, where, len(fresh))


def _gather(
    sources: list[tuple[np.ndarray, np.ndarray, np.ndarray]], where: np.ndarray, tokenized: int
) -> Tokens:
    """The tokens of each line, in file order, from the source that holds it.

    ``where`` numbers the lines of all sources one after the other. Each source is read
    where it lies (a cached segment is a memory map), one source at a time: from the
    champion a month trains on a replay share of the old lines, and joining every segment
    into one array first read and copied the whole cache every month, all of it.
    """
    counts = np.array([len(lengths) for _, _, lengths in sources], dtype=np.int64)
    first_row = np.concatenate([[0], np.cumsum(counts)])
    source_of = np.searchsorted(first_row, where, side="right") - 1
    local = where - first_row[source_of]
    per_source = [np.flatnonzero(source_of == s) for s in range(len(sources))]
    lengths = np.empty(len(where), dtype=np.int64)
    starts = np.empty(len(where), dtype=np.int64)
    for rows, (_, _, source_lengths) in zip(per_source, sources, strict=True):
        if len(rows):
            all_lengths = np.asarray(source_lengths, dtype=np.int64)
            lengths[rows] = all_lengths[local[rows]]
            starts[rows] = (np.cumsum(all_lengths) - all_lengths)[local[rows]]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    total = int(offsets[-1])
    ids, labels = np.empty(total, dtype=np.int32), np.empty(total, dtype=np.int32)
    for rows, (source_ids, source_labels, _) in zip(per_source, sources, strict=True):
        if len(rows):
            gather_runs(
                (source_ids, source_labels),
                starts[rows],
                lengths[rows],
                int(lengths[rows].sum()),
                out=(ids, labels),
                at=offsets[rows],
            )
    return Tokens(ids=ids, labels=labels, offsets=offsets, lines_tokenized=tokenized)


def _first_free(names: list[str]) -> int:
    # A new segment never takes the name of one kept or dropped.
    return 1 + max((int(n) for n in names if n.isdigit()), default=0)
