"""The release controller's judgement: an interval's requests in, a verdict with its reasons out.

Pure functions only; the release flow (``flows/release.py``) does the I/O and
calls these. What is decided here:

- **analysis** of one interval of canary traffic, the challenger against the
  champion on the interval's own requests (the router's per-request samples,
  ``GET /admin/samples``): error and badcase rates by a two-proportion test,
  latency and time to first token by a Mann-Whitney U test, as Kayenta's judge
  does. Each check needs a minimum of samples per arm and says **pass**, **fail**
  or **inconclusive**: a difference past its limit fails only when it is
  significant (p < ``alpha``); past the limit but not significant, or too few
  samples, is inconclusive, and the flow extends the interval (up to
  ``max_extensions`` times) before it counts as a failure. The badcase rate is the
  share of the interval's users with a flagged answer, a flag counting only when the
  router attributed it through a request id it signed: a client cannot charge
  flags to the other arm, and one user flagging many answers counts once;
- **the shadow step's analysis**: both arms' answers to the same mirrored
  requests, compared on errors, latency, the suites' answer format (paired, by an
  exact McNemar test), answer length and, where a request is a suite's question,
  that suite's own scores;
- (the load test before the first traffic lives in ``tuneloop/release/loadtest.py``);
- **the ramp plan**: which percent comes next (a person's answer to the approval
  form lives in ``tuneloop/release/approval.py``).

``parse_stats`` and ``merge`` read the router's cumulative ``/admin/stats``
(for ``tuneloop status``); the analysis does not use them.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from scipy import stats as scipy_stats
from scipy.stats import binomtest, mannwhitneyu

from tuneloop.params import ReleaseParams
from tuneloop.release import ARMS

WEIGHT_CHECK = "challenger_percent"


class StatsError(ValueError):
    """A router answered ``/admin/stats`` with something the controller cannot read."""


@dataclass(frozen=True)
class ArmFigures:
    """One arm's figures from ``/admin/stats``: counters, windowed p99s in ms (None: no data).

    ``badcases`` is the router's ``badcase_users``: distinct users with an attributed flag.
    """

    requests: int
    errors: int
    badcases: int
    latency_p99_ms: float | None
    ttft_p99_ms: float | None

    @property
    def error_rate(self) -> float | None:
        return self.errors / self.requests if self.requests else None

    @property
    def badcase_rate(self) -> float | None:
        return self.badcases / self.requests if self.requests else None


@dataclass(frozen=True)
class Snapshot:
    """All router replicas' figures at one moment, as if one router had served everything."""

    challenger_percent: int
    arms: Mapping[str, ArmFigures]

    @property
    def challenger_share(self) -> float | None:
        """The share of requests the challenger actually got (to check the router obeys)."""
        total = sum(a.requests for a in self.arms.values())
        return self.arms["challenger"].requests / total if total else None


def parse_stats(payload: Mapping[str, Any]) -> Snapshot:
    """A ``Snapshot`` from one router's ``/admin/stats`` JSON."""
    try:
        arms = {
            arm: ArmFigures(
                requests=int(payload["arms"][arm]["requests"]),
                errors=int(payload["arms"][arm]["errors"]),
                badcases=int(payload["arms"][arm]["badcase_users"]),
                latency_p99_ms=_optional(payload["arms"][arm]["latency_ms"]["p99"]),
                ttft_p99_ms=_optional(payload["arms"][arm]["ttft_ms"]["p99"]),
            )
            for arm in ARMS
        }
        percent = int(payload["challenger_percent"])
    except (KeyError, TypeError, ValueError) as error:
        raise StatsError(
            f"/admin/stats is missing or mangles {error!r}; is it a tuneloop router?"
        ) from None
    return Snapshot(percent, arms)


def _optional(value: object) -> float | None:
    return None if value is None else float(value)  # type: ignore[arg-type]


