"""The release controller's judgement: an interval's requests in, a verdict with its reasons out.

Pure functions only; the release flow (``flows/release.py``) does the I/O and
calls these. What is decided here:

- **analysis** of one interval of canary traffic, the challenger against the
  champion on the interval's own requests (the router's per-request samples,
  ``GET /admin/samples``, read by ``tuneloop/release/readings.py``): error and
  badcase rates by a two-proportion test, latency and time to first token by a
  Mann-Whitney U test, as Kayenta's judge does (the tests:
  ``tuneloop/release/checks.py``). Each check needs a minimum of samples per arm
  and says **pass**, **fail** or **inconclusive**: a difference past its limit
  fails only when it is significant (p < ``alpha``); past the limit but not
  significant, or too few samples, is inconclusive, and the flow extends the
  interval (up to ``max_extensions`` times) before it counts as a failure. The
  badcase rate is the share of the interval's users with a flagged answer, a flag
  counting only when the router attributed it through a request id it signed: a
  client cannot charge flags to the other arm, and one user flagging many answers
  counts once;
- **the shadow step's analysis**: both arms' answers to the same mirrored
  requests, compared on errors, latency, the suites' answer format (paired, by an
  exact McNemar test), answer length and, where a request is a suite's question,
  that suite's own scores.

(The load test before the first traffic lives in ``tuneloop/release/loadtest.py``, a
person's answer to the approval form in ``tuneloop/release/approval.py``.)
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tuneloop.judge import stats
from tuneloop.judge.verdict import FAIL, INCONCLUSIVE, PASS, Check, Outcome, outcome
from tuneloop.params import ReleaseParams
from tuneloop.release.checks import comparison, decide, distribution_check, format_check, rate_check
from tuneloop.release.readings import ArmSamples, Pair, Traffic

WEIGHT_CHECK = "challenger_percent"


@dataclass(frozen=True)
class Verdict:
    """The outcome of an analysis or of the load test gate, with every number behind it.

    It settles as its checks do (``tuneloop.judge.verdict.outcome``): ``fail`` when any
    failed, else ``inconclusive`` when any could not be settled, else ``pass``; a skipped
    check changes nothing. ``figures``: what was measured beside the checks (answer
    lengths, suite scores).
    """

    checks: tuple[Check, ...]
    figures: Mapping[str, float] = field(default_factory=dict)

    @property
    def outcome(self) -> Outcome:
        return outcome(c.status for c in self.checks)

    @property
    def passed(self) -> bool:
        return self.outcome == PASS

    @property
    def interrupted(self) -> bool:
        """The router's weight is not the one this release set: stop, whatever else passed."""
        return any(c.name == WEIGHT_CHECK and c.status == FAIL for c in self.checks)

    @property
    def reasons(self) -> list[str]:
        """What failed or could not be decided, or a one-line summary when all passed."""
        failed = [c.detail for c in self.checks if c.status in (FAIL, INCONCLUSIVE)]
        return failed or ["all checks passed: " + "; ".join(c.detail for c in self.checks)]

    def as_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "outcome": self.outcome,
            "checks": [
                {
                    "name": c.name,
                    **c.value,
                    "status": c.status,
                    # As the event log has always carried them: passed is None when the
                    # check could not decide; status says the same in the shared words.
                    "passed": c.passed if c.status in (PASS, FAIL) else None,
                    "inconclusive": c.status == INCONCLUSIVE,
                }
                for c in self.checks
            ],
            "figures": dict(self.figures),
        }


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
    weight = comparison(
        WEIGHT_CHECK,
        PASS if traffic.challenger_percent == expected_percent else FAIL,
        float(traffic.challenger_percent),
        None,
        f"== {expected_percent} (set by this release)",
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
    return Verdict(checks)


# --- the shadow step ----------------------------------------------------------------------------

# A mirrored answer's scores from the suites: (suite metric name -> value) or None when no
# suite item asks this prompt. Built by the flow from eval/<suite>/utils.py.
Scorer = Callable[[str, str], Mapping[str, float] | None]


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
        wanted = f">= {shadow.min_pairs}"
        few = comparison("shadow_pairs", INCONCLUSIVE, float(n), None, wanted, None, (n, n), note)
        return Verdict((few,))
    worse = sum(p.challenger_error and not p.champion_error for p in pairs)
    better = sum(p.champion_error and not p.challenger_error for p in pairs)
    ch_rate = sum(p.challenger_error for p in pairs) / n
    champ_rate = sum(p.champion_error for p in pairs) / n
    limit = params.max_error_rate_increase
    checks = [
        decide(
            "shadow_error_rate",
            (ch_rate, champ_rate),
            f"<= champion + {limit}",
            (n, n),
            ch_rate - champ_rate > limit,
            stats.mcnemar_p(worse, better),
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
        checks.append(format_check(answered, compliant, shadow.min_pairs, shadow.max_format_drop,
                                   params.alpha))  # fmt: skip
    for arm, index in (("champion", 0), ("challenger", 1)):
        lengths = [len(a[index]) for a in answered]
        if lengths:
            figures[f"shadow.{arm}.answer_chars_median"] = float(statistics.median(lengths))
    if scorer is not None:
        figures.update(_suite_figures(pairs, scorer))
    return Verdict(tuple(checks), figures)


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
