"""Pooled records into training chats: the rules, each record's work, and the decisions.

Every record ends kept (train or val) or removed with one counted reason, checked in
this order: a badcase without a correction, a reply too short, degenerate repetition,
over the token limit (``filter_reason``), an eval item's exact or near duplicate, an
exact duplicate of an earlier record, a near duplicate of an earlier *kept* record, or
outside the pilot sample. The split is by content hash, so a sample never moves between
train and val from one month to the next.

The work comes in two kinds, so that ``tuneloop.data.clean_cache`` can keep both:

- **Features** (``features``), per record and independent of every other record: the
  chat, its sample line, the filter verdict with the token count behind it, its content
  key, the MinHash sketches of the whole text and of each user turn; one batched token
  count and one batched sketch call per chunk. ``features_fingerprint`` names all they
  depend on besides the record: filter params, the tokenizer's files, the sketch
  parameters and the source of the code that computes them.
- **Decisions** (``decide``), which depend on everything before a record: eval
  contamination, exact and near duplicates, the pilot sample and the split, made for a
  run of records against the ``History`` of the ones before it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass, fields
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from tuneloop.data import neardup
from tuneloop.data.chat import ChatTokenizer, render
from tuneloop.data.neardup import NearDupIndex
from tuneloop.data.text import KEY_BYTES, normalise
from tuneloop.data.text import key as text_key
from tuneloop.params import CleanParams

log = logging.getLogger(__name__)

# Why a record was removed; the decision codes are TRAIN, VAL and 2 + index here.
REASONS = (
    "badcase_without_correction",
    "response_too_short",
    "degenerate_repetition",
    "over_token_limit",
    "eval_contamination",
    "exact_duplicate",
    "near_duplicate",
    "not_in_pilot",
)
TRAIN, VAL = 0, 1
CODE = {reason: 2 + i for i, reason in enumerate(REASONS)}
# Why a DPO pair is removed though its badcase's chat (prompt + correction) is kept: the
# rejected side goes through the same filters as any reply, and a pair whose two answers are
# the same text teaches nothing. Codes are 1 + index; 0 is a pair that passes.
DPO_REASONS = (
    "rejected_response_too_short",
    "rejected_degenerate_repetition",
    "rejected_over_token_limit",
    "chosen_equals_rejected",
)
DPO_CODE = {reason: 1 + i for i, reason in enumerate(DPO_REASONS)}
# A kept training chat of a batch the starting model already trained on, outside the replay
# share (clean.replay_fraction); decided after the cached decisions, see tuneloop.data.clean_cache.
NOT_REPLAYED = "not_replayed"
# Records that reached the exact-duplicate check and were not duplicates of one before.
_FIRST_SEEN = (TRAIN, VAL, CODE["not_in_pilot"], CODE["near_duplicate"])
# The modules whose code shapes features and decisions: their bytes key the cache.
_CODE_FILES = ("text.py", "neardup.py", "chat.py", "clean.py", "clean_cache.py")

Messages = list[dict[str, str]]


# --- one record ------------------------------------------------------------------------


def to_chat(record: dict[str, Any]) -> Messages | None:
    """The conversation to learn from: a chat as is; a badcase with its correction as the reply."""
    messages = [{"role": m["role"], "content": m["content"]} for m in record["messages"]]
    if record["kind"] == "chat":
        return messages
    if record.get("corrected_response") is None:
        return None
    return [*messages, {"role": "assistant", "content": record["corrected_response"]}]


def dpo_pair(record: dict[str, Any]) -> dict[str, Any] | None:
    """A badcase with its correction as a preference pair; None for anything else."""
    if record["kind"] != "badcase" or record.get("corrected_response") is None:
        return None
    return {
        "id": record["id"],
        "prompt": [{"role": m["role"], "content": m["content"]} for m in record["messages"]],
        "chosen": record["corrected_response"],
        "rejected": record["bad_response"],
    }


def distinct_ngram_share(text: str, n: int = 4) -> float:
    """Share of distinct character n-grams: near 0 for 'ok ok ok ok ...', near 1 for prose."""
    grams = [text[i : i + n] for i in range(len(text) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 1.0


def quick_filter_reason(messages: Messages, params: CleanParams) -> str | None:
    """The filters that need no tokenizer: a reply too short or mostly one phrase repeated."""
    replies = [m["content"].strip() for m in messages if m["role"] == "assistant"]
    if min(len(r) for r in replies) < params.min_response_chars:
        return "response_too_short"
    if any(len(r) >= 40 and distinct_ngram_share(r) < params.min_distinct_ngrams for r in replies):
        return "degenerate_repetition"
    return None


def token_limit_reason(n_tokens: int, params: CleanParams) -> str | None:
    return "over_token_limit" if n_tokens > params.max_tokens else None


def filter_reason(messages: Messages, params: CleanParams, count_tokens: Any) -> str | None:
    """Why a conversation is not fit to train on, or None; ``count_tokens(messages) -> int``.

    ``features`` applies the same two steps to a whole chunk, with one batched token count.
    """
    return quick_filter_reason(messages, params) or token_limit_reason(
        count_tokens(messages), params
    )


def text_digest(messages: Messages) -> bytes:
    """The content key of a conversation: equal after normalisation means an exact duplicate."""
    joined = "\n".join(f"{m['role']}: {normalise(m['content'])}" for m in messages)
    return hashlib.sha256(joined.encode()).digest()


def hash_fraction(key: str, salt: str) -> float:
    """A stable number in [0, 1) from a key: the same sample lands on the same side every month."""
    return int(hashlib.sha256(f"{salt}:{key}".encode()).hexdigest()[:12], 16) / 16**12


def hash_fractions(keys: np.ndarray, salt: str) -> np.ndarray:
    """A stable number in [0, 1) for each of a column of keys (``(n, >= 8)`` uint8 digests),
    as ``hash_fraction`` gives one for a key, though not the same number.

    The replay draw takes one number per pooled sample every month, a million of them: a
    sha256 per sample in Python cost 2.5 s there. The keys are sha256 digests already, so
    their first 8 bytes, mixed with the salt's digest by splitmix64's finalizer (a
    bijection of uint64), are as good a draw, and numpy does them in milliseconds.
    """
    mix = np.uint64(int.from_bytes(hashlib.sha256(salt.encode()).digest()[:8], "little"))
    x = np.ascontiguousarray(keys[:, :8]).view("<u8").ravel() ^ mix
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps, as splitmix64 means it to
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return (x >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def user_turns(messages: Messages) -> list[str]:
    return [m["content"] for m in messages if m["role"] == "user"]


# --- features: per record, independent of the others -------------------------------------------


@dataclass
class Features:
    """The per-record work of a run of records, aligned by record (``n`` rows).

    ``verdict`` is 0 for a record that passes the filters, else its removal code; sketches,
    keys and the sample line are filled for passing records only (zeros / empty elsewhere).
    """

    verdict: np.ndarray  # (n,) uint8
    tokens: np.ndarray  # (n,) int32, -1 where not counted
    key: np.ndarray  # (n, 32) uint8: text_digest
    sketch: np.ndarray  # (n, NUM_PERM) uint32: the whole conversation's text
    user_offsets: np.ndarray  # (n + 1,) int64: record i's user turns are rows [o[i], o[i + 1])
    user_key: np.ndarray  # (m, KEY_BYTES) uint8: digest of each normalised user turn
    user_sketch: np.ndarray  # (m, NUM_PERM) uint32
    lines: np.ndarray  # uint8 blob: each passing record's train/val line, newline included
    line_offsets: np.ndarray  # (n + 1,) int64
    dpo: np.ndarray  # uint8 blob: each badcase's preference pair line
    dpo_offsets: np.ndarray  # (n + 1,) int64
    dpo_verdict: np.ndarray  # (n,) uint8: 0, or the DPO_CODE of the pair's own filter

    def __len__(self) -> int:
        return len(self.verdict)

    def user_rows(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The user turns of records ``rows``, in order, and how many each record has."""
        counts = self.user_offsets[rows + 1] - self.user_offsets[rows]
        starts = np.repeat(self.user_offsets[rows], counts)
        within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        return starts + within, counts

    def save(self, folder: Path) -> None:
        for f in fields(self):
            np.save(folder / f"{f.name}.npy", getattr(self, f.name))

    @classmethod
    def load(cls, folder: Path) -> Features:
        """Memory-mapped: a segment's arrays are read as they are used."""
        return cls(
            **{f.name: np.load(folder / f"{f.name}.npy", mmap_mode="r") for f in fields(cls)}
        )

    @classmethod
    def concatenate(cls, parts: Sequence[Features]) -> Features:
        def offsets(name: str) -> np.ndarray:
            out, base = [np.zeros(1, dtype=np.int64)], 0
            for part in parts:
                values = getattr(part, name)
                out.append(values[1:] + base)
                base += int(values[-1])
            return np.concatenate(out)

        joined = {
            f.name: np.concatenate([getattr(p, f.name) for p in parts])
            for f in fields(cls)
            if not f.name.endswith("offsets")
        }
        for name in ("user_offsets", "line_offsets", "dpo_offsets"):
            joined[name] = offsets(name)
        return cls(**joined)


