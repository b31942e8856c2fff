"""Tokenized chats of clean's files, kept from one ``pack`` to the next.

clean writes train.jsonl and val.jsonl in pool order, and the pool only grows, so month
after month each file is last month's file with new lines at the end (until a param or
the eval set changes what clean keeps). pack keeps each file's token ids and labels in
segments, one per run: a run checks, segment by segment, that the file still holds the
bytes a segment was made from (md5), keeps the segments up to the first that differs,
and tokenizes only the lines after them into one new segment. A different tokenizer or
tokenization code (the fingerprint) starts from nothing. The tokens are the same as a
run without the cache makes (``tests/test_packing.py``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

import numpy as np
import orjson

from tuneloop.chat import ChatTokenizer, tokenize_chats
from tuneloop.io import read_json, usable_cores, write_json

log = logging.getLogger(__name__)

# Chats tokenized per batch call; bounds the Python objects alive at once.
CHUNK = 4096
# Below this many lines to tokenize, starting worker processes costs more than it saves.
PARALLEL_MIN_LINES = 16_000
_ARRAYS = ("ids", "labels", "lengths")


@dataclass(frozen=True)
class Tokens:
    ids: np.ndarray  # int32, every line's tokens one after the other
    labels: np.ndarray  # int32
    offsets: np.ndarray  # int64: line i is [offsets[i], offsets[i + 1])
    lines_tokenized: int
    """Lines tokenized by this run (the others came from the cache)."""


def _md5(data: bytes) -> str:
    return hashlib.md5(data).hexdigest()


def _lines(data: bytes) -> list[bytes]:
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
    for name in ("chat.py", "shards.py", "tokencache.py"):
        digest.update((code / name).read_bytes())
    return digest.hexdigest()


def tokens_of(path: Path, cache: Path | None, tokenizer: ChatTokenizer) -> Tokens:
    """The tokens of every line of ``path``, from ``cache`` where it still holds them.

    ``cache`` is this file's own folder, left holding exactly this file's tokens; None
    tokenizes everything and keeps nothing.
    """
    if cache is None:
        lines = _lines(path.read_bytes())
        ids, labels, offsets = tokenize_lines(lines, tokenizer)
        return Tokens(ids.astype(np.int32), labels.astype(np.int32), offsets, len(lines))
    expected = fingerprint(tokenizer)
    data = path.read_bytes()
    try:
        entry = read_json(cache / "entry.json")
        segments = entry["segments"] if entry.get("fingerprint") == expected else []
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        segments = []
    kept: list[dict[str, object]] = []
    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    start = 0
    for segment in segments:
        try:
            end = int(segment["end"])
            if end > len(data) or _md5(data[start:end]) != segment["md5"]:
                break
            arrays = tuple(
                np.load(cache / f"{segment['name']}.{n}.npy", mmap_mode="r") for n in _ARRAYS
            )
        except (OSError, ValueError, KeyError, TypeError) as error:
            log.warning("pack: cached tokens in %s are unreadable (%s); recomputing", cache, error)
            break
        kept.append(segment)
        parts.append(arrays)
        start = end
    fresh = _lines(data[start:])
    if fresh or not kept:
        ids, labels, offsets = tokenize_lines(fresh, tokenizer)
        arrays = (ids.astype(np.int32), labels.astype(np.int32), np.diff(offsets))
        name = f"{_first_free(segments):06d}"
        cache.mkdir(parents=True, exist_ok=True)
        for suffix, values in zip(_ARRAYS, arrays, strict=True):
            np.save(cache / f"{name}.{suffix}.npy", values)
        kept.append({"name": name, "end": len(data), "md5": _md5(data[start:])})
        parts.append(arrays)
    write_json(cache / "entry.json", {"fingerprint": expected, "segments": kept})
    names = {f"{s['name']}.{n}.npy" for s in kept for n in _ARRAYS} | {"entry.json"}
    for stale in cache.iterdir():
        if stale.name in names:
            continue
        if stale.is_dir():
            shutil.rmtree(stale)
        else:
            stale.unlink()
    lengths = np.concatenate([p[2] for p in parts]).astype(np.int64)
    # int32 as cached (and as the shards hold them): a million chats' tokens are copied once.
    return Tokens(
        ids=np.concatenate([p[0] for p in parts]),
        labels=np.concatenate([p[1] for p in parts]),
        offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        lines_tokenized=len(fresh),
    )


def _first_free(segments: list[dict[str, object]]) -> int:
    # A new segment never takes the name of one dropped in this run.
    names = [str(s.get("name")) for s in segments if isinstance(s, dict)]
    return 1 + max((int(n) for n in names if n.isdigit()), default=0)