def merge(snapshots: Sequence[Snapshot]) -> Snapshot:
    """Replicas summed: counters add up; a p99 is the worst replica's (no raw samples to pool).

    Replicas that disagree on the weight mean a change reached only some of them;
    that is an error for a person, not something to average away.
    """
    if not snapshots:
        raise StatsError("no router answered")
    percents = {s.challenger_percent for s in snapshots}
    if len(percents) > 1:
        raise StatsError(
            f"router replicas disagree on challenger_percent ({sorted(percents)}); "
            "a weight change reached only some of them: set it again or roll back"
        )
    arms = {
        arm: ArmFigures(
            requests=sum(s.arms[arm].requests for s in snapshots),
            errors=sum(s.arms[arm].errors for s in snapshots),
            badcases=sum(s.arms[arm].badcases for s in snapshots),
            latency_p99_ms=_worst(s.arms[arm].latency_p99_ms for s in snapshots),
            ttft_p99_ms=_worst(s.arms[arm].ttft_p99_ms for s in snapshots),
        )
        for arm in ARMS
    }
    return Snapshot(snapshots[0].challenger_percent, arms)


def _worst(values: Any) -> float | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None


# --- an interval's own requests -----------------------------------------------------------------


@dataclass(frozen=True)
class ArmSamples:
    """One arm's requests in one interval, from the router's per-request samples.

    ``badcases``: requests flagged by a counted badcase (attributed through a
    signed request id, on the arm's current version). ``users``: the distinct users
    among ``requests`` (an anonymous request is a user of its own), ``badcase_users``
    those with a flagged request: the badcase rate is per user, so a user who flags
    many answers counts once, and every interval counts its own users afresh.
    """

    requests: int = 0
    errors: int = 0
    badcases: int = 0
    latency_ms: tuple[float, ...] = ()
    ttft_ms: tuple[float, ...] = ()
    users: int = 0
    badcase_users: int = 0

    @property
    def badcase_figures(self) -> tuple[int, int]:
        """(flagged, served) for the badcase rate: users, or requests where users are unknown."""
        if self.users:
            return self.badcase_users, self.users
        return self.badcases, self.requests


@dataclass(frozen=True)
class Traffic:
    """Both arms' requests in one interval, from every router replica."""

    challenger_percent: int
    arms: Mapping[str, ArmSamples]
    dropped: int = 0  # requests the routers no longer held when read (their ring overflowed)

    @property
    def challenger_share(self) -> float | None:
        total = sum(a.requests for a in self.arms.values())
        return self.arms["challenger"].requests / total if total else None


def tally(samples: Iterable[Mapping[str, Any]], challenger_percent: int, dropped: int) -> Traffic:
    """``Traffic`` from the items of ``GET /admin/samples`` (hostile JSON: checked here)."""
    counts = {arm: [0, 0, 0] for arm in ARMS}
    latency: dict[str, list[float]] = {arm: [] for arm in ARMS}
    ttft: dict[str, list[float]] = {arm: [] for arm in ARMS}
    users: dict[str, set[object]] = {arm: set() for arm in ARMS}
    flagged: dict[str, set[object]] = {arm: set() for arm in ARMS}
    try:
        for index, sample in enumerate(samples):
            arm = sample["arm"]
            if arm not in counts:
                raise ValueError(f"unknown arm {arm!r}")
            c = counts[arm]
            c[0] += 1
            c[1] += sample["error"] is not None
            c[2] += sample["badcase"] is True
            user = sample.get("user")
            if user is not None and not isinstance(user, str):
                raise ValueError(f"user {user!r}")
            who = user if user is not None else index  # anonymous: a user of its own
            users[arm].add(who)
            if sample["badcase"] is True:
                flagged[arm].add(who)
            for key, into in (("latency_ms", latency), ("ttft_ms", ttft)):
                value = sample[key]
                if value is not None:
                    number = float(value)
                    if not math.isfinite(number) or number < 0:
                        raise ValueError(f"{key} {value!r}")
                    into[arm].append(number)
    except (KeyError, TypeError, ValueError) as error:
        raise StatsError(
            f"/admin/samples holds an unreadable sample ({error!r}); is it a tuneloop router?"
        ) from None
    arms = {
        arm: ArmSamples(
            counts[arm][0],
            counts[arm][1],
            counts[arm][2],
            tuple(latency[arm]),
            tuple(ttft[arm]),
            users=len(users[arm]),
            badcase_users=len(flagged[arm]),
        )
        for arm in ARMS
    }
    return Traffic(challenger_percent, arms, dropped)


