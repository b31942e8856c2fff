"""The user turns of a training file, by key: written by clean, read by preflight.

Clean already holds each user turn's key (``tuneloop.data.text.key``: a digest of the normalised
text) for its own decontamination. It writes the keys of the turns it puts in train.jsonl
beside it (``train.turns.npz``: the key and the line of each turn) with a digest of the file's
bytes. Preflight's contamination check then looks the eval questions' keys up in those
arrays instead of parsing hundreds of MB of JSON and normalising every turn again (0.6 s of
its 1 s budget at 100k chats).

The keys are only trusted for the exact bytes they were written for: the digest is of the
whole file (xxh3-128, 20 ms for 200 MB; sha256 takes 140 ms), so a train.jsonl edited by
hand, or by anything but clean, is never checked against stale keys; preflight parses it.
Nor are keys made by another normaliser (``text.keys_version``: its code, Python's Unicode
tables), which would not match today's keys of the same eval questions.
"""

from __future__ import annotations

import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from tuneloop.data.text import KEY_BYTES, keys_version

NAME = "train.turns.npz"


class TurnKeysWriter:
    """Collects the keys of the turns of each chunk of lines as clean writes them."""

    def __init__(self) -> None:
        self._digest = xxhash.xxh3_128()
        self._size = 0
        self._lines = 0
        self._rows: list[np.ndarray] = []
        self._keys: list[np.ndarray] = []

    def add(self, data: bytes, n_lines: int, turns_per_line: np.ndarray, keys: np.ndarray) -> None:
        """``data``: ``n_lines`` lines as written; line i has ``turns_per_line[i]`` of ``keys``."""
        self._digest.update(data)
        self._size += len(data)
        self._rows.append(np.repeat(np.arange(self._lines, self._lines + n_lines), turns_per_line))
        self._keys.append(np.asarray(keys, dtype=np.uint8).reshape(-1, KEY_BYTES))
        self._lines += n_lines

    def save(self, path: Path) -> None:
        rows = np.concatenate(self._rows) if self._rows else np.zeros(0, dtype=np.int64)
        keys = np.concatenate(self._keys) if self._keys else np.zeros((0, KEY_BYTES), np.uint8)
        with path.open("wb") as out:
            np.savez(
                out,
                rows=rows.astype(np.int64),
                keys=keys,
                digest=np.frombuffer(self._digest.digest(), dtype=np.uint8),
                size=np.array([self._size], dtype=np.int64),
                version=np.frombuffer(keys_version(), dtype=np.uint8),
            )


@dataclass(frozen=True)
class TurnKeys:
    rows: np.ndarray  # (m,) int64: the line of train.jsonl (0-based) each turn is on
    keys: np.ndarray  # (m, KEY_BYTES) uint8

    def find(self, wanted: set[bytes]) -> np.ndarray:
        """Indices of the turns whose key is in ``wanted``, in file order."""
        if not len(self.keys) or not wanted:
            return np.zeros(0, dtype=np.int64)
        # A first cut on the keys' first 8 bytes as numbers (vectorised), then the whole key.
        heads = np.ascontiguousarray(self.keys[:, :8]).view(np.uint64).ravel()
        wanted_heads = np.array([int.from_bytes(k[:8], "little") for k in wanted], np.uint64)
        candidates = np.flatnonzero(np.isin(heads, wanted_heads))
        return np.array(
            [i for i in candidates.tolist() if self.keys[i].tobytes() in wanted], dtype=np.int64
        )


def read(path: Path, data: bytes) -> TurnKeys | None:
    """The keys written for exactly ``data`` (the training file's bytes) by today's ``text.key``,
    or None: missing, unreadable, written for other bytes or by another normaliser."""
    try:
        with np.load(path, allow_pickle=False) as saved:
            rows, keys = saved["rows"], saved["keys"]
            digest, size = saved["digest"].tobytes(), int(saved["size"][0])
            version = saved["version"].tobytes()
    except (OSError, EOFError, KeyError, ValueError, IndexError, zipfile.BadZipFile):
        return None
    if size != len(data) or digest != xxhash.xxh3_128_digest(data):
        return None
    if version != keys_version():  # keys of another normaliser: not comparable with today's
        return None
    if keys.dtype != np.uint8 or keys.ndim != 2 or keys.shape[1] != KEY_BYTES:
        return None
    if rows.shape != (len(keys),):
        return None
    return TurnKeys(rows=rows, keys=keys)
