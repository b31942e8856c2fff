"""The eval gate: judge the candidate against the base, the champion and its FP8 export.

The gate reads per-item scores (lm-eval's logged samples, ``tuneloop.judge.scoring``) and
compares models *paired*, item by item, with a bootstrap interval for each difference
(``tuneloop.judge.stats``; ``gate.confidence``, ``gate.bootstrap_samples``, ``gate.seed``).
Every difference is "better by": positive when the first model is the better one,
whichever way the metric points (``higher_is_better`` of the suite, as lm-eval reports it).

The rules (params ``gate``), each a threshold on such a difference:

- ``beats_base``: on every business suite, the candidate beats the base by ``min_gain``
  on ``primary_metric``;
- ``no_regression``: the candidate is behind the champion by at most ``max_regression``
  on every metric (skipped when the registry has no champion yet);
- ``fp8_within``: the FP8 export is behind the candidate by at most ``fp8_max_drop`` on
  every metric (not a rule when ``fp8_max_drop`` is null: the export is scored, compared and
  reported, and a release that serves adapters on a shared base never ships it);
- ``nvfp4_within``, ``nvfp4a16_within``: an FP4 export is behind the candidate by at most
  ``fp4_max_drop`` on every metric. These judge the format, not the candidate: a format that
  fails (or is unsettled under ``on_inconclusive: block``) is refused, so it is not
  registered, while the candidate and its other formats are (FP4 serves Blackwell hosts
  beside the FP8 the others serve). Null: compared and reported, not a rule. The decision's
  ``exports`` holds each format's checks, status and whether the gate refused it;
- ``forgetting``: on every general-capability suite (``evaluate.general_suites``), the
  candidate is behind the champion (the base, first month) by at most ``max_forgetting``
  on every metric;
- ``slice_regression`` (only when ``max_slice_regression`` is set): in every slice of a
  business suite (``evaluate.slices``), the candidate is behind its reference (the
  champion, else the base) by at most that much.
- ``fixed_badcases``: of the fixed-badcase suite's items
  (``tuneloop.judge.fixed_badcases``) the champion answers right (``FIXED_METRIC`` 1 on the item),
  the candidate answers at most
  ``max_broken_fixes`` wrong. A count over a known set, not an estimate, so no interval:
  each broken fix is a regression a user reported once already. An empty suite (no
  correction from a month the champion trained on yet) is a note, not a check.

A check *passes* when its whole interval clears the threshold, *fails* when none of it
does, and is otherwise *inconclusive*. An inconclusive check says about how many more eval
items would settle it. What an unsettled rule does is ``gate.on_inconclusive``'s: with
``block`` (the default) every inconclusive check blocks, so the verdict is ``fail`` when any
check fails, else ``inconclusive`` when any check is, else ``pass``; the gate never passes
what it could not settle. With ``warn`` an inconclusive check does not block (the verdict is
``fail`` or ``pass``), and the decision's ``unsettled`` list names every one with the items
that would settle it: the approval form lists them and refuses an approval without a tick
that they were read (``tuneloop.release.approval``). Regressed slices are reported unless
``max_slice_regression`` is set.

``review_check`` is the blind review's rule (``gate.blind_review``), judged the same way on
the people's votes when the release asks for it (the review runs after registration).

The verdict and every check's status are the shared vocabulary of ``tuneloop.judge.verdict``.
``decide`` returns the verdict with every check and comparison, its numbers and a reason for
each, as a ``tuneloop.judge.decision.Decision`` (``metrics/decision.json``);
``tuneloop.judge.gate_report`` shows them.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tuneloop.judge import stats
from tuneloop.judge.decision import (
    Check,
    Comparison,
    Decision,
    Directions,
    ExportStanding,
    FixedBadcases,
    Forgetting,
    NotARule,
    Scores,
    SliceComparison,
    Statistics,
    Thresholds,
    UnsettledRule,
)
from tuneloop.judge.verdict import FAIL, INCONCLUSIVE, PASS, Outcome, outcome
from tuneloop.params import GateParams

BASE, CHAMPION, CANDIDATE, FP8 = "base", "champion", "candidate", "candidate-fp8"
# Each export format's model name in the items and scores (``export.formats``).
EXPORT_MODELS = {"fp8": FP8, "nvfp4": "candidate-nvfp4", "nvfp4a16": "candidate-nvfp4a16"}
FP4_FORMATS = ("nvfp4", "nvfp4a16")
NOT_A_RULE: NotARule = "not a rule"
# Scores are means over items: float error must not turn a tie into a failure.
EPS = 1e-9


class GateError(ValueError):
    """The scores cannot be judged as configured (a metric, a direction or items missing)."""


@dataclass(frozen=True)
class SuiteItems:
    """One model's per-item scores on one suite.

    A metric's figure is ``sum(weight * value) / sum(weight)`` over the items: weight 1
    everywhere for a mean, 0 on the items a rate does not count (see ``tuneloop.judge.stats``).
    ``slices`` holds each item's label for every slice field the suite's items carry.
    """

    ids: tuple[str, ...]
    values: dict[str, np.ndarray]
    weights: dict[str, np.ndarray]
    slices: dict[str, tuple[str, ...]] = field(default_factory=dict)

    @classmethod
    def of(
        cls,
        ids: Sequence[str],
        values: Mapping[str, Sequence[float]],
        weights: Mapping[str, Sequence[float]] | None = None,
        slices: Mapping[str, Sequence[str]] | None = None,
    ) -> SuiteItems:
        """From plain lists; a metric without weights weighs every item 1."""
        arrays = {m: np.asarray(v, dtype=float) for m, v in values.items()}
        given = weights or {}
        return cls(
            ids=tuple(ids),
            values=arrays,
            weights={
                m: np.asarray(given[m], dtype=float) if m in given else np.ones(len(ids))
                for m in arrays
            },
            slices={f: tuple(labels) for f, labels in (slices or {}).items()},
        )

    def mean(self, metric: str) -> float | None:
        return stats.weighted_mean(self.values[metric], self.weights[metric])

    def aligned(self, ids: tuple[str, ...], what: str) -> SuiteItems:
        """The same scores in the order of ``ids``, which must be exactly this suite's items."""
        if ids == self.ids:
            return self
        if sorted(ids) != sorted(self.ids):
            missing, extra = sorted(set(ids) - set(self.ids)), sorted(set(self.ids) - set(ids))
            raise GateError(
                f"{what} was scored on other items than the candidate (missing {missing[:5]}, "
                f"extra {extra[:5]}): score every model with the same suites and limit"
            )
        if len(set(ids)) != len(ids):
            raise GateError(f"{what}: item ids repeat; each item needs a unique id")
        position = {item: i for i, item in enumerate(self.ids)}
        order = np.array([position[i] for i in ids])
        return SuiteItems(
            ids=ids,
            values={m: v[order] for m, v in self.values.items()},
            weights={m: w[order] for m, w in self.weights.items()},
            slices={f: tuple(labels[i] for i in order) for f, labels in self.slices.items()},
        )