def _blob(lines: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    encoded = [line.encode() for line in lines]
    offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded)), out=offsets[1:])
    return np.frombuffer(b"".join(encoded), dtype=np.uint8), offsets


def features(raw_lines: Sequence[bytes], params: CleanParams, tokenizer: ChatTokenizer) -> Features:
    """The per-record work of pool lines (JSON records as ingest wrote them), in batches."""
    records = [orjson.loads(line) for line in raw_lines]
    n = len(records)
    chats = [to_chat(r) for r in records]
    reasons: list[str | None] = [
        "badcase_without_correction" if m is None else quick_filter_reason(m, params) for m in chats
    ]
    tokens = np.full(n, -1, dtype=np.int32)
    to_count = [(i, m) for i, (m, r) in enumerate(zip(chats, reasons, strict=True)) if m and not r]
    if to_count:
        counts = tokenizer.count_tokens([render(tokenizer, m) for _, m in to_count])
        for (i, _), count in zip(to_count, counts.tolist(), strict=True):
            tokens[i] = count
            reasons[i] = token_limit_reason(count, params)
    verdict = np.array([0 if r is None else CODE[r] for r in reasons], dtype=np.uint8)

    passing = [(i, m) for i, (m, r) in enumerate(zip(chats, reasons, strict=True)) if m and not r]
    key = np.zeros((n, 32), dtype=np.uint8)
    sketch = np.zeros((n, neardup.NUM_PERM), dtype=np.uint32)
    lines = [""] * n
    users_per_record = np.zeros(n, dtype=np.int64)
    user_texts: list[str] = []
    for i, messages in passing:
        digest = text_digest(messages)
        key[i] = np.frombuffer(digest, dtype=np.uint8)
        lines[i] = json.dumps({"id": digest.hex()[:16], "messages": messages}, ensure_ascii=False)
        lines[i] += "\n"
        turns = user_turns(messages)
        users_per_record[i] = len(turns)
        user_texts.extend(turns)
    if passing:
        sketch[[i for i, _ in passing]] = neardup.sketch_texts(
            ["\n".join(m["content"] for m in messages) for _, messages in passing]
        )
    user_key = np.zeros((len(user_texts), KEY_BYTES), dtype=np.uint8)
    for row, text in enumerate(user_texts):
        user_key[row] = np.frombuffer(text_key(text), dtype=np.uint8)
    pairs = [dpo_pair(r) for r in records]
    dpo_verdict = pair_verdicts(pairs, verdict, params, tokenizer)
    line_blob, line_offsets = _blob(lines)
    dpo_blob, dpo_offsets = _blob(
        ["" if p is None else json.dumps(p, ensure_ascii=False) + "\n" for p in pairs]
    )
    return Features(
        verdict=verdict,
        tokens=tokens,
        key=key,
        sketch=sketch,
        user_offsets=np.concatenate([[0], np.cumsum(users_per_record)]).astype(np.int64),
        user_key=user_key,
        user_sketch=neardup.sketch_texts(user_texts)
        if user_texts
        else np.zeros((0, neardup.NUM_PERM), dtype=np.uint32),
        lines=line_blob,
        line_offsets=line_offsets,
        dpo=dpo_blob,
        dpo_offsets=dpo_offsets,
        dpo_verdict=dpo_verdict,
    )


