"""The release's tests: one figure of the challenger against the champion's, as a ``Check``.

Each test says **pass**, **fail** or **inconclusive** in the shared vocabulary
(``tuneloop/judge/verdict.py``), or **skip** when there is nothing to compare (no
streamed request on either arm, no champion at 100 %). A difference past its limit
fails only when it is significant (p < ``alpha``); past the limit but not
significant, or too few samples per arm, is inconclusive: more traffic decides. The
statistics themselves live in ``tuneloop/judge/stats.py``.

A check's ``value`` holds the figures behind it, as plain JSON values: ``challenger``
and ``champion`` (None: no figure), ``limit`` (in words), ``p_value`` of the test
behind it and ``samples`` per arm ``[challenger, champion]`` (None where not
counted). Its ``detail`` is the one line a person reads.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tuneloop.judge import stats
from tuneloop.judge.verdict import FAIL, INCONCLUSIVE, PASS, Check, Status
from tuneloop.params import ReleaseParams

# How each status reads at the end of a check's line.
SHOWN: dict[Status, str] = {PASS: "ok", FAIL: "FAILED", "skip": "skipped (no data)"}


def comparison(
    name: str,
    status: Status,
    challenger: float | None,
    champion: float | None,
    limit: str,
    p_value: float | None = None,
    samples: Sequence[int] | None = None,
    note: str = "",
) -> Check:
    """A ``Check`` of the challenger's figure against the champion's; ``note``: why it is
    inconclusive."""
    extra = "" if p_value is None else f", p={p_value:.3g}"
    if samples is not None:
        extra += f", n={samples[0]}/{samples[1]}"
    shown = f"INCONCLUSIVE ({note})" if status == INCONCLUSIVE else SHOWN.get(status, status)
    detail = f"{name}: challenger {_fmt(challenger)} vs champion " + (
        f"{_fmt(champion)} (limit {limit}{extra}): {shown}"
    )
    value = {
        "challenger": challenger,
        "champion": champion,
        "limit": limit,
        "p_value": p_value,
        "samples": None if samples is None else list(samples),
    }
    return Check(name, status, detail, value)


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4g}"


def ratio_check(
    name: str,
    challenger: float | None,
    champion: float | None,
    limit: float,
    missing: Status = "skip",
) -> Check:
    """The challenger's figure at most ``limit`` x the champion's; ``missing``: the status when
    either figure is missing."""
    if challenger is None or champion is None:
        return comparison(name, missing, challenger, champion, f"<= {limit} x champion")
    # A champion at 0 ms (no resolution) still allows the challenger 0 ms.
    passed = challenger <= limit * champion if champion > 0 else challenger <= 0
    return comparison(
        name, PASS if passed else FAIL, challenger, champion, f"<= {limit} x champion"
    )


def decide(
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
        return comparison(name, PASS, *values, limit, p_value, samples)
    if p_value < alpha:
        return comparison(name, FAIL, *values, limit, p_value, samples)
    note = f"past the limit, not significant at alpha {alpha}: more traffic decides"
    return comparison(name, INCONCLUSIVE, *values, limit, p_value, samples, note)


def too_few(name: str, limit: str, samples: tuple[int, int], minimum: int) -> Check:
    note = f"needs {minimum} samples per arm, has {samples[0]}/{samples[1]}"
    return comparison(name, INCONCLUSIVE, None, None, limit, None, samples, note)


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
            return too_few(name, limit, (n1, n2), params.min_requests)
        rate = x1 / n1
        p = stats.binomial_p(x1, n1, max_increase)
        return decide(name, (rate, None), limit, (n1, n2), rate > max_increase, p, params.alpha)
    if min(n1, n2) < params.min_requests:
        return too_few(name, limit, (n1, n2), params.min_requests)
    r1, r2 = x1 / n1, x2 / n2
    p = stats.two_proportion_p(x1, n1, x2, n2)
    return decide(name, (r1, r2), limit, (n1, n2), r1 - r2 > max_increase, p, params.alpha)


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
        return comparison(name, "skip", None, None, limit, samples=n)
    if min(n) < minimum:
        return too_few(name, limit, n, minimum)
    mine, theirs = stats.p99(challenger), stats.p99(champion)
    p = stats.mann_whitney_p(challenger, champion)
    worse = mine > max_ratio * theirs if theirs > 0 else mine > 0
    return decide(name, (mine, theirs), limit, n, worse, p, alpha)


def format_check(
    answered: Sequence[tuple[str, str]],
    compliant: Callable[[str], bool],
    minimum: int,
    max_drop: float,
    alpha: float,
) -> Check:
    """The suites' answer format on the requests both arms answered (champion, challenger):
    at most ``max_drop`` below the champion's, paired by an exact McNemar test."""
    name, limit = "shadow_format_compliance", f">= champion - {max_drop}"
    n = len(answered)
    if n < minimum:
        return too_few(name, limit, (n, n), minimum)
    marks = [(compliant(a), compliant(b)) for a, b in answered]
    champ = sum(a for a, _ in marks) / n
    mine = sum(b for _, b in marks) / n
    p = stats.mcnemar_p(sum(a and not b for a, b in marks), sum(b and not a for a, b in marks))
    return decide(name, (mine, champ), limit, (n, n), champ - mine > max_drop, p, alpha)
