"""Near-duplicate detection for cleaning training data and decontaminating it against evals.

Texts are normalised (NFKC, lowercase, whitespace collapsed, punctuation
dropped) and cut into overlapping character n-grams. Characters rather than
words because Chinese has no spaces to split on; n-grams over characters work
the same for English. Each shingle set is sketched with a datasketch
``MinHash`` and indexed in a ``MinHashLSH``.

LSH only proposes candidates. Every candidate is then checked against the
query's own MinHash, so ``query`` returns exactly the keys whose *estimated*
Jaccard similarity reaches the threshold. Because of that check the LSH bands
are tuned to miss as little as possible (a false positive costs one
comparison; a false negative leaks an eval item into training).
"""

from __future__ import annotations

import logging
import re
import unicodedata
from collections.abc import Iterable

from datasketch import MinHash, MinHashLSH

log = logging.getLogger(__name__)

# (false-positive weight, false-negative weight) for datasketch's choice of
# bands and rows. Recall matters more, and precision is restored by the exact
# check in query().
_LSH_WEIGHTS = (0.2, 0.8)
# datasketch cannot band the permutations for thresholds near 1 (it needs at
# least two bands: above 0.85 at 16 permutations, at 1.0 always). A lower LSH
# threshold only proposes more candidates; query() still applies the caller's
# threshold exactly, and at 128 permutations a pair at 0.95 is still proposed
# with probability above 0.998.
_MAX_LSH_THRESHOLD = 0.85
_MIN_NUM_PERM = 16
_WHITESPACE_RE = re.compile(r"\s+")

# A space with a CJK character (ideographs, kana, hangul) on either side.
_CJK = r"\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff"
_CJK_SPACE_RE = re.compile(rf"(?<=[{_CJK}]) | (?=[{_CJK}])")


def normalise(text: str) -> str:
    """NFKC, lowercase, punctuation removed, runs of whitespace made one space, ends stripped.

    NFKC first so full-width letters, digits and punctuation (common in
    Chinese text) become their ordinary forms before the other steps see them.
    """
    text = unicodedata.normalize("NFKC", text).lower()
    # Punctuation becomes a space, not nothing, so "foo,bar" and "foo bar" agree.
    text = "".join(" " if unicodedata.category(ch).startswith("P") else ch for ch in text)
    return _WHITESPACE_RE.sub(" ", text).strip()


def shingles(text: str, ngram: int) -> set[str]:
    """Character n-grams of the normalised text; a text shorter than ``ngram`` is one shingle.

    Spaces stay inside shingles so word boundaries still count in English, but
    a space next to a Chinese character is dropped: Chinese writers differ on
    spacing ("用Python训练" / "用 Python 训练"), so there it is noise.
    """
    norm = _CJK_SPACE_RE.sub("", normalise(text))
    if len(norm) <= ngram:
        return {norm}
    return {norm[i : i + ngram] for i in range(len(norm) - ngram + 1)}


class NearDupIndex:
    """MinHash LSH index of texts under string keys.

    ``threshold`` is the Jaccard similarity of shingle sets at which two texts
    count as near-duplicates. All sketches share one set of permutations
    (``num_perm``, ``seed``), which is what makes them comparable and the
    results the same from run to run. A Chinese character carries more than a
    Latin letter, so one edit spoils ``ngram`` shingles out of few: 5 suits
    English, 3 suits mostly-Chinese text.
    """

    def __init__(
        self, threshold: float, num_perm: int = 128, ngram: int = 5, seed: int = 1
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
        # Generated once: MinHash would otherwise redraw them for every text.
        self._permutations = MinHash(num_perm=num_perm, seed=seed).permutations
        self._lsh = MinHashLSH(
            threshold=min(threshold, _MAX_LSH_THRESHOLD), num_perm=num_perm, weights=_LSH_WEIGHTS
        )
        # key -> (insertion order, sketch); the order breaks similarity ties.
        self._sketches: dict[str, tuple[int, MinHash]] = {}
        log.debug("MinHashLSH for threshold %s: %d bands x %d rows", threshold, *self.bands)

    @property
    def bands(self) -> tuple[int, int]:
        """(bands, rows per band) that datasketch chose for the threshold."""
        return self._lsh.b, self._lsh.r

    def __len__(self) -> int:
        return len(self._sketches)

    def __contains__(self, key: object) -> bool:
        return key in self._sketches

    def sketch(self, text: str) -> MinHash:
        """The MinHash of ``text``'s shingles under this index's permutations."""
        mh = MinHash(
            num_perm=self.num_perm,
            seed=self.seed,
            permutations=self._permutations,
            scheme="affine32",
        )
        mh.update_batch([s.encode("utf-8") for s in shingles(text, self.ngram)])
        return mh

    def add(self, key: str, text: str) -> None:
        """Index ``text`` under ``key``; a key can be added once."""
        self._add_sketch(key, self.sketch(text))

    def _add_sketch(self, key: str, mh: MinHash) -> None:
        if key in self._sketches:
            raise ValueError(f"key {key!r} is already in the index; keys must be unique")
        self._lsh.insert(key, mh, check_duplication=False)
        self._sketches[key] = (len(self._sketches), mh)

    def query(self, text: str) -> list[str]:
        """Keys of indexed texts whose estimated Jaccard with ``text`` reaches the threshold.

        Most similar first; ties in the order the keys were added.
        """
        return [key for key, _ in self._matches(self.sketch(text))]

    def _matches(self, mh: MinHash) -> list[tuple[str, float]]:
        found = []
        for key in self._lsh.query(mh):
            order, other = self._sketches[key]
            similarity = float(mh.jaccard(other))
            if similarity >= self.threshold:
                found.append((key, similarity, order))
        found.sort(key=lambda hit: (-hit[1], hit[2]))
        return [(key, similarity) for key, similarity, _ in found]


def dedup(
    keys_texts: Iterable[tuple[str, str]],
    threshold: float,
    *,
    num_perm: int = 128,
    ngram: int = 5,
    seed: int = 1,
) -> tuple[list[str], dict[str, str]]:
    """Drop near-duplicates, keeping the first occurrence.

    Returns the kept keys in input order and, for every dropped key, the kept
    key it duplicates (the most similar one). Only kept texts are indexed, so a
    text is compared with what survives, never with something already dropped.
    """
    index = NearDupIndex(threshold, num_perm=num_perm, ngram=ngram, seed=seed)
    kept: list[str] = []
    removed: dict[str, str] = {}
    for key, text in keys_texts:
        if key in removed or key in index:
            raise ValueError(f"key {key!r} appears twice in the input; keys must be unique")
        mh = index.sketch(text)
        matches = index._matches(mh)
        if matches:
            removed[key] = matches[0][0]
        else:
            index._add_sketch(key, mh)
            kept.append(key)
    log.info("dedup at Jaccard >= %s: kept %d, removed %d", threshold, len(kept), len(removed))
    return kept, removed