def pair_verdicts(
    pairs: Sequence[dict[str, Any] | None],
    verdict: np.ndarray,
    params: CleanParams,
    tokenizer: ChatTokenizer,
) -> np.ndarray:
    """The DPO filters of each pair whose chat passed its own (``DPO_CODE``, 0 = passes).

    The chosen side is the SFT chat, already filtered; the rejected side (the model's bad
    reply after the same prompt) gets the same length, repetition and token-limit rules, with
    one batched token count. A pair whose two answers normalise to the same text is removed.
    """
    out = np.zeros(len(pairs), dtype=np.uint8)
    to_count: list[tuple[int, Messages]] = []
    for i, pair in enumerate(pairs):
        if pair is None or verdict[i]:
            continue  # no pair, or its chat is removed (the pair with it, for that reason)
        rejected: Messages = [*pair["prompt"], {"role": "assistant", "content": pair["rejected"]}]
        if normalise(pair["chosen"]) == normalise(pair["rejected"]):
            out[i] = DPO_CODE["chosen_equals_rejected"]
        elif reason := quick_filter_reason(rejected, params):
            out[i] = DPO_CODE[f"rejected_{reason}"]
        else:
            to_count.append((i, rejected))
    if to_count:
        counts = tokenizer.count_tokens([render(tokenizer, m) for _, m in to_count])
        for (i, _), count in zip(to_count, counts.tolist(), strict=True):
            if token_limit_reason(count, params):
                out[i] = DPO_CODE["rejected_over_token_limit"]
    return out