# --- the tests ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Check:
    """One comparison.

    ``passed``: True, False, or None when it could not decide: ``inconclusive``
    (too few samples, or past its limit but not significantly) or skipped
    (nothing to compare, e.g. no streamed request on either arm).
    ``p_value``: of the test behind a verdict; ``samples``: (challenger, champion).
    """

    name: str
    challenger: float | None
    champion: float | None
    limit: str
    passed: bool | None
    p_value: float | None = None
    samples: tuple[int, int] | None = None
    inconclusive: bool = False
    note: str = ""

    def describe(self) -> str:
        if self.passed is None:
            verdict = f"INCONCLUSIVE ({self.note})" if self.inconclusive else "skipped (no data)"
        else:
            verdict = "ok" if self.passed else "FAILED"
        extra = "" if self.p_value is None else f", p={self.p_value:.3g}"
        if self.samples is not None:
            extra += f", n={self.samples[0]}/{self.samples[1]}"
        return f"{self.name}: challenger {_fmt(self.challenger)} vs champion " + (
            f"{_fmt(self.champion)} (limit {self.limit}{extra}): {verdict}"
        )


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4g}"


Outcome = Literal["pass", "fail", "inconclusive"]


@dataclass(frozen=True)
class Verdict:
    """The outcome of an analysis or of the load test gate, with every number behind it.

    ``figures``: what was measured beside the checks (answer lengths, suite scores).
    """

    passed: bool
    checks: tuple[Check, ...]
    figures: Mapping[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, checks: Sequence[Check], figures: Mapping[str, float] | None = None) -> Verdict:
        """Passed when no check failed and none was inconclusive."""
        passed = all(c.passed is not False and not c.inconclusive for c in checks)
        return cls(passed, tuple(checks), dict(figures or {}))

    @property
    def outcome(self) -> Outcome:
        if any(c.passed is False for c in self.checks):
            return "fail"
        if any(c.inconclusive for c in self.checks):
            return "inconclusive"
        return "pass" if self.passed else "fail"

    @property
    def interrupted(self) -> bool:
        """The router's weight is not the one this release set: stop, whatever else passed."""
        return any(c.name == WEIGHT_CHECK and c.passed is False for c in self.checks)

    @property
    def reasons(self) -> list[str]:
        """What failed or could not be decided, or a one-line summary when all passed."""
        failed = [c.describe() for c in self.checks if c.passed is False or c.inconclusive]
        return failed or ["all checks passed: " + "; ".join(c.describe() for c in self.checks)]

    def as_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "outcome": self.outcome,
            "checks": [
                {
                    "name": c.name,
                    "challenger": c.challenger,
                    "champion": c.champion,
                    "limit": c.limit,
                    "passed": c.passed,
                    "p_value": c.p_value,
                    "samples": None if c.samples is None else list(c.samples),
                    "inconclusive": c.inconclusive,
                }
                for c in self.checks
            ],
            "figures": dict(self.figures),
        }


def _ratio_check(
    name: str, challenger: float | None, champion: float | None, limit: float
) -> Check:
    if challenger is None or champion is None:
        return Check(name, challenger, champion, f"<= {limit} x champion", None)
    # A champion at 0 ms (no resolution) still allows the challenger 0 ms.
    passed = challenger <= limit * champion if champion > 0 else challenger <= 0
    return Check(name, challenger, champion, f"<= {limit} x champion", passed)


