"""Scrub personal data from production badcases before anything is stored.

``scrub(text)`` replaces every hit with a typed placeholder (``<EMAIL>``,
``<PHONE>``, ``<CN_ID>``, ``<BANK_CARD>``, ``<IP>``) and counts hits per type,
so a stage can log how much it removed without logging what.

Design points, each one a way mixed Chinese/English text defeats a naive scrubber:

* Chinese has no word boundaries, so ``\\b`` is useless ("手机13812345678" has no
  boundary before the 1). Patterns are fenced by digit look-arounds instead.
* Order matters. E-mail goes first (its local part may be a phone number, as
  with QQ mail); then resident ID numbers, whose 18 digits could pass Luhn and
  be miscounted as a card; then phones; then bank cards; then IP addresses.
* Checksums keep false positives down: an ID number needs a real birth date
  and a valid ISO 7064 MOD 11-2 check character, a card number must pass Luhn.
  Order numbers, prices, dates and durations are left alone.
* Patterns run on a folded shadow of the text in which every character whose
  NFKC form is one ASCII character (full-width ``１３８…``, ``＠``, ``＋`` typed
  with a Chinese IME) and every Unicode decimal digit is replaced by its ASCII
  form. Folding is one character for one, so a span found in the shadow is the
  same span in the original, and the rest of the text is left exactly as it was.

``scrub_bytes(raw)`` does the same for bytes that may be neither UTF-8 nor JSON
(a line ingest rejected), so even what is kept of a bad line is scrubbed.
``scrub_fields(texts)`` scrubs a record's fields in one pass, each as ``scrub`` would.

Speed (ingest scrubs every field of a million lines a month): the fold is one
``str.translate``; a detector runs only on a shadow holding the character every one of
its hits needs (a digit, or '@' for e-mail); a digit run too short to hold a card number
is not split into groups. Each shortcut skips only work that cannot find a hit.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import itertools
import re
import unicodedata
from collections import Counter
from collections.abc import Callable, Sequence

EMAIL, PHONE, CN_ID, BANK_CARD, IP = "EMAIL", "PHONE", "CN_ID", "BANK_CARD", "IP"
PII_TYPES: tuple[str, ...] = (EMAIL, PHONE, CN_ID, BANK_CARD, IP)

# The look-behind starts a match only where a run of local-part characters starts:
# without it, a long run with no '@' is rescanned from every position (quadratic;
# 9 s for 32k letters), which a hostile line or feedback flag could use.
_EMAIL_RE = re.compile(
    r"(?<![A-Za-z0-9._%+-])[A-Za-z0-9._%+-]+@"
    r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
    r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*\.[A-Za-z]{2,}",
    re.ASCII,
)

# 6-digit region, YYYYMMDD birth date, 3-digit sequence, check character;
# cn_id_valid() checks the date and the check character.
_CN_ID_RE = re.compile(r"(?<!\d)\d{17}[\dXx](?!\d)", re.ASCII)
_CN_ID_WEIGHTS = (7, 9, 10, 5, 8, 4, 2, 1, 6, 3, 7, 9, 10, 5, 8, 4, 2)
_CN_ID_CHECK = "10X98765432"
_CN_ID_MIN_YEAR = 1900

# Mainland mobile: 1[3-9] and 11 digits, grouped 3-4-4 or not at all, with an
# optional +86 / 0086 / (+86) / bare 86 in front. The look-behind also rejects
# '+' so "+8613812345678" is taken whole via the prefix, not from the "1".
_CN_MOBILE_RE = re.compile(
    r"(?<![\d+])(?:(?:\+86|0086)[ -]?|\(\+?86\)[ -]?|86)?1[3-9]\d(?:[ -]?\d{4}){2}(?!\d)",
    re.ASCII,
)
# International, E.164-like: '+', country code, at least 8 digits in all,
# optionally an area code in parentheses ("+1 (555) 123-4567").
_INTL_PHONE_RE = re.compile(
    r"(?<![\d+])\+[1-9]\d{0,2}[ -]?\(\d{1,4}\)[ -]?\d(?:[ -]?\d){5,12}(?!\d)"
    r"|(?<![\d+])\+[1-9](?:[ -]?\d){7,14}(?!\d)",
    re.ASCII,
)

# A run of digit groups joined by single spaces or dashes. Card numbers are
# picked out of it group by group (see _card_spans), because one regex cannot
# try a shorter span after Luhn rejects a longer one ("4111 1111 1111 1111 2024").
_DIGIT_RUN_RE = re.compile(r"(?<!\d)\d+(?:[ -]\d+)*", re.ASCII)
_GROUP_RE = re.compile(r"\d+", re.ASCII)
_CARD_MIN_DIGITS, _CARD_MAX_DIGITS = 13, 19
_CARD_MAX_GROUPS = 5

_OCTET = r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
_IPV4_RE = re.compile(rf"(?<![\d.]){_OCTET}(?:\.{_OCTET}){{3}}(?!\.?\d)", re.ASCII)
# Candidates only; ipaddress decides. The look-arounds are ASCII on purpose:
# a Chinese character right before an address is not part of it.
_IPV6_RE = re.compile(
    r"(?<![0-9A-Za-z_:.])(?:[0-9A-Fa-f]{0,4}:){2,7}"
    r"(?:(?:\d{1,3}\.){3}\d{1,3}|[0-9A-Fa-f]{1,4})?"
    r"(?![0-9A-Za-z_:]|\.\d)",
    re.ASCII,
)
_DIGIT_RE = re.compile(r"\d", re.ASCII)
_JSON_UNICODE_ESCAPE_RE = re.compile(r"\\u([0-9A-Fa-f]{4})")

Span = tuple[int, int]


def placeholder(kind: str) -> str:
    """The text that stands in for one hit of ``kind``."""
    return f"<{kind}>"


def _fold_char(ch: str) -> str:
    if ch.isdecimal():
        return str(unicodedata.decimal(ch))
    folded = unicodedata.normalize("NFKC", ch)
    return folded if len(folded) == 1 and folded.isascii() else ch


class _FoldTable(dict[int, str]):
    """A ``str.translate`` table of ``_fold_char``, filled as characters are met: one C-level
    pass over a text instead of a Python call per character."""

    def __missing__(self, code: int) -> str:
        self[code] = folded = _fold_char(chr(code))
        return folded


_FOLD = _FoldTable()


def _fold(text: str) -> str:
    if text.isascii():
        return text
    return text.translate(_FOLD)


def cn_id_valid(candidate: str) -> bool:
    """True when an 18-character resident ID number has a real birth date and check character."""
    if len(candidate) != 18 or not candidate[:17].isascii() or not candidate[:17].isdecimal():
        return False
    check = candidate[17].upper()
    if check not in "0123456789X":
        return False
    digits = [int(c) for c in candidate[:17]]
    try:
        born = dt.date(int(candidate[6:10]), int(candidate[10:12]), int(candidate[12:14]))
    except ValueError:
        return False
    if born.year < _CN_ID_MIN_YEAR or born > dt.date.today():
        return False
    weighted = sum(w * d for w, d in zip(_CN_ID_WEIGHTS, digits, strict=True))
    return _CN_ID_CHECK[weighted % 11] == check


def luhn_valid(number: str) -> bool:
    """Luhn check over the ASCII digits of ``number``; separators are ignored."""
    digits = [int(c) for c in number if "0" <= c <= "9"]
    if not digits:
        return False
    total = 0
    for i, d in enumerate(reversed(digits)):
        if i % 2:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


def _card_shaped(groups: list[str], seps: list[str]) -> bool:
    """Whether these digit groups are written the way card numbers are."""
    if not _CARD_MIN_DIGITS <= sum(map(len, groups)) <= _CARD_MAX_DIGITS:
        return False
    if len(groups) == 1:
        return True
    if len(set(seps)) != 1:
        return False
    lengths = [len(g) for g in groups]
    # 4-4-4-4(-3) for most schemes, 4-6-5 for Amex, 4-6-4 for Diners.
    if lengths in ([4, 6, 5], [4, 6, 4]):
        return True
    return len(groups) >= 3 and all(n == 4 for n in lengths[:-1]) and 1 <= lengths[-1] <= 4


def _card_spans(shadow: str) -> list[Span]:
    spans: list[Span] = []
    for run in _DIGIT_RUN_RE.finditer(shadow):
        if run.end() - run.start() < _CARD_MIN_DIGITS:
            continue  # fewer characters than a card has digits: no span of it can be one
        groups = [(m.start(), m.end(), m.group()) for m in _GROUP_RE.finditer(shadow, *run.span())]
        i = 0
        while i < len(groups):
            # Longest card-shaped, Luhn-valid span of groups starting at group i.
            for j in range(min(len(groups), i + _CARD_MAX_GROUPS) - 1, i - 1, -1):
                span = groups[i : j + 1]
                seps = [shadow[a[1] : b[0]] for a, b in itertools.pairwise(span)]
                digits = [g[2] for g in span]
                if _card_shaped(digits, seps) and luhn_valid("".join(digits)):
                    spans.append((span[0][0], span[-1][1]))
                    i = j + 1
                    break
            else:
                i += 1
    return spans


def _ipv6_valid(candidate: str) -> bool:
    # A digit is required so "::" in prose and identifiers like "dead::beef"
    # in code stay; addresses in logs nearly always carry one.
    if not _DIGIT_RE.search(candidate):
        return False
    try:
        ipaddress.IPv6Address(candidate)
    except ValueError:
        return False
    return True


def _regex(
    pattern: re.Pattern[str], valid: Callable[[str], bool] | None = None
) -> Callable[[str], list[Span]]:
    def spans(shadow: str) -> list[Span]:
        return [m.span() for m in pattern.finditer(shadow) if valid is None or valid(m.group())]

    return spans


# In the order they run; see the module docstring for why this order. Each with the
# character every one of its hits contains ('@', or an ASCII digit: an IPv6 address without
# one is refused by _ipv6_valid), so a shadow without it is not scanned.
_DETECTORS: tuple[tuple[str, str, Callable[[str], list[Span]]], ...] = (
    (EMAIL, "@", _regex(_EMAIL_RE)),
    (CN_ID, "0", _regex(_CN_ID_RE, cn_id_valid)),
    (PHONE, "0", _regex(_CN_MOBILE_RE)),
    (PHONE, "0", _regex(_INTL_PHONE_RE)),
    (BANK_CARD, "0", _card_spans),
    (IP, "0", _regex(_IPV6_RE, _ipv6_valid)),
    (IP, "0", _regex(_IPV4_RE)),
)
# Field separator of scrub_fields: no pattern's character classes or look-arounds take it,
# and it folds to itself, so no hit crosses it and each side sees it as a text's end.
_FIELD_SEP = "\x00"


def _replace(text: str, spans: list[Span], kind: str) -> str:
    out: list[str] = []
    pos = 0
    for start, end in spans:
        out += [text[pos:start], placeholder(kind)]
        pos = end
    out.append(text[pos:])
    return "".join(out)


def _scrub_once(text: str, counts: Counter[str]) -> str:
    shadow = _fold(text)
    has = {"@": "@" in shadow, "0": _DIGIT_RE.search(shadow) is not None}
    for kind, needs, detect in _DETECTORS:
        if not has[needs]:
            continue
        spans = detect(shadow)
        if spans:
            counts[kind] += len(spans)
            text = _replace(text, spans, kind)
            shadow = _replace(shadow, spans, kind)
            # A placeholder removes digits and '@' and adds none.
            has = {"@": "@" in shadow, "0": _DIGIT_RE.search(shadow) is not None}
    return text


def scrub(text: str) -> tuple[str, Counter[str]]:
    """Replace PII in ``text`` with typed placeholders; return the new text and hits per type.

    The passes repeat until nothing changes. A replacement turns a digit that
    ended one hit into ``>``, which can unblock the digit look-behind of a
    pattern that ran earlier (a card number written flush against "+44…");
    repeating guarantees the output holds nothing ``scrub`` would find. It ends
    because every hit removes at least one digit or '@' and placeholders add none.
    """
    counts: Counter[str] = Counter()
    while True:
        found: Counter[str] = Counter()
        scrubbed = _scrub_once(text, found)
        if not found:
            return text, counts
        counts.update(found)
        text = scrubbed


def scrub_fields(texts: Sequence[str]) -> tuple[list[str], Counter[str]]:
    """``scrub`` of each text, and the hits of all of them: ``[scrub(t)[0] for t in texts]``.

    The texts are scrubbed as one, joined by a separator no hit can cross or touch (see
    ``_FIELD_SEP``), so a record's fields cost one pass instead of one each; texts that
    hold the separator themselves are scrubbed one by one.
    """
    if not texts:
        return [], Counter()
    if any(_FIELD_SEP in text for text in texts):
        counts: Counter[str] = Counter()
        out = []
        for text in texts:
            scrubbed, found = scrub(text)
            counts.update(found)
            out.append(scrubbed)
        return out, counts
    joined, counts = scrub(_FIELD_SEP.join(texts))
    return joined.split(_FIELD_SEP), counts


def scrub_bytes(raw: bytes) -> tuple[str, Counter[str]]:
    """``scrub`` for raw bytes of unknown shape: invalid UTF-8, broken JSON, anything.

    Bytes that are not UTF-8 become U+FFFD. JSON's ``\\uXXXX`` escapes are
    resolved before scrubbing: an exporter may escape every non-ASCII character
    (``\\u624b\\u673a13812345678``) and a hostile line may escape the digits or
    the '@' of an address; read as they are, neither would match. A lone
    surrogate escape becomes U+FFFD, so the result is always encodable.
    """
    text = raw.decode("utf-8", errors="replace")
    if "\\u" in text:
        text = _JSON_UNICODE_ESCAPE_RE.sub(lambda m: chr(int(m.group(1), 16)), text)
        # Join escaped surrogate pairs into one character; a lone half cannot be written.
        text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    return scrub(text)
