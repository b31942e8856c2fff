"""The blind review's results: rates with intervals by slice, agreement, consistency.

Every vote counts once in the rates: the candidate's **win**, **tie**, **loss** and **both
wrong** rates over all votes, and the **decisive** win rate (wins over wins + losses, the
figure a non-inferiority margin reads: 0.5 means neither is preferred). Control slots (an item
shown to the same reviewer a second time) count only for consistency.

Intervals are Wilson score intervals: right at 0 and 1 and for a few votes, where the normal
("Wald") interval collapses to a point. They treat votes as independent; when several
reviewers judge the same items the votes are correlated, and the interval is narrower than a
bootstrap over items and reviewers would give. With a handful of reviewers of similar taste
(the agreement below says how similar) the difference is small.

Agreement between reviewers is given two ways, over the items at least two of them judged
(first showings only, in the four categories): **pairwise agreement**, the share of reviewer
pairs on the same item who chose the same, which a support lead reads directly; and **Fleiss'
kappa** (for a varying number of raters per item), which discounts the agreement that chance
alone gives: if everyone says "tie" to everything, agreement is 100 % and kappa says nothing
was learned (undefined here). Cohen's kappa would need the same two reviewers on every item.

Consistency: for each control slot, whether the reviewer's preference (candidate, champion,
tie, both wrong, after undoing the page's order) equals the one they gave the first time.
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from statistics import NormalDist
from typing import Any

from tuneloop.review.store import (
    PREFERENCES,
    SLICE_KEYS,
    ReviewStore,
    VoteRow,
    review_info,
    vote_rows,
)


def wilson(successes: int, trials: int, confidence: float = 0.95) -> tuple[float, float]:
    """The Wilson score interval of ``successes`` out of ``trials``; (0, 1) for no trials."""
    if trials == 0:
        return 0.0, 1.0
    if not 0 <= successes <= trials:
        raise ValueError(f"successes {successes} out of {trials} trials")
    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    p = successes / trials
    denominator = 1 + z * z / trials
    center = (p + z * z / (2 * trials)) / denominator
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / denominator
    return max(0.0, center - half), min(1.0, center + half)


def pairwise_agreement(counts: Iterable[Sequence[int]]) -> tuple[int, int]:
    """(agreeing pairs, pairs) over items, each given as its votes per category."""
    agreeing = pairs = 0
    for row in counts:
        n = sum(row)
        pairs += n * (n - 1) // 2
        agreeing += sum(c * (c - 1) // 2 for c in row)
    return agreeing, pairs


def fleiss_kappa(counts: Sequence[Sequence[int]]) -> float | None:
    """Fleiss' kappa over items with at least two ratings each (raters may differ in number).

    None when it is undefined: no such item, or every rating in one category.
    """
    rows = [row for row in counts if sum(row) >= 2]
    if not rows:
        return None
    agreement = sum(
        (sum(c * c for c in row) - sum(row)) / (sum(row) * (sum(row) - 1)) for row in rows
    ) / len(rows)
    ratings = sum(sum(row) for row in rows)
    shares = [sum(row[j] for row in rows) / ratings for j in range(len(rows[0]))]
    chance = sum(p * p for p in shares)
    if chance >= 1:
        return None
    return (agreement - chance) / (1 - chance)


@dataclass(frozen=True)
class Rate:
    count: int
    n: int
    low: float
    high: float

    @property
    def value(self) -> float | None:
        return self.count / self.n if self.n else None

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "value": self.value}


def rate(count: int, n: int, confidence: float) -> Rate:
    return Rate(count, n, *wilson(count, n, confidence))


@dataclass(frozen=True)
class SliceResult:
    """The rates over one slice's votes (``key`` ``"all"`` for every vote)."""

    key: str
    value: str
    votes: int
    items: int
    win: Rate
    tie: Rate
    loss: Rate
    both_wrong: Rate
    decisive: Rate  # wins out of wins + losses

    def as_dict(self) -> dict[str, Any]:
        rates = ("win", "tie", "loss", "both_wrong", "decisive")
        return {
            "key": self.key,
            "value": self.value,
            "votes": self.votes,
            "items": self.items,
            **{name: getattr(self, name).as_dict() for name in rates},
        }


@dataclass(frozen=True)
class ReviewerResult:
    name: str
    votes: int
    controls: int  # control slots voted, each with its first showing
    consistency: Rate  # same preference on the control as the first time
    revoked: bool

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "consistency": self.consistency.as_dict()}