def _decide(
    name: str,
    values: tuple[float | None, float | None],
    limit: str,
    samples: tuple[int, int],
    worse: bool,
    p_value: float,
    alpha: float,
) -> Check:
    """Past the limit and significant: fail; past it but not significant: inconclusive."""
    if not worse:
        return Check(name, *values, limit, True, p_value, samples)
    if p_value < alpha:
        return Check(name, *values, limit, False, p_value, samples)
    note = f"past the limit, not significant at alpha {alpha}: more traffic decides"
    return Check(name, *values, limit, None, p_value, samples, inconclusive=True, note=note)


def _too_few(name: str, limit: str, samples: tuple[int, int], minimum: int) -> Check:
    note = f"needs {minimum} samples per arm, has {samples[0]}/{samples[1]}"
    return Check(name, None, None, limit, None, None, samples, inconclusive=True, note=note)


def two_proportion_p(x1: int, n1: int, x2: int, n2: int) -> float:
    """One-sided p-value of the pooled two-proportion z-test, H1: x1/n1 > x2/n2.

    Written out (scipy has no two-proportion test and statsmodels is not a
    dependency); it is the textbook statistic. When neither arm has an event
    there is no difference to find: p = 1.
    """
    pooled = (x1 + x2) / (n1 + n2)
    se = math.sqrt(pooled * (1 - pooled) * (1 / n1 + 1 / n2))
    if se == 0:
        return 1.0
    return float(scipy_stats.norm.sf((x1 / n1 - x2 / n2) / se))


def rate_check(
    name: str,
    challenger: tuple[int, int],
    champion: tuple[int, int],
    max_increase: float,
    params: ReleaseParams,
    alone: bool = False,
) -> Check:
    """Challenger's rate (events, requests) against the champion's, at most ``+max_increase``.

    ``alone`` (the 100 % step, where the champion gets no requests): the
    challenger is held to ``max_increase`` as an absolute rate, by an exact
    binomial test.
    """
    (x1, n1), (x2, n2) = challenger, champion
    limit = f"<= champion + {max_increase}"
    if alone:
        limit = f"<= {max_increase} (no champion traffic)"
        if n1 < params.min_requests:
            return _too_few(name, limit, (n1, n2), params.min_requests)
        rate = x1 / n1
        p = float(binomtest(x1, n1, max_increase, alternative="greater").pvalue)
        return _decide(name, (rate, None), limit, (n1, n2), rate > max_increase, p, params.alpha)
    if min(n1, n2) < params.min_requests:
        return _too_few(name, limit, (n1, n2), params.min_requests)
    r1, r2 = x1 / n1, x2 / n2
    p = two_proportion_p(x1, n1, x2, n2)
    return _decide(name, (r1, r2), limit, (n1, n2), r1 - r2 > max_increase, p, params.alpha)


def distribution_check(
    name: str,
    challenger: Sequence[float],
    champion: Sequence[float],
    max_ratio: float,
    minimum: int,
    alpha: float,
    alone: bool = False,
) -> Check:
    """p99 of the challenger's times at most ``max_ratio`` x the champion's; the evidence that
    the challenger is slower is a one-sided Mann-Whitney U test (as Kayenta's judge uses).

    No samples on either arm (no streamed request has a TTFT), or ``alone`` (the
    100 % step: no champion to compare with): skipped.
    """
    n = (len(challenger), len(champion))
    limit = f"p99 <= {max_ratio} x champion"
    if n == (0, 0) or alone:
        return Check(name, None, None, limit, None, samples=n)
    if min(n) < minimum:
        return _too_few(name, limit, n, minimum)
    mine, theirs = _p99(challenger), _p99(champion)
    p = float(mannwhitneyu(challenger, champion, alternative="greater").pvalue)
    worse = mine > max_ratio * theirs if theirs > 0 else mine > 0
    return _decide(name, (mine, theirs), limit, n, worse, p, alpha)


