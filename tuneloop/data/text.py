"""The one text normaliser: what "the same text" means wherever texts are compared.

Clean's exact-duplicate keys and exact eval matches, the near-duplicate shingles and
the demo suite's answer check all normalise through ``normalise``, so two places can
never disagree on whether two texts are equal. (Preflight's contamination check runs
the same steps vectorised in Arrow.) Near-duplicate detection also drops punctuation,
but that is a shingling choice (``tuneloop.data.neardup``), made after this normalisation.

A change here changes clean's sample ids and its train/validation split, and clean's
cache keys on this file's bytes, so the cache is recomputed, never reused, after one.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from pathlib import Path

_WHITESPACE = re.compile(r"\s+")
# A text's key: the first bytes of the sha256 of its normalised form.
KEY_BYTES = 16


def normalise(text: str) -> str:
    """NFKC, lower case, every run of whitespace made one space, ends stripped.

    NFKC first, so full-width letters, digits and punctuation (common in Chinese
    text) become their ordinary forms before the other steps see them.
    """
    text = unicodedata.normalize("NFKC", text).lower()
    return _WHITESPACE.sub(" ", text).strip()


def key(text: str) -> bytes:
    """What clean's exact eval matches and preflight's contamination check compare."""
    return hashlib.sha256(normalise(text).encode()).digest()[:KEY_BYTES]


def keys_version() -> bytes:
    """What ``key`` gives for a text besides the text: this module's code and the Unicode
    tables NFKC follows (Python's). Keys kept in a file are compared only under the same."""
    digest = hashlib.sha256(Path(__file__).read_bytes())
    digest.update(unicodedata.unidata_version.encode())
    return digest.digest()