def features_fingerprint(params: CleanParams, tokenizer: ChatTokenizer) -> str:
    """Everything a record's features depend on besides the record itself."""
    code = Path(__file__).parent
    digest = hashlib.sha256()
    for part in (
        params.min_response_chars,
        params.min_distinct_ngrams,
        params.max_tokens,
        tokenizer.fingerprint,
        # normalise's NFKC: keys, shingles and eval matches follow Python's Unicode tables.
        unicodedata.unidata_version,
        neardup.SKETCH_VERSION,
        version("rensa"),
        neardup.NUM_PERM,
        neardup.NGRAM,
        neardup.SEED,
    ):
        digest.update(f"{part}\0".encode())
    for name in _CODE_FILES:
        digest.update((code / name).read_bytes())
    return digest.hexdigest()


# --- decisions: in pool order, against what came before ---------------------------------


class EvalSet:
    """The eval questions, normalised and sketched: what training data must not contain."""

    def __init__(self, questions: Sequence[str], threshold: float) -> None:
        self.exact = {text_key(q) for q in questions}
        self.index = NearDupIndex(threshold)
        if questions:
            self.index.add_sketches(self.index.sketch_many(questions))
        digest = hashlib.sha256(f"{threshold}\0".encode())
        for question in sorted(normalise(q) for q in questions):
            digest.update(question.encode() + b"\0")
        self.fingerprint = digest.hexdigest()

    def contaminated(self, f: Features, rows: np.ndarray) -> np.ndarray:
        """Which of ``rows`` have a user turn equal to, or near, an eval question."""
        user_rows, counts = f.user_rows(rows)
        owner = np.repeat(np.arange(len(rows)), counts)
        hit = np.zeros(len(rows), dtype=bool)
        keys = np.asarray(f.user_key[user_rows])
        for position, user_key in enumerate(keys):
            if user_key.tobytes() in self.exact:
                hit[owner[position]] = True
        if len(user_rows) and len(self.index):
            near_rows, _, _ = self.index.query_sketches(np.asarray(f.user_sketch[user_rows]))
            hit[owner[near_rows]] = True
        return hit


