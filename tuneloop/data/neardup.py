"""Near-duplicate detection for cleaning training data and decontaminating it against evals.

Texts are normalised (``tuneloop.data.text.normalise``), punctuation is dropped and cut into
overlapping character n-grams. Characters rather than words because Chinese has no
spaces to split on; n-grams over characters work the same for English. Each shingle set
is sketched with rensa's R-MinHash (Rust, a whole batch per call): a row of ``num_perm``
32-bit values, kept as numpy arrays so sketches can be cached and compared in bulk.

The index bands the sketches (LSH) and only proposes candidates; every candidate is
then checked against the query's own sketch, so a query returns exactly the keys whose
*estimated* Jaccard similarity (the share of equal sketch slots) reaches the threshold.
Because of that check the bands are tuned to miss as little as possible (a false
positive costs one comparison; a false negative leaks an eval item into training).
``tests/test_neardup.py`` measures recall at the thresholds in params.yaml on planted
English and Chinese pairs against datasketch's MinHash, which this replaced.
"""

from __future__ import annotations

import logging
import re
import unicodedata
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from itertools import chain

import numpy as np
from rensa import RMinHash

from tuneloop.data.text import normalise
from tuneloop.io import usable_cores

log = logging.getLogger(__name__)

NUM_PERM = 128
NGRAM = 5
SEED = 1
# Bumped by rensa when its sketches change; cached sketches are keyed on it.
SKETCH_VERSION = f"rensa-rminhash-{RMinHash.ALGORITHM_VERSION}"

# (false-positive weight, false-negative weight) for the choice of bands and rows. Recall
# matters more, and precision is restored by the exact check.
_LSH_WEIGHTS = (0.2, 0.8)
# Thresholds near 1 would band the permutations into one band of all rows, which misses
# pairs at 0.95. A lower LSH threshold only proposes more candidates; the caller's
# threshold is still applied exactly, and at 128 permutations a pair at 0.95 is proposed
# with probability above 0.998.
_MAX_LSH_THRESHOLD = 0.85
_MIN_NUM_PERM = 16
# Candidate pairs checked per numpy step: bounds the memory of a bulk query.
_PAIRS_PER_STEP = 1 << 17
# Rows merged into the sorted band keys at once from which the bands are merged by threads.
_THREADED_MERGE = 1 << 16

# A space with a CJK character (ideographs, kana, hangul) on either side.
_CJK = r"\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff"
_CJK_SPACE_RE = re.compile(rf"(?<=[{_CJK}]) | (?=[{_CJK}])")
_WHITESPACE_RE = re.compile(r"\s+")


class _PunctuationToSpace(dict[int, str]):
    """A ``str.translate`` table: punctuation (Unicode category P*) to a space, the rest kept.

    Filled as characters are met, so no start-up scan of all of Unicode; a per-character
    Python loop took 5x as long as the rest of the sketching.
    """

    def __missing__(self, code: int) -> str:
        char = chr(code)
        self[code] = " " if unicodedata.category(char).startswith("P") else char
        return self[code]


_PUNCTUATION = _PunctuationToSpace()


def shingle_text(text: str) -> str:
    """The normalised text with punctuation made space, and no space next to a CJK character.

    Punctuation becomes a space, not nothing, so "foo,bar" and "foo bar" agree. Spaces stay
    inside shingles so word boundaries still count in English, but a space next to a Chinese
    character is dropped: Chinese writers differ on spacing ("用Python训练" / "用 Python 训练").
    """
    text = _WHITESPACE_RE.sub(" ", normalise(text).translate(_PUNCTUATION)).strip()
    return _CJK_SPACE_RE.sub("", text)


def shingles(text: str, ngram: int) -> set[str]:
    """Character n-grams of ``shingle_text``; a text shorter than ``ngram`` is one shingle."""
    norm = shingle_text(text)
    if len(norm) <= ngram:
        return {norm}
    return {norm[i : i + ngram] for i in range(len(norm) - ngram + 1)}