Items = dict[str, dict[str, SuiteItems]]  # model -> suite -> per-item scores


def scores_of(items: Items) -> Scores:
    """Every model's figure of every metric (None-weight metrics left out)."""
    out: Scores = {}
    for model, suites in items.items():
        out[model] = {}
        for suite, found in suites.items():
            out[model][suite] = {
                m: value for m in sorted(found.values) if (value := found.mean(m)) is not None
            }
    return out


# --- the comparisons --------------------------------------------------------------------------


def _direction(directions: Directions, suite: str, metric: str) -> bool:
    try:
        return directions[suite][metric]
    except KeyError:
        raise GateError(
            f"suite {suite!r} does not say whether {metric!r} is better higher or lower; add "
            f"`higher_is_better: true|false` to its entry in metric_list of {suite}.yaml"
        ) from None


class SuiteBootstrap:
    """One suite's bootstrap: every figure the gate needs, from one set of resamples."""

    def __init__(
        self,
        suite: str,
        aligned: dict[str, SuiteItems],
        slice_models: tuple[str, ...],
        gate: GateParams,
    ) -> None:
        self.suite, self.gate = suite, gate
        candidate = aligned[CANDIDATE]
        self.n = len(candidate.ids)
        self.labels = [
            (name, label)
            for name, labels in sorted(candidate.slices.items())
            for label in sorted(set(labels))
        ]
        masks = {
            (name, label): np.array([x == label for x in candidate.slices[name]], dtype=float)
            for name, label in self.labels
        }
        keys: list[tuple[str, str, tuple[str, str] | None]] = []
        values, weights = [], []
        for model, found in aligned.items():
            for metric in sorted(found.values):
                keys.append((model, metric, None))
                values.append(found.values[metric])
                weights.append(found.weights[metric])
                if model not in slice_models:
                    continue
                for name, label in self.labels:
                    mask = masks[(name, label)]
                    keys.append((model, metric, (name, label)))
                    values.append(found.values[metric])
                    weights.append(found.weights[metric] * mask)
        self.column = {key: i for i, key in enumerate(keys)}
        self.values = np.stack(values, axis=1) if values else np.zeros((self.n, 0))
        self.weights = np.stack(weights, axis=1) if weights else np.zeros((self.n, 0))
        # Seeded per suite: adding a suite does not move another suite's intervals.
        seed = [gate.seed, zlib.crc32(suite.encode())]
        self.replicates = stats.bootstrap_means(
            self.values, self.weights, gate.bootstrap_samples, seed
        )

    def figure(self, model: str, metric: str, where: tuple[str, str] | None = None) -> float | None:
        j = self.column[(model, metric, where)]
        return stats.weighted_mean(self.values[:, j], self.weights[:, j])

    def compare(
        self,
        model: str,
        reference: str,
        metric: str,
        higher: bool,
        where: tuple[str, str] | None = None,
    ) -> tuple[Comparison, stats.Interval | None]:
        """``model`` vs ``reference`` on ``metric`` (in slice ``where``), paired, and the
        interval of the difference (None when a figure has no item to count)."""
        a, b = self.column[(model, metric, where)], self.column[(reference, metric, where)]
        value, ref = self.figure(model, metric, where), self.figure(reference, metric, where)
        counted = int(((self.weights[:, a] > 0) & (self.weights[:, b] > 0)).sum())
        sign = 1.0 if higher else -1.0
        found = None
        if value is not None and ref is not None:
            replicates = sign * (self.replicates[:, a] - self.replicates[:, b])
            found = stats.interval(sign * (value - ref), replicates, self.gate.confidence)
        compared = Comparison(
            suite=self.suite,
            metric=metric,
            higher_is_better=higher,
            slice=None if where is None else f"{where[0]}={where[1]}",
            model=model,
            value=_round(value),
            reference=reference,
            reference_value=_round(ref),
            diff=_round(found.diff if found else None),
            low=_round(found.low if found else None),
            high=_round(found.high if found else None),
            se=_round(found.se if found else None),
            items=counted,
        )
        return compared, found


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 6) + 0.0  # + 0.0: no "-0.000" in reasons