def _p99(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[max(1, math.ceil(0.99 * len(ordered))) - 1]


def analyse(
    traffic: Traffic,
    params: ReleaseParams,
    expected_percent: int,
    reference: ArmSamples | None = None,
) -> Verdict:
    """Judge one interval of canary traffic: pass, fail or inconclusive, with p-values.

    A router weight other than the one the flow set means someone else moved it
    (a manual rollback): ``interrupted``. ``reference``: the champion's requests of the
    last interval it served, the comparison at 100 % (where it serves none); without one
    the challenger is held to the limits as absolute rates there.
    """
    ch, champ = traffic.arms["challenger"], traffic.arms["champion"]
    alone = expected_percent == 100
    if alone and reference is not None and reference.requests:
        # An absolute limit at 100 % held a challenger that was wrong for 60 % of its users
        # to 20 % while the champion it replaced was wrong for all of them (the demo's).
        champ, alone = reference, False
    weight = Check(
        WEIGHT_CHECK,
        float(traffic.challenger_percent),
        None,
        f"== {expected_percent} (set by this release)",
        traffic.challenger_percent == expected_percent,
    )
    checks = (
        weight,
        rate_check(
            "error_rate",
            (ch.errors, ch.requests),
            (champ.errors, champ.requests),
            params.max_error_rate_increase,
            params,
            alone,
        ),
        rate_check(
            "badcase_rate",
            ch.badcase_figures,
            champ.badcase_figures,
            params.max_badcase_rate_increase,
            params,
            alone,
        ),
        distribution_check(
            "latency_ms",
            ch.latency_ms,
            champ.latency_ms,
            params.max_latency_p99_ratio,
            params.min_latency_samples,
            params.alpha,
            alone,
        ),
        distribution_check(
            "ttft_ms",
            ch.ttft_ms,
            champ.ttft_ms,
            params.max_ttft_p99_ratio,
            params.min_ttft_samples,
            params.alpha,
            alone,
        ),
    )
    return Verdict.of(checks)


# --- the shadow step ----------------------------------------------------------------------------

# A mirrored answer's scores from the suites: (suite metric name -> value) or None when no
# suite item asks this prompt. Built by the flow from eval/<suite>/utils.py.
Scorer = Callable[[str, str], Mapping[str, float] | None]


@dataclass(frozen=True)
class Pair:
    """One mirrored request: the prompt, each arm's answer text (None: no answer), time, error."""

    prompt: str
    champion: str | None
    challenger: str | None
    champion_ms: float | None
    challenger_ms: float | None
    champion_error: bool
    challenger_error: bool


def read_pairs(items: Iterable[Mapping[str, Any]]) -> list[Pair]:
    """``Pair``s from the items of ``GET /admin/shadow`` (hostile JSON: checked here)."""
    pairs = []
    try:
        for item in items:
            a, b = item["champion"], item["challenger"]
            for answer in (a, b):
                if answer["text"] is not None and not isinstance(answer["text"], str):
                    raise TypeError("text is not a string")
            pairs.append(
                Pair(
                    str(item["prompt"]),
                    a["text"],
                    b["text"],
                    _optional(a["latency_ms"]),
                    _optional(b["latency_ms"]),
                    a["error"] is not None,
                    b["error"] is not None,
                )
            )
    except (KeyError, TypeError, ValueError) as error:
        raise StatsError(
            f"/admin/shadow holds an unreadable pair ({error!r}); is it a tuneloop router?"
        ) from None
    return pairs


def mcnemar_p(worse: int, better: int) -> float:
    """One-sided exact McNemar p-value: of the pairs where the arms differ, the challenger
    is the worse one in ``worse`` and the better one in ``better``; H1: it is worse more often.
    """
    if worse + better == 0:
        return 1.0
    return float(binomtest(worse, worse + better, 0.5, alternative="greater").pvalue)


def analyse_shadow(
    pairs: Sequence[Pair],
    params: ReleaseParams,
    compliant: Callable[[str], bool] | None,
    scorer: Scorer | None,
) -> Verdict:
    """Judge one interval of mirrored requests, both arms answering each one.

    Checks: errors (paired), latency (Mann-Whitney), and with ``compliant`` (the
    suites' answer format) the format compliance of the requests both arms
    answered. Figures beside them: median answer lengths and, on prompts that are
    a suite's questions, each suite metric's mean for both arms.
    """
    n = len(pairs)
    shadow = params.shadow
    if n < shadow.min_pairs:
        note = f"needs {shadow.min_pairs} mirrored requests, has {n}"
        return Verdict.of(
            (Check("shadow_pairs", float(n), None, f">= {shadow.min_pairs}", None, None, (n, n),
                   inconclusive=True, note=note),)
        )  # fmt: skip
    worse = sum(p.challenger_error and not p.champion_error for p in pairs)
    better = sum(p.champion_error and not p.challenger_error for p in pairs)
    ch_rate = sum(p.challenger_error for p in pairs) / n
    champ_rate = sum(p.champion_error for p in pairs) / n
    limit = params.max_error_rate_increase
    checks = [
        _decide(
            "shadow_error_rate",
            (ch_rate, champ_rate),
            f"<= champion + {limit}",
            (n, n),
            ch_rate - champ_rate > limit,
            mcnemar_p(worse, better),
            params.alpha,
        ),
        distribution_check(
            "shadow_latency_ms",
            [p.challenger_ms for p in pairs if p.challenger_ms is not None],
            [p.champion_ms for p in pairs if p.champion_ms is not None],
            params.max_latency_p99_ratio,
            params.min_latency_samples,
            params.alpha,
        ),
    ]
    answered = [(p.champion, p.challenger) for p in pairs if p.champion and p.challenger]
    figures: dict[str, float] = {"shadow.pairs": float(n), "shadow.answered": float(len(answered))}
    if compliant is not None:
        checks.append(_format_check(answered, compliant, shadow.min_pairs, shadow.max_format_drop,
                                    params.alpha))  # fmt: skip
    for arm, index in (("champion", 0), ("challenger", 1)):
        lengths = [len(a[index]) for a in answered]
        if lengths:
            figures[f"shadow.{arm}.answer_chars_median"] = float(statistics.median(lengths))
    if scorer is not None:
        figures.update(_suite_figures(pairs, scorer))
    return Verdict.of(checks, figures)


def _format_check(
    answered: Sequence[tuple[str, str]],
    compliant: Callable[[str], bool],
    minimum: int,
    max_drop: float,
    alpha: float,
) -> Check:
    name, limit = "shadow_format_compliance", f">= champion - {max_drop}"
    n = len(answered)
    if n < minimum:
        return _too_few(name, limit, (n, n), minimum)
    marks = [(compliant(a), compliant(b)) for a, b in answered]
    champ = sum(a for a, _ in marks) / n
    mine = sum(b for _, b in marks) / n
    p = mcnemar_p(sum(a and not b for a, b in marks), sum(b and not a for a, b in marks))
    return _decide(name, (mine, champ), limit, (n, n), champ - mine > max_drop, p, alpha)


def _suite_figures(pairs: Sequence[Pair], scorer: Scorer) -> dict[str, float]:
    """Each suite metric's mean for both arms over the prompts a suite asks, and how many."""
    sums: dict[str, list[float]] = {}
    count = 0
    for pair in pairs:
        if pair.champion is None or pair.challenger is None:
            continue
        mine, theirs = scorer(pair.prompt, pair.challenger), scorer(pair.prompt, pair.champion)
        if mine is None or theirs is None:
            continue
        count += 1
        for metric in mine.keys() & theirs.keys():
            total = sums.setdefault(metric, [0.0, 0.0])
            total[0] += theirs[metric]
            total[1] += mine[metric]
    figures = {"shadow.suite_items": float(count)}
    for metric, (champion_sum, challenger_sum) in sums.items():
        figures[f"shadow.champion.{metric}"] = champion_sum / count
        figures[f"shadow.challenger.{metric}"] = challenger_sum / count
    return figures


# --- the ramp ---------------------------------------------------------------------------------


def next_step(steps: Sequence[int], current: int) -> int | None:
    """The planned percent after ``current`` (None at 100: promote, not ramp)."""
    return next((s for s in steps if s > current), None)