@dataclass(frozen=True)
class Agreement:
    items: int  # items judged by at least two reviewers
    pairs: int
    agreeing_pairs: int
    fleiss_kappa: float | None

    @property
    def pairwise(self) -> float | None:
        return self.agreeing_pairs / self.pairs if self.pairs else None

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "pairwise": self.pairwise}


@dataclass(frozen=True)
class ReviewResults:
    review: str
    champion: str
    candidate: str
    confidence: float
    items: int  # in the review
    items_voted: int
    votes: int  # first showings counted in the rates
    revoked_votes: int  # of those, by reviewers revoked since (counted unless excluded)
    overall: SliceResult
    slices: tuple[SliceResult, ...]
    agreement: Agreement
    reviewers: tuple[ReviewerResult, ...]

    def as_dict(self) -> dict[str, Any]:
        return {
            "review": self.review,
            "champion": self.champion,
            "candidate": self.candidate,
            "confidence": self.confidence,
            "items": self.items,
            "items_voted": self.items_voted,
            "votes": self.votes,
            "revoked_votes": self.revoked_votes,
            "overall": self.overall.as_dict(),
            "slices": [s.as_dict() for s in self.slices],
            "agreement": self.agreement.as_dict(),
            "reviewers": [r.as_dict() for r in self.reviewers],
        }

    def metrics(self, prefix: str = "review") -> dict[str, float]:
        """Flat numbers for MLflow: each rate with its bounds, overall and by slice, plus
        votes, agreement and the mean consistency (rates without votes are left out)."""
        found: dict[str, float] = {
            f"{prefix}.votes": float(self.votes),
            f"{prefix}.items_voted": float(self.items_voted),
        }
        for s in (self.overall, *self.slices):
            where = prefix if s.key == "all" else f"{prefix}.{_metric_name(s.key, s.value)}"
            for name in ("win", "tie", "loss", "both_wrong", "decisive"):
                r: Rate = getattr(s, name)
                if r.value is not None:
                    found |= {
                        f"{where}.{name}": r.value,
                        f"{where}.{name}_low": r.low,
                        f"{where}.{name}_high": r.high,
                    }
        if self.agreement.pairwise is not None:
            found[f"{prefix}.agreement"] = self.agreement.pairwise
        if self.agreement.fleiss_kappa is not None:
            found[f"{prefix}.fleiss_kappa"] = self.agreement.fleiss_kappa
        checked = [r for r in self.reviewers if r.controls]
        if checked:
            same = sum(r.consistency.count for r in checked)
            found[f"{prefix}.consistency"] = same / sum(r.controls for r in checked)
        return found

    def table(self) -> str:
        """The results as markdown: rates by slice, then reviewers."""
        pct = round(self.confidence * 100)

        def shown(r: Rate) -> str:
            if r.value is None:
                return "-"
            return f"{r.value:.0%} [{r.low:.0%}, {r.high:.0%}]"

        lines = [
            f"Blind review {self.review}: {self.candidate} (candidate) vs {self.champion} "
            f"(champion); {self.votes} votes on {self.items_voted} of {self.items} items, "
            f"{pct} % Wilson intervals",
            "",
            "| slice | votes | win | tie | loss | both wrong | win of decisive |",
            "|---|---|---|---|---|---|---|",
        ]
        for s in (self.overall, *self.slices):
            name = "all" if s.key == "all" else f"{s.key}={s.value}"
            lines.append(
                f"| {name} | {s.votes} | {shown(s.win)} | {shown(s.tie)} | {shown(s.loss)} "
                f"| {shown(s.both_wrong)} | {shown(s.decisive)} |"
            )
        a = self.agreement
        kappa = "-" if a.fleiss_kappa is None else f"{a.fleiss_kappa:.2f}"
        pairwise = "-" if a.pairwise is None else f"{a.pairwise:.0%}"
        lines += [
            "",
            f"Agreement: {pairwise} of {a.pairs} reviewer pairs on {a.items} shared items; "
            f"Fleiss' kappa {kappa}",
            "",
            "| reviewer | votes | consistent on controls | revoked |",
            "|---|---|---|---|",
        ]
        for r in self.reviewers:
            consistent = f"{r.consistency.count}/{r.controls}" if r.controls else "-"
            lines.append(f"| {r.name} | {r.votes} | {consistent} | {'yes' if r.revoked else ''} |")
        if self.revoked_votes:
            lines.append(f"\n{self.revoked_votes} votes are by reviewers revoked since.")
        return "\n".join(lines)