def _signed(value: float | None) -> str:
    return "n/a" if value is None else f"{value:+.3f}"


def plain(value: float | None) -> str:
    """A figure as reasons and the report print it."""
    return "n/a" if value is None else f"{value:.3f}"


def _figures(c: Comparison, confidence: float) -> str:
    where = f"[{c.slice}] " if c.slice else ""
    arrow = "higher is better" if c.higher_is_better else "lower is better"
    return (
        f"{c.suite}/{c.metric} {where}({arrow}): {c.model} {plain(c.value)} vs "
        f"{c.reference} {plain(c.reference_value)}: better by {_signed(c.diff)} "
        f"[{_signed(c.low)}, {_signed(c.high)}] ({confidence:.0%}, {c.items} items)"
    )


def _check(
    rule: str,
    compared: tuple[Comparison, stats.Interval | None],
    threshold: float,
    blocking_inconclusive: bool,
    suite_items: int,
    confidence: float,
) -> Check:
    """Judge one comparison against ``threshold`` (the least "better by" allowed)."""
    comparison, found = compared
    status: Outcome
    if found is None:
        status = INCONCLUSIVE
    elif found.low >= threshold - EPS:
        status = PASS
    elif found.high < threshold - EPS:
        status = FAIL
    else:
        status = INCONCLUSIVE
    more: int | None = None
    counted = comparison.items
    if status == INCONCLUSIVE and found is not None and counted > 0:
        needed = stats.items_to_settle(found, threshold, counted, confidence)
        if needed is not None:
            # In suite items: a rate over a subset (or a slice) needs the whole suite to grow.
            more = math.ceil((needed - counted) * suite_items / counted)
    limit = "needs at least" if threshold > 0 else "allowed down to"
    reason = f"{_figures(comparison, confidence)}, {limit} {threshold:+.3f}: {status.upper()}"
    if status == INCONCLUSIVE:
        if found is None:
            reason += ": no item counts toward it"
        elif more is None:
            reason += ": the difference sits on the threshold; no number of items settles it"
        else:
            reason += f": about {more} more items would settle it (if the difference holds)"
    return Check(
        **comparison.model_dump(),
        rule=rule,
        threshold=round(threshold, 6),
        status=status,
        passed=status == PASS,
        blocking=status == FAIL or blocking_inconclusive,
        more_items=more,
        reason=reason,
    )