class History:
    """What the records before the current one left: the content keys seen, the kept sketches."""

    def __init__(self, near_dup_threshold: float) -> None:
        self.index = NearDupIndex(near_dup_threshold)
        self._prefix = np.zeros(0, dtype=np.uint64)  # sorted; first 8 bytes of each key
        self._keys = np.zeros((0, 32), dtype=np.uint8)  # in the order of _prefix
        self._pending: list[np.ndarray] = []  # keys added since the last merge

    def seen(self, keys: np.ndarray) -> np.ndarray:
        """Which keys were seen before (exact match on all 32 bytes)."""
        self._merge_pending()
        prefix = np.ascontiguousarray(keys[:, :8]).view(np.uint64).reshape(-1)
        lo = np.searchsorted(self._prefix, prefix, side="left")
        hi = np.searchsorted(self._prefix, prefix, side="right")
        found = np.zeros(len(keys), dtype=bool)
        for row in np.flatnonzero(hi > lo).tolist():
            found[row] = bool((self._keys[lo[row] : hi[row]] == keys[row]).all(axis=1).any())
        return found

    def add_seen(self, keys: np.ndarray) -> None:
        # Merged when next asked (``seen``): one merge for a history of many segments.
        self._pending.append(np.asarray(keys))

    def _merge_pending(self) -> None:
        if not self._pending:
            return
        keys = np.concatenate(self._pending) if len(self._pending) > 1 else self._pending[0]
        self._pending = []
        prefix = np.ascontiguousarray(keys[:, :8]).view(np.uint64).reshape(-1)
        order = np.argsort(prefix, kind="stable")
        if not len(self._prefix):  # a month's clean: the whole history at once
            self._prefix, self._keys = prefix[order], np.asarray(keys)[order]
            return
        at = np.searchsorted(self._prefix, prefix[order], side="right")
        self._prefix = np.insert(self._prefix, at, prefix[order])
        self._keys = np.insert(self._keys, at, keys[order], axis=0)


@dataclass
class Decisions:
    """One segment's decisions, and what it adds to the history."""

    codes: np.ndarray  # (n,) uint8
    kept_sketch: np.ndarray  # (k, NUM_PERM) uint32, the kept records' sketches in order
    kept_bands: np.ndarray  # (k, bands) uint64, their band keys in the near-dup index

    def save(self, folder: Path) -> None:
        for f in fields(self):
            np.save(folder / f"{f.name}.npy", getattr(self, f.name))

    @classmethod
    def load(cls, folder: Path) -> Decisions:
        return cls(
            **{f.name: np.load(folder / f"{f.name}.npy", mmap_mode="r") for f in fields(cls)}
        )

    def extend(self, history: History, f: Features) -> None:
        """Add this segment's first-seen keys and kept sketches to the history."""
        codes = np.asarray(self.codes)
        history.add_seen(np.asarray(f.key[np.isin(codes, _FIRST_SEEN)]))
        history.index.add_sketches(self.kept_sketch, band_keys=np.asarray(self.kept_bands))


def decide(f: Features, history: History, evals: EvalSet, params: CleanParams) -> Decisions:
    """Each record's fate, in order, given everything before it; extends ``history``."""
    codes = np.array(f.verdict, dtype=np.uint8)
    passing = np.flatnonzero(codes == 0)
    contaminated = evals.contaminated(f, passing)
    codes[passing[contaminated]] = CODE["eval_contamination"]

    reach = passing[~contaminated]
    keys = np.asarray(f.key[reach])
    duplicate = history.seen(keys)
    first_here: set[bytes] = set()
    for position, key in enumerate(keys):
        digest = key.tobytes()
        if not duplicate[position]:
            duplicate[position] = digest in first_here
            first_here.add(digest)
    codes[reach[duplicate]] = CODE["exact_duplicate"]
    history.add_seen(keys[~duplicate])

    candidates = reach[~duplicate]
    sketches = np.asarray(f.sketch[candidates])
    bands = history.index.band_keys(sketches)
    kept_mask, _ = history.index.first_occurrences(sketches, bands)
    codes[candidates[~kept_mask]] = CODE["near_duplicate"]
    kept = candidates[kept_mask]
    for row, key in zip(kept.tolist(), np.asarray(f.key[kept]), strict=True):
        hex_key = key.tobytes().hex()
        if hash_fraction(hex_key, "pilot") >= params.pilot_fraction:
            codes[row] = CODE["not_in_pilot"]
        elif hash_fraction(hex_key, "val") < params.val_fraction:
            codes[row] = VAL
        else:
            codes[row] = TRAIN
    return Decisions(codes, sketches[kept_mask], bands[kept_mask])


def decisions_fingerprint(params: CleanParams, evals: EvalSet) -> str:
    parts = (params.near_dup_threshold, params.pilot_fraction, params.val_fraction)
    return hashlib.sha256(f"{parts}\0{evals.fingerprint}".encode()).hexdigest()