def sketch_texts(
    texts: Iterable[str], ngram: int = NGRAM, num_perm: int = NUM_PERM, seed: int = SEED
) -> np.ndarray:
    """One R-MinHash row (``num_perm`` uint32) per text, as an ``(n, num_perm)`` array.

    Equal texts are sketched once (greetings and stock questions recur by the thousand, and
    reading a row out of rensa costs more than computing it).
    """
    texts = list(texts)
    distinct: dict[str, int] = {}
    which = np.fromiter(
        (distinct.setdefault(text, len(distinct)) for text in texts),
        dtype=np.int64,
        count=len(texts),
    )
    if not distinct:
        return np.zeros((0, num_perm), dtype=np.uint32)
    matrix = RMinHash.digest_matrix_from_token_sets(
        [shingles(text, ngram) for text in distinct], num_perm, seed
    )
    rows = matrix.to_rows()
    flat = np.fromiter(chain.from_iterable(rows), dtype=np.uint32, count=len(rows) * num_perm)
    return flat.reshape(len(rows), num_perm)[which]


def similarity(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Estimated Jaccard of sketch rows: the share of slots that agree (row by row)."""
    return np.count_nonzero(a == b, axis=-1) / a.shape[-1]


@cache
def band_layout(threshold: float, num_perm: int) -> tuple[int, int]:
    """(bands, rows per band) minimising the weighted false-positive and -negative areas.

    The criterion datasketch's MinHashLSH uses, integrated on a grid in numpy for every
    layout at once instead of through scipy (whose import alone took seconds).
    """
    threshold = min(threshold, _MAX_LSH_THRESHOLD)
    layouts = [(b, r) for b in range(2, num_perm + 1) for r in range(1, num_perm // b + 1)]
    bands = np.array([b for b, _ in layouts], dtype=np.float64)[:, None]
    rows = np.array([r for _, r in layouts], dtype=np.float64)[:, None]
    s = np.linspace(0.0, 1.0, 4001)[None, :]
    proposed = 1.0 - (1.0 - s**rows) ** bands
    below = s <= threshold
    false_positive = np.trapezoid(np.where(below, proposed, 0.0), s, axis=1)
    false_negative = np.trapezoid(np.where(below, 0.0, 1.0 - proposed), s, axis=1)
    error = _LSH_WEIGHTS[0] * false_positive + _LSH_WEIGHTS[1] * false_negative
    return layouts[int(np.argmin(error))]


# Odd 64-bit multipliers (from SplitMix64) for folding a band's rows into one key.
_MIX_A = np.uint64(0x9E3779B97F4A7C15)
_MIX_B = np.uint64(0xBF58476D1CE4E5B9)


def band_keys(sketches: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """One uint64 key per band and row of ``sketches``: ``(n, bands)``.

    Equal bands give equal keys; unequal bands collide with probability about 2^-64, and a
    collision only proposes a candidate, which the exact check then rejects.
    """
    keys = np.zeros((len(sketches), bands), dtype=np.uint64)
    values = sketches[:, : bands * rows].astype(np.uint64).reshape(len(sketches), bands, rows)
    for j in range(rows):
        keys = (keys ^ values[:, :, j]) * _MIX_A
        keys ^= keys >> np.uint64(31)
    return (keys * _MIX_B) ^ (keys >> np.uint64(29))


class NearDupIndex:
    """Banded MinHash index of sketches under integer ids (insertion order) and optional keys.

    ``threshold`` is the Jaccard similarity of shingle sets at which two texts count as
    near-duplicates. All sketches share one ``(num_perm, seed)``, which is what makes them
    comparable and the results the same from run to run. A Chinese character carries more
    than a Latin letter, so one edit spoils ``ngram`` shingles out of few: 5 suits English,
    3 suits mostly-Chinese text.

    Sketches are held in blocks (numpy arrays or memory maps, so a cached index need not be
    read into memory) and the band keys in one sorted array per band, so a bulk query is a
    few ``searchsorted`` calls rather than a Python loop. Add in bulk: each add merges.
    """

    def __init__(
        self, threshold: float, num_perm: int = NUM_PERM, ngram: int = NGRAM, seed: int = SEED
    ) -> None:
        if not 0.0 < threshold <= 1.0:
            raise ValueError(f"threshold must be in (0, 1], got {threshold}")
        if num_perm < _MIN_NUM_PERM:
            raise ValueError(f"num_perm must be at least {_MIN_NUM_PERM}, got {num_perm}")
        if ngram < 1:
            raise ValueError(f"ngram must be at least 1, got {ngram}")
        self.threshold = threshold
        self.num_perm = num_perm
        self.ngram = ngram
        self.seed = seed
        self.bands = band_layout(threshold, num_perm)
        self._blocks: list[np.ndarray] = []
        self._block_starts: list[int] = []
        self._size = 0
        n_bands = self.bands[0]
        self._sorted_keys = np.zeros((n_bands, 0), dtype=np.uint64)
        self._sorted_ids = np.zeros((n_bands, 0), dtype=np.int64)
        self._pending: list[np.ndarray] = []  # band keys added since the last merge
        self._keys: list[str] = []
        self._key_set: set[str] = set()
        log.debug("near-dup index at %s: %d bands x %d rows", threshold, *self.bands)

    def __len__(self) -> int:
        return self._size

    def __contains__(self, key: object) -> bool:
        return key in self._key_set

    def sketch(self, text: str) -> np.ndarray:
        """The sketch row of ``text`` under this index's permutations."""
        return self.sketch_many([text])[0]

    def sketch_many(self, texts: Iterable[str]) -> np.ndarray:
        return sketch_texts(texts, self.ngram, self.num_perm, self.seed)

    def band_keys(self, sketches: np.ndarray) -> np.ndarray:
        return band_keys(sketches, *self.bands)

    def add(self, key: str, text: str) -> None:
        """Index ``text`` under ``key``; a key can be added once."""
        self.add_sketches(self.sketch_many([text]), [key])

    def add_sketches(
        self,
        sketches: np.ndarray,
        keys: Sequence[str] | None = None,
        band_keys: np.ndarray | None = None,
    ) -> None:
        """Index sketch rows (ids continue from ``len(self)``); ``band_keys`` if already known.

        Keys are all or nothing: an index either names every row or none.
        """
        self._check_shape(sketches)
        if keys is not None:
            if len(keys) != len(sketches) or (self._size and not self._keys):
                raise ValueError("give one key per sketch row, and keys for every row or none")
            for key in keys:
                if key in self._key_set:
                    raise ValueError(f"key {key!r} is already in the index; keys must be unique")
                self._key_set.add(key)
                self._keys.append(key)
        elif self._keys:
            raise ValueError("this index names its rows: pass keys")
        if not len(sketches):
            return
        if band_keys is None:
            band_keys = self.band_keys(sketches)
        # Merged into the sorted keys when next queried: a month's clean adds the history
        # segment by segment before its first query, and a merge per add was O(history) each.
        self._pending.append(np.asarray(band_keys))
        self._blocks.append(sketches)
        self._block_starts.append(self._size)
        self._size += len(sketches)

    def _merge_pending(self) -> None:
        if not self._pending:
            return
        # One row a band, each contiguous: a band is a column of the rows as added.
        by_band = np.concatenate([np.asarray(k).T for k in self._pending], axis=1)
        self._pending = []
        old = self._sorted_keys.shape[1]
        ids = np.arange(old, old + by_band.shape[1], dtype=np.int64)
        merged_keys = np.empty((self.bands[0], old + by_band.shape[1]), dtype=np.uint64)
        merged_ids = np.empty_like(merged_keys, dtype=np.int64)

        def merge(band: int) -> None:
            order = np.argsort(by_band[band], kind="stable")
            new_keys = by_band[band][order]
            if not old:  # a month's clean: the whole history at once, nothing to insert into
                merged_keys[band], merged_ids[band] = new_keys, ids[order]
                return
            # New ids are larger than all old ones: inserting after equal keys keeps each
            # run of equal keys in id order.
            at = np.searchsorted(self._sorted_keys[band], new_keys, side="right")
            merged_keys[band] = np.insert(self._sorted_keys[band], at, new_keys)
            merged_ids[band] = np.insert(self._sorted_ids[band], at, ids[order])

        # The bands are independent and numpy sorts without the GIL: threads merge a history
        # of a million rows on two cores in about half the time of one loop (0.6 s, not 1-2 s).
        workers = min(self.bands[0], usable_cores()) if by_band.shape[1] >= _THREADED_MERGE else 1
        if workers > 1:
            with ThreadPoolExecutor(workers) as pool:
                list(pool.map(merge, range(self.bands[0])))
        else:
            for band in range(self.bands[0]):
                merge(band)
        self._sorted_keys, self._sorted_ids = merged_keys, merged_ids

    def query(self, text: str) -> list[str]:
        """Keys of indexed texts whose estimated Jaccard with ``text`` reaches the threshold.

        Most similar first; ties in the order the keys were added.
        """
        if self._size and not self._keys:
            raise ValueError("this index holds no keys; use query_sketches")
        rows, ids, _ = self.query_sketches(self.sketch_many([text]))
        return [self._keys[i] for i in ids[rows == 0].tolist()]

    def query_sketches(
        self, sketches: np.ndarray, band_keys: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every (query row, indexed id, similarity) at or above the threshold.

        Sorted by query row, then most similar first, then by id.
        """
        self._check_shape(sketches)
        if band_keys is None:
            band_keys = self.band_keys(sketches)
        rows, ids = self._candidates(band_keys)
        keep_rows, keep_ids, keep_sims = [], [], []
        for start in range(0, len(rows), _PAIRS_PER_STEP):
            r = rows[start : start + _PAIRS_PER_STEP]
            i = ids[start : start + _PAIRS_PER_STEP]
            # Pairs come in id order: each indexed row is read once, in the order the rows lie
            # (a history on disk is memory-mapped, and one row may pair with many).
            first = _run_starts(i)
            indexed = self.rows(i[first])[np.cumsum(first) - 1]
            sims = similarity(sketches[r], indexed)
            hit = sims >= self.threshold
            keep_rows.append(r[hit])
            keep_ids.append(i[hit])
            keep_sims.append(sims[hit])
        if not keep_rows:
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty, np.zeros(0, dtype=np.float64)
        r, i, s = np.concatenate(keep_rows), np.concatenate(keep_ids), np.concatenate(keep_sims)
        order = np.lexsort((i, -s, r))
        return r[order], i[order], s[order]

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """The indexed sketch rows of ``ids``."""
        if len(self._blocks) == 1:
            return np.asarray(self._blocks[0][ids])
        out = np.empty((len(ids), self.num_perm), dtype=np.uint32)
        which = np.searchsorted(self._block_starts, ids, side="right") - 1
        for b in np.unique(which).tolist():
            at = np.flatnonzero(which == b)
            out[at] = self._blocks[b][ids[at] - self._block_starts[b]]
        return out

    def first_occurrences(
        self, sketches: np.ndarray, band_keys: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Keep each row unless it near-duplicates an indexed row or an earlier kept row.

        Returns ``(kept, match)``: a bool per row, and for each dropped row the id of the most
        similar row it duplicates (ties: the earliest), -1 for kept ones. Kept rows are added
        to the index, in order, so their ids are ``len(self)`` onwards. Only kept rows are
        ever compared with, never one already dropped.
        """
        self._check_shape(sketches)
        if self._keys:
            raise ValueError("first_occurrences adds rows without keys; use an index without keys")
        if band_keys is None:
            band_keys = self.band_keys(sketches)
        n = len(sketches)
        best_sim = np.zeros(n, dtype=np.float64)
        best_id = np.full(n, -1, dtype=np.int64)
        rows, ids, sims = self.query_sketches(sketches, band_keys)
        if len(rows):
            first = np.concatenate([[True], rows[1:] != rows[:-1]])
            best_sim[rows[first]] = sims[first]
            best_id[rows[first]] = ids[first]

        # Within the batch the order matters, so this part is a loop; a row only ever meets
        # the kept rows that share a band key with it.
        buckets: list[dict[int, list[int]]] = [{} for _ in range(self.bands[0])]
        kept = np.zeros(n, dtype=bool)
        local_match = np.full(n, -1, dtype=np.int64)
        for row, keys in enumerate(band_keys.tolist()):
            candidates: set[int] = set()
            for bucket, key in zip(buckets, keys, strict=True):
                found = bucket.get(key)
                if found:
                    candidates.update(found)
            if candidates:
                earlier = np.fromiter(sorted(candidates), dtype=np.int64, count=len(candidates))
                sims_here = similarity(sketches[earlier], sketches[row])
                j = int(np.argmax(sims_here))
                # Indexed rows came first: they win ties with rows of this batch.
                if sims_here[j] >= self.threshold and sims_here[j] > best_sim[row]:
                    best_sim[row] = sims_here[j]
                    local_match[row] = earlier[j]
            if best_id[row] < 0 and local_match[row] < 0:
                kept[row] = True
                for bucket, key in zip(buckets, keys, strict=True):
                    bucket.setdefault(key, []).append(row)

        new_id = np.cumsum(kept) - 1 + self._size
        match = np.where(local_match >= 0, new_id[np.maximum(local_match, 0)], best_id)
        match[kept] = -1
        self.add_sketches(sketches[kept], band_keys=band_keys[kept])
        return kept, match

    def _candidates(self, band_keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Distinct (query row, id) pairs that share at least one band key, by id then row."""
        if not self._size or not len(band_keys):
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty
        self._merge_pending()
        rows, ids = [], []
        for band in range(self.bands[0]):
            sorted_keys = self._sorted_keys[band]
            lo = np.searchsorted(sorted_keys, band_keys[:, band], side="left")
            hi = np.searchsorted(sorted_keys, band_keys[:, band], side="right")
            counts = hi - lo
            hit = np.flatnonzero(counts)
            if not len(hit):
                continue
            counts = counts[hit]
            total = int(counts.sum())
            run_start = np.repeat(np.cumsum(counts) - counts, counts)
            positions = np.repeat(lo[hit], counts) + np.arange(total) - run_start
            rows.append(np.repeat(hit, counts))
            ids.append(self._sorted_ids[band][positions])
        if not rows:
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty
        # Ordered by id, then query row: see query_sketches.
        n_rows = len(band_keys)
        pairs = _distinct(np.concatenate(ids) * n_rows + np.concatenate(rows))
        return pairs % n_rows, pairs // n_rows

    def _check_shape(self, sketches: np.ndarray) -> None:
        if sketches.ndim != 2 or sketches.shape[1] != self.num_perm:
            raise ValueError(
                f"sketches must be (n, {self.num_perm}) rows of this index's permutations, "
                f"got shape {sketches.shape}"
            )


def _distinct(values: np.ndarray) -> np.ndarray:
    """The distinct values of an int64 array, sorted: ``np.unique`` by a sort.

    numpy 2's ``np.unique`` hashes instead: on the ten million candidate pairs (most of them
    repeated across bands) a month's query against a million-record history makes, it took
    8 s where a sort and a mask take 0.4 s.
    """
    ordered = np.sort(values)
    return ordered[_run_starts(ordered)]


def _run_starts(ordered: np.ndarray) -> np.ndarray:
    """True where a sorted array's value differs from the one before it (and at the start)."""
    first = np.empty(len(ordered), dtype=bool)
    first[:1] = True
    np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
    return first


def dedup(
    keys_texts: Iterable[tuple[str, str]],
    threshold: float,
    *,
    num_perm: int = NUM_PERM,
    ngram: int = NGRAM,
    seed: int = SEED,
) -> tuple[list[str], dict[str, str]]:
    """Drop near-duplicates, keeping the first occurrence.

    Returns the kept keys in input order and, for every dropped key, the kept key it
    duplicates (the most similar one). Only kept texts are compared with, never one
    already dropped.
    """
    keys: list[str] = []
    texts: list[str] = []
    seen: set[str] = set()
    for key, text in keys_texts:
        if key in seen:
            raise ValueError(f"key {key!r} appears twice in the input; keys must be unique")
        seen.add(key)
        keys.append(key)
        texts.append(text)
    index = NearDupIndex(threshold, num_perm=num_perm, ngram=ngram, seed=seed)
    kept_mask, match = index.first_occurrences(index.sketch_many(texts))
    kept = [k for k, keep in zip(keys, kept_mask.tolist(), strict=True) if keep]
    removed = {keys[row]: kept[int(match[row])] for row in np.flatnonzero(~kept_mask).tolist()}
    log.info("dedup at Jaccard >= %s: kept %d, removed %d", threshold, len(kept), len(removed))
    return kept, removed