# --- the gate ---------------------------------------------------------------------------------


def decide(
    items: Items,
    directions: Directions,
    gate: GateParams,
    suites: Sequence[str],
    general: Sequence[str] = (),
    could_not_run: Mapping[str, str] | None = None,
    fixed_badcases: str | None = None,
    exports: Sequence[str] = ("fp8",),
) -> Decision:
    """The gate's verdict on per-item ``items`` (``base``, ``candidate``, one model per export
    format of ``exports`` (``EXPORT_MODELS``), maybe ``champion``) over the business
    ``suites``, the ``general`` suites and the ``fixed_badcases`` suite (its name when it has
    items, scored for the champion and the candidate; None when empty), with every check and
    comparison it made and a reason for each."""
    exported = {fmt: EXPORT_MODELS[fmt] for fmt in exports}
    for needed in (BASE, CANDIDATE, *exported.values()):
        if needed not in items:
            raise GateError(f"evaluate: no scores for {needed!r} (got {sorted(items)})")
    format_checks: dict[str, list[Check]] = {fmt: [] for fmt in exported}
    primary = gate.primary_metric
    reference = CHAMPION if CHAMPION in items else BASE
    checks: list[Check] = []
    comparisons: list[Comparison] = []
    slices: list[SliceComparison] = []
    counts: dict[str, int] = {}
    conf = gate.confidence
    # Whether a rule the data could not settle stops the candidate (gate.on_inconclusive).
    blocks = gate.on_inconclusive == "block"

    for suite in suites:
        models = [m for m in (BASE, CHAMPION, CANDIDATE, *exported.values()) if m in items]
        found = _aligned(items, suite, models)
        candidate = found[CANDIDATE]
        if primary not in candidate.values:
            raise GateError(
                f"gate.primary_metric={primary!r} is not reported by suite {suite!r}; it "
                f"reports {sorted(candidate.values)}"
            )
        boot = SuiteBootstrap(suite, found, (CANDIDATE, reference), gate)
        counts[suite] = boot.n
        for metric in sorted(candidate.values):
            higher = _direction(directions, suite, metric)
            vs_base = boot.compare(CANDIDATE, BASE, metric, higher)
            comparisons.append(vs_base[0])
            for fmt, model in exported.items():
                behind = boot.compare(model, CANDIDATE, metric, higher)
                comparisons.append(behind[0])
                limit = gate.fp8_max_drop if fmt == "fp8" else gate.fp4_max_drop
                if limit is not None:  # null: compared, not a rule
                    check = _check(f"{fmt}_within", behind, -limit, blocks, boot.n, conf)
                    format_checks[fmt].append(check)
                    if fmt == "fp8":  # the candidate as served: its rule decides the verdict
                        checks.append(check)
            if metric == primary:
                checks.append(_check("beats_base", vs_base, gate.min_gain, blocks, boot.n, conf))
            if CHAMPION in items:
                vs_champion = boot.compare(CANDIDATE, CHAMPION, metric, higher)
                comparisons.append(vs_champion[0])
                checks.append(
                    _check(
                        "no_regression",
                        vs_champion,
                        -gate.max_regression,
                        blocks,
                        boot.n,
                        conf,
                    )
                )
            for where in boot.labels:
                part = boot.compare(CANDIDATE, reference, metric, higher, where)
                shown = part[0]
                if shown.items == 0:
                    continue  # e.g. a rate over unanswerable items in a slice that has none
                regressed = shown.high is not None and shown.high < -EPS
                slices.append(SliceComparison(**shown.model_dump(), regressed=regressed))
                if gate.max_slice_regression is not None:
                    checks.append(
                        _check(
                            "slice_regression",
                            part,
                            -gate.max_slice_regression,
                            blocks,
                            boot.n,
                            conf,
                        )
                    )

    general_reference = reference
    for suite in general:
        models = [m for m in (BASE, CHAMPION, CANDIDATE) if m in items]
        found = _aligned(items, suite, models)
        boot = SuiteBootstrap(suite, found, (), gate)
        counts[suite] = boot.n
        for metric in sorted(found[CANDIDATE].values):
            higher = _direction(directions, suite, metric)
            kept = boot.compare(CANDIDATE, general_reference, metric, higher)
            comparisons.append(kept[0])
            if general_reference != BASE:
                comparisons.append(boot.compare(CANDIDATE, BASE, metric, higher)[0])
            checks.append(_check("forgetting", kept, -gate.max_forgetting, blocks, boot.n, conf))

    fixed = FixedBadcases()
    notes: list[str] = []
    if fixed_badcases is not None:
        fixed, check = _fixed_badcases(items, fixed_badcases, gate)
        checks.append(check)
        counts[fixed_badcases] = fixed.items
    standings = {fmt: export_decision(fmt, format_checks[fmt], gate) for fmt in exported}
    notes += [s.reason for fmt, s in standings.items() if fmt in FP4_FORMATS and s.refused]
    if fixed_badcases is None:
        notes.append(
            "fixed badcases: the suite is empty (no corrected badcase from a month the "
            "champion trained on yet): nothing to keep fixed"
        )
    judged = _Judged(checks, comparisons, slices, counts, standings, fixed)
    return _verdict(gate, judged, reference, general, could_not_run or {}, notes, directions)