def slice_result(key: str, value: str, rows: Sequence[VoteRow], confidence: float) -> SliceResult:
    counts = Counter(row.preference for row in rows)
    n = len(rows)
    wins, losses = counts["candidate"], counts["champion"]
    return SliceResult(
        key=key,
        value=value,
        votes=n,
        items=len({row.item for row in rows}),
        win=rate(wins, n, confidence),
        tie=rate(counts["tie"], n, confidence),
        loss=rate(losses, n, confidence),
        both_wrong=rate(counts["both_wrong"], n, confidence),
        decisive=rate(wins, wins + losses, confidence),
    )


def tally(
    rows: Sequence[VoteRow],
    *,
    review: Mapping[str, Any],
    confidence: float = 0.95,
    include_revoked: bool = True,
) -> ReviewResults:
    """The results of ``rows`` (a review's votes, in the order cast) for the review ``review``
    (``store.review_info``'s dict)."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence {confidence} must be between 0 and 1")
    kept = [row for row in rows if include_revoked or not row.reviewer_revoked]
    first = [row for row in kept if not row.control]
    by_slice: dict[tuple[str, str], list[VoteRow]] = defaultdict(list)
    for row in first:
        for key in SLICE_KEYS:
            if key in row.slices:
                by_slice[(key, row.slices[key])].append(row)
        for key in sorted(set(row.slices) - set(SLICE_KEYS)):
            by_slice[(key, row.slices[key])].append(row)
    per_item: dict[int, Counter[str]] = defaultdict(Counter)
    for row in first:
        per_item[row.item][row.preference] += 1
    counts = [[c[p] for p in PREFERENCES] for c in per_item.values()]
    agreeing, pairs = pairwise_agreement(counts)

    first_choice = {(row.reviewer, row.item): row.preference for row in rows if not row.control}
    reviewer_rows: dict[str, list[VoteRow]] = defaultdict(list)
    for row in kept:
        reviewer_rows[row.reviewer].append(row)
    revoked = dict(review.get("reviewers", {}))
    reviewers = []
    for name in sorted(
        set(reviewer_rows) | {n for n, r in revoked.items() if include_revoked or not r}
    ):
        mine = reviewer_rows.get(name, [])
        controls = [row for row in mine if row.control and (name, row.item) in first_choice]
        same = sum(row.preference == first_choice[(name, row.item)] for row in controls)
        reviewers.append(
            ReviewerResult(
                name=name,
                votes=sum(not row.control for row in mine),
                controls=len(controls),
                consistency=rate(same, len(controls), confidence),
                revoked=bool(revoked.get(name, False)),
            )
        )
    return ReviewResults(
        review=str(review["name"]),
        champion=str(review["champion"]),
        candidate=str(review["candidate"]),
        confidence=confidence,
        items=int(review["items"]),
        items_voted=len(per_item),
        votes=len(first),
        revoked_votes=sum(row.reviewer_revoked for row in first),
        overall=slice_result("all", "all", first, confidence),
        slices=tuple(
            slice_result(key, value, by_slice[(key, value)], confidence)
            for key, value in sorted(by_slice, key=lambda kv: (_slice_rank(kv[0]), kv))
        ),
        agreement=Agreement(
            items=sum(1 for row in counts if sum(row) >= 2),
            pairs=pairs,
            agreeing_pairs=agreeing,
            fleiss_kappa=fleiss_kappa(counts),
        ),
        reviewers=tuple(reviewers),
    )


def _metric_name(key: str, value: str) -> str:
    """``intent.refund``: MLflow takes letters, digits and ``_-. /`` in a metric's name."""
    return re.sub(r"[^A-Za-z0-9_\-]", "_", key) + "." + re.sub(r"[^A-Za-z0-9_\-]", "_", value)


def _slice_rank(key: str) -> int:
    return SLICE_KEYS.index(key) if key in SLICE_KEYS else len(SLICE_KEYS)


def compute_results(
    store: ReviewStore,
    review: str | None = None,
    *,
    confidence: float = 0.95,
    include_revoked: bool = True,
) -> ReviewResults:
    """The results of a review (the newest by default) as the store holds them now.

    Votes of reviewers revoked since they cast them count unless ``include_revoked`` is
    False; either way ``revoked_votes`` and each reviewer's ``revoked`` say so.
    """
    return tally(
        vote_rows(store, review),
        review=review_info(store, review),
        confidence=confidence,
        include_revoked=include_revoked,
    )
