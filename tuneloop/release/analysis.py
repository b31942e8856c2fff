"""The release controller's judgement: per-arm figures in, a verdict with its reasons out.

Pure functions only; the release flow (``flows/release.py``) does the I/O and
calls these. What is decided here:

- **analysis** of one interval of canary traffic: the challenger against the
  champion on error rate, p99 latency, p99 time to first token and badcase rate,
  from the router's ``/admin/stats`` read at the start and end of the interval.
  A badcase counts once per distinct user, and only when the router attributed
  it through a request id it signed (``badcase_users``): a client cannot charge
  flags to the other arm, and one user flagging many answers counts once;
- **the ramp plan**: which percent comes next, and whether a person's answer to
  the approval form is one the flow may act on.

Counters (requests, errors, badcases) are cumulative in the router, so an
interval's rates come from the difference of two reads. Percentiles are the
router's windowed ones (its last ``stats_window`` requests per arm): they lag
an interval, which the thresholds must allow for.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

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


def interval(before: Snapshot, after: Snapshot) -> Snapshot:
    """What happened between two reads: counter differences, the later read's percentiles.

    A counter that went down means the router restarted in between; then the
    later read alone is the best account of the interval.
    """
    arms = {}
    for arm in ARMS:
        b, a = before.arms[arm], after.arms[arm]
        restarted = a.requests < b.requests or a.errors < b.errors or a.badcases < b.badcases
        arms[arm] = ArmFigures(
            requests=a.requests if restarted else a.requests - b.requests,
            errors=a.errors if restarted else a.errors - b.errors,
            badcases=a.badcases if restarted else a.badcases - b.badcases,
            latency_p99_ms=a.latency_p99_ms,
            ttft_p99_ms=a.ttft_p99_ms,
        )
    return Snapshot(after.challenger_percent, arms)


@dataclass(frozen=True)
class Check:
    """One comparison. ``passed`` is None when there was nothing to compare (check skipped)."""

    name: str
    challenger: float | None
    champion: float | None
    limit: str
    passed: bool | None

    def describe(self) -> str:
        verdict = {True: "ok", False: "FAILED", None: "skipped (no data)"}[self.passed]
        return f"{self.name}: challenger {_fmt(self.challenger)} vs champion " + (
            f"{_fmt(self.champion)} (limit {self.limit}): {verdict}"
        )


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4g}"


@dataclass(frozen=True)
class Verdict:
    """The outcome of an analysis or of the load test gate, with every number behind it."""

    passed: bool
    checks: tuple[Check, ...]

    @property
    def interrupted(self) -> bool:
        """The router's weight is not the one this release set: stop, whatever else passed."""
        return any(c.name == WEIGHT_CHECK and c.passed is False for c in self.checks)

    @property
    def reasons(self) -> list[str]:
        """What failed, or a one-line summary when nothing did."""
        failed = [c.describe() for c in self.checks if c.passed is False]
        return failed or ["all checks passed: " + "; ".join(c.describe() for c in self.checks)]

    def as_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "checks": [
                {
                    "name": c.name,
                    "challenger": c.challenger,
                    "champion": c.champion,
                    "limit": c.limit,
                    "passed": c.passed,
                }
                for c in self.checks
            ],
        }


def _ratio_check(
    name: str, challenger: float | None, champion: float | None, limit: float
) -> Check:
    if challenger is None or champion is None:
        return Check(name, challenger, champion, f"<= {limit} x champion", None)
    # A champion at 0 ms (no resolution) still allows the challenger 0 ms.
    passed = challenger <= limit * champion if champion > 0 else challenger <= 0
    return Check(name, challenger, champion, f"<= {limit} x champion", passed)


def _rate_check(name: str, challenger: float | None, champion: float | None, limit: float) -> Check:
    if challenger is None:
        return Check(name, challenger, champion, f"<= champion + {limit}", None)
    # At 100 % the champion gets no requests: hold the challenger to an absolute limit.
    baseline = champion if champion is not None else 0.0
    return Check(
        name, challenger, champion, f"<= champion + {limit}", challenger <= baseline + limit
    )


def analyse(window: Snapshot, params: ReleaseParams, expected_percent: int) -> Verdict:
    """Judge one interval of canary traffic against the thresholds in ``params``.

    Too few challenger requests is a failed analysis, not a pass: a canary that
    cannot be judged must not be ramped. A router weight other than the one the
    flow set means someone else moved it (a manual rollback): ``interrupted``.
    """
    ch, champ = window.arms["challenger"], window.arms["champion"]
    weight = Check(
        WEIGHT_CHECK,
        float(window.challenger_percent),
        None,
        f"== {expected_percent} (set by this release)",
        window.challenger_percent == expected_percent,
    )
    traffic = Check(
        "challenger_requests",
        float(ch.requests),
        float(champ.requests),
        f">= {params.min_requests}",
        ch.requests >= params.min_requests,
    )
    checks = (
        weight,
        traffic,
        _rate_check("error_rate", ch.error_rate, champ.error_rate, params.max_error_rate_increase),
        _rate_check(
            "badcase_rate", ch.badcase_rate, champ.badcase_rate, params.max_badcase_rate_increase
        ),
        _ratio_check(
            "latency_p99_ms", ch.latency_p99_ms, champ.latency_p99_ms, params.max_latency_p99_ratio
        ),
        _ratio_check("ttft_p99_ms", ch.ttft_p99_ms, champ.ttft_p99_ms, params.max_ttft_p99_ratio),
    )
    return Verdict(all(c.passed is not False for c in checks), checks)


# --- the ramp and the person's answer --------------------------------------------------------


def next_step(steps: Sequence[int], current: int) -> int | None:
    """The planned percent after ``current`` (None at 100: promote, not ramp)."""
    return next((s for s in steps if s > current), None)


def approval_poll_seconds(approval_timeout: int) -> int:
    """How often a paused flow asks the server whether it was answered.

    Often enough that a short test timeout is honoured within a second or so,
    rarely enough that a day-long wait costs the server nothing.
    """
    return max(1, min(10, approval_timeout // 60))


class InvalidAnswer(ValueError):
    """A person's answer to the approval form that the flow must not act on; says why."""


class Approval(BaseModel):
    """A person's answer to "ramp the challenger?", validated before anything moves."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    decision: Literal["approve", "reject"] = Field(description="approve the next step or roll back")
    approver: str = Field(min_length=1, max_length=100, description="who decided (your name)")
    next_percent: int = Field(ge=1, le=100, description="challenger percent to move to")
    comment: str = Field(default="", max_length=2000, description="why; kept with the release")


def validate_answer(answer: Mapping[str, Any], current: int) -> Approval:
    """The answer as an ``Approval``, checked again here.

    Prefect checks a form against the schema it saved, but a form class made
    with ``RunInput.with_initial_data`` loses its bounds, and an approval may
    come through the REST API as well: the flow trusts only this check.
    """
    try:
        approval = Approval.model_validate(dict(answer))
    except ValidationError as error:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in error.errors()
        )
        raise InvalidAnswer(f"approval form invalid: {problems}") from None
    if not approval.approver.strip():
        raise InvalidAnswer("approval form invalid: approver is blank; give your name")
    if approval.decision == "approve" and approval.next_percent <= current:
        raise InvalidAnswer(
            f"approval form invalid: next_percent {approval.next_percent} is not above the "
            f"current {current} %; to lower traffic, reject (which rolls back)"
        )
    return approval