def export_decision(fmt: str, checks: list[Check], gate: GateParams) -> ExportStanding:
    """One export format's standing: its checks, their outcome, whether the gate refused it."""
    key = "fp8_max_drop" if fmt == "fp8" else "fp4_max_drop"
    limit = getattr(gate, key)
    # A check that passed blocks nothing; one that failed, or is unsettled where unsettled
    # rules block (gate.on_inconclusive), refuses the format.
    stopping = [c for c in checks if c.blocking and c.status != PASS]
    refused = bool(stopping)
    status: Outcome | NotARule
    if limit is None:
        status, reason = NOT_A_RULE, f"{fmt}: compared below, not a rule (gate.{key} is null)"
    else:
        status = outcome(c.status for c in checks) if checks else PASS
        reason = (
            f"{fmt} refused, not registered: " + "; ".join(c.reason for c in stopping)
            if refused
            else f"{fmt} within gate.{key} ({limit}) on every metric"
        )
    return ExportStanding(
        format=fmt,
        model=EXPORT_MODELS[fmt],
        rule=key,
        max_drop=limit,
        status=status,
        refused=refused,
        reason=reason,
        checks=checks,
    )


# Item ids of broken fixes quoted in the decision; the per-item files hold them all.
BROKEN_SHOWN = 20
# What the fixed-badcase suite scores (eval/fixed_badcases/fixed_badcases.yaml): the answer is
# the correction. Not gate.primary_metric: a team that gates on the reply format still wants
# a corrected answer kept correct, and the suite scores nothing else.
FIXED_METRIC = "accuracy"


def _fixed_badcases(items: Items, suite: str, gate: GateParams) -> tuple[FixedBadcases, Check]:
    """Count the fixes the candidate broke: items the champion answers right, it does not."""
    if CHAMPION not in items:
        raise GateError(
            f"suite {suite!r} has items but the registry has no champion to have fixed them; "
            "rerun `dvc repro` so the fixed_badcases stage reads the registry again"
        )
    found = _aligned(items, suite, [CHAMPION, CANDIDATE])
    metric = FIXED_METRIC
    if metric not in found[CANDIDATE].values:
        raise GateError(
            f"suite {suite!r} does not report {metric!r} (it reports "
            f"{sorted(found[CANDIDATE].values)}): is its yaml the one tuneloop ships?"
        )
    champion, candidate = found[CHAMPION], found[CANDIDATE]
    counted = (champion.weights[metric] > 0) & (candidate.weights[metric] > 0)
    fixed = counted & (champion.values[metric] >= 1 - EPS)
    broken = fixed & (candidate.values[metric] < 1 - EPS)
    n_fixed, n_broken = int(fixed.sum()), int(broken.sum())
    status = FAIL if n_broken > gate.max_broken_fixes else PASS
    ids = [item for item, hit in zip(candidate.ids, broken.tolist(), strict=True) if hit]
    reason = (
        f"{suite}: the champion answers {n_fixed} of {len(candidate.ids)} corrected badcases "
        f"right; the candidate breaks {n_broken} of them, allowed {gate.max_broken_fixes}: "
        f"{status.upper()}"
    )
    if ids:
        shown = ", ".join(ids[:BROKEN_SHOWN])
        reason += f" (broken: {shown}{', ...' if len(ids) > BROKEN_SHOWN else ''})"
    check = Check(
        suite=suite,
        metric=metric,
        slice=None,
        model=CANDIDATE,
        reference=CHAMPION,
        items=n_fixed,
        rule="fixed_badcases",
        threshold=gate.max_broken_fixes,
        status=status,
        passed=status == PASS,
        blocking=status == FAIL,
        more_items=None,
        broken=n_broken,
        reason=reason,
    )
    standing = FixedBadcases(
        suite=suite,
        items=len(candidate.ids),
        fixed_by_champion=n_fixed,
        broken=n_broken,
        broken_ids=ids,
        max_broken_fixes=gate.max_broken_fixes,
        status=status,
    )
    return standing, check


# --- the blind review's rule --------------------------------------------------------------------


def review_check(results: Mapping[str, Any], gate: GateParams) -> Check:
    """The blind review as a check of the gate (``gate.blind_review`` must be set), on its
    results as ``tuneloop.review.tally.ReviewResults.as_dict()`` gives them.

    Non-inferiority on the people's votes: of the decisive votes (the candidate's wins over
    wins + losses; 0.5 when neither answer is preferred), the lower bound of the Wilson
    interval must reach ``0.5 - margin``. Fewer than ``min_votes`` first-showing votes: the
    review has not happened yet, so the check is inconclusive and blocks whatever
    ``on_inconclusive`` says. Otherwise it passes when the interval's low end clears the
    threshold, fails when its high end is below it, and is else inconclusive, blocking as
    ``on_inconclusive`` says, with about how many more votes would settle it.
    """
    rule = gate.blind_review
    if rule is None:
        raise GateError("gate.blind_review is not set: the review is reported, not judged")
    threshold = 0.5 - rule.margin
    decisive = results["overall"]["decisive"]
    value: float | None = decisive["value"]
    low, high, n = float(decisive["low"]), float(decisive["high"]), int(decisive["n"])
    votes, confidence = int(results["votes"]), float(results["confidence"])
    shown = (
        "no decisive vote"
        if value is None
        else f"{value:.3f} [{low:.3f}, {high:.3f}] ({confidence:.0%} Wilson, {n} decisive votes)"
    )
    head = (
        f"blind review {results['review']}: {votes} votes, candidate's win rate of the "
        f"decisive votes {shown}, needs at least {threshold:.3f} (margin {rule.margin:g})"
    )
    status: Outcome
    more: int | None = None
    blocking = gate.on_inconclusive == "block"
    if votes < rule.min_votes:
        status, blocking = INCONCLUSIVE, True
        more = rule.min_votes - votes
        reason = f"{head}: INCONCLUSIVE: {more} more votes needed (min_votes {rule.min_votes})"
    elif value is not None and low >= threshold - EPS:
        status, reason = PASS, f"{head}: PASS"
    elif value is not None and high < threshold - EPS:
        status, reason = FAIL, f"{head}: FAIL"
    else:
        status = INCONCLUSIVE
        if value is not None:
            se = math.sqrt(max(value * (1 - value), 1e-12) / n)
            found = stats.Interval(value, low, high, se)
            needed = stats.items_to_settle(found, threshold, n, confidence)
            if needed is not None:
                # In votes of any kind: ties and "both wrong" do not count toward decisive ones.
                more = math.ceil((needed - n) * votes / n)
        reason = f"{head}: INCONCLUSIVE" + (
            f": about {more} more votes would settle it (if the preference holds)"
            if more is not None
            else ": no number of votes settles it"
        )
    return Check(
        suite=f"review:{results['review']}",
        metric="decisive_win_rate",
        slice=None,
        model=CANDIDATE,
        reference=CHAMPION,
        value=_round(value),
        low=_round(low if value is not None else None),
        high=_round(high if value is not None else None),
        items=votes,
        rule="blind_review",
        threshold=round(threshold, 6),
        status=status,
        passed=status == PASS,
        blocking=status == FAIL or (status == INCONCLUSIVE and blocking),
        more_items=more,
        reason=reason,
    )


def unsettled_rule(check: Check) -> UnsettledRule:
    """An inconclusive check as the approval form and ``tuneloop status`` list it."""
    return UnsettledRule(
        rule=check.rule,
        suite=check.suite,
        metric=check.metric,
        slice=check.slice,
        more_items=check.more_items,
        blocking=check.blocking,
        reason=check.reason,
        line=unsettled_line(check),
    )


def unsettled_line(check: Check) -> str:
    """One unsettled rule in a line: the rule, where, and what would settle it."""
    where = f"{check.suite}/{check.metric}" + (f" [{check.slice}]" if check.slice else "")
    more = check.more_items
    unit = "votes" if check.rule == "blind_review" else "items"
    settle = (
        f"about {more} more {unit} would settle it" if more else "no number of items settles it"
    )
    return f"{check.rule} {where}: inconclusive, {settle}"


def _aligned(items: Items, suite: str, models: list[str]) -> dict[str, SuiteItems]:
    for model in models:
        if suite not in items[model]:
            raise GateError(f"evaluate: {model!r} has no scores on suite {suite!r}")
    ids = items[CANDIDATE][suite].ids
    return {m: items[m][suite].aligned(ids, f"{m} on {suite}") for m in models}


def _notes(reference: str, general: Sequence[str], could_not_run: Mapping[str, str]) -> list[str]:
    """What the verdict did not judge, and why."""
    notes: list[str] = []
    if reference == BASE:
        notes.append("no champion in the registry yet (first release): no regression check")
    for suite, why in could_not_run.items():
        notes.append(f"general suite {suite}: {why}")
    if could_not_run and not general:
        notes.append("forgetting budget not enforced: no general suite could run")
    elif not general and not could_not_run:
        notes.append("no general suites (evaluate.general_suites): forgetting is not measured")
    return notes


@dataclass(frozen=True)
class _Judged:
    """What the rules found, before the verdict adds it up."""

    checks: list[Check]
    comparisons: list[Comparison]
    slices: list[SliceComparison]
    counts: dict[str, int]
    exports: dict[str, ExportStanding]
    fixed: FixedBadcases


def _verdict(
    gate: GateParams,
    judged: _Judged,
    reference: str,
    general: Sequence[str],
    could_not_run: Mapping[str, str],
    last_notes: list[str],
    directions: Directions,
) -> Decision:
    checks = judged.checks
    # A failure always blocks; an unsettled check blocks only where the rules say so.
    verdict = outcome(c.status for c in checks if c.blocking)
    failed = [c for c in checks if c.status == FAIL]
    unsettled = [c for c in checks if c.status == INCONCLUSIVE and c.blocking]
    # Per suite, the most any unsettled check needs; None when one of them cannot say.
    more: dict[str, int | None] = {}
    for suite in dict.fromkeys(c.suite for c in unsettled):
        needs = [c.more_items for c in unsettled if c.suite == suite]
        more[suite] = None if None in needs else max(n for n in needs if n is not None)
    regressed = [s for s in judged.slices if s.regressed]
    notes = _notes(reference, general, could_not_run)
    slice_lines = [
        f"slice regressed (reported only): {_figures(s, gate.confidence)}"
        for s in regressed
        if gate.max_slice_regression is None
    ]
    others = [c for c in checks if c.status == INCONCLUSIVE and not c.blocking]
    if others:
        notes.insert(
            0,
            f"{len(others)} rule(s) unsettled and let through (gate.on_inconclusive: warn): "
            "the approval needs a person's acknowledgement of each",
        )
    passes = [c for c in checks if c.status == PASS]
    return Decision(
        verdict=verdict,
        passed=verdict == PASS,
        primary_metric=gate.primary_metric,
        thresholds=Thresholds(
            min_gain=gate.min_gain,
            max_regression=gate.max_regression,
            fp8_max_drop=gate.fp8_max_drop,
            max_forgetting=gate.max_forgetting,
            max_slice_regression=gate.max_slice_regression,
            max_broken_fixes=gate.max_broken_fixes,
            fp4_max_drop=gate.fp4_max_drop,
        ),
        statistics=Statistics(
            method="paired bootstrap, percentile interval",
            confidence=gate.confidence,
            samples=gate.bootstrap_samples,
            seed=gate.seed,
        ),
        reasons=[c.reason for c in failed + unsettled]
        + slice_lines
        + [c.reason for c in others + passes]
        + notes
        + last_notes,
        failed=[c.reason for c in failed],
        inconclusive=[c.reason for c in unsettled],
        on_inconclusive=gate.on_inconclusive,
        unsettled=[unsettled_rule(c) for c in checks if c.status == INCONCLUSIVE],
        more_items=more,
        regressed_slices=[f"{s.suite}/{s.metric} [{s.slice}]" for s in regressed],
        reference=reference,
        items=judged.counts,
        forgetting=Forgetting(
            suites=list(general), reference=reference, could_not_run=dict(could_not_run)
        ),
        checks=checks,
        comparisons=judged.comparisons,
        slices=judged.slices,
        exports=judged.exports,
        fixed_badcases=judged.fixed,
        higher_is_better=directions,
    )
