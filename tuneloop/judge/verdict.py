"""The one verdict vocabulary, shared by the gate, the release analysis and preflight.

A rule settles to ``pass`` (the whole interval, or the measured value, clears its threshold),
``fail`` (none of it does) or ``inconclusive`` (the data could not tell: too few items or
samples, or an interval that straddles the threshold). Preflight and ``tuneloop doctor`` also
say ``warn`` (it will work, but slower or riskier than it should) and ``skip`` (does not apply
here: no GPU, a tool not installed, nothing to compare), each with a detail saying why.

A group of checks adds up to its worst status (:func:`worst`), in the order of ``SEVERITY``:
a failure outweighs an unsettled rule, which outweighs a warning. What a group's outcome then
does (block, warn, pass) is the caller's decision, never this module's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

Outcome = Literal["pass", "fail", "inconclusive"]
Status = Literal["pass", "warn", "fail", "inconclusive", "skip"]
PASS: Outcome = "pass"
FAIL: Outcome = "fail"
INCONCLUSIVE: Outcome = "inconclusive"
STATUSES: tuple[Status, ...] = ("pass", "warn", "fail", "inconclusive", "skip")
# From worst to best: what a group of results adds up to.
SEVERITY: tuple[Status, ...] = ("fail", "inconclusive", "warn", "skip", "pass")


@dataclass(frozen=True)
class Check:
    """One line of a report: what was found and, unless it passed, what to do about it.

    ``value``: the figures behind it (an interval, a p-value, the sample counts), as plain JSON
    values, so a report, a metrics file and an MLflow run all carry the same numbers.
    """

    name: str
    status: Status
    detail: str
    value: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return self.status == "pass"

    @property
    def settled(self) -> bool:
        """False while the data could not tell (``inconclusive``)."""
        return self.status != "inconclusive"


def worst(statuses: Iterable[Status]) -> Status:
    """The worst of ``statuses`` (``pass`` for none)."""
    return min(statuses, key=SEVERITY.index, default="pass")


def outcome(statuses: Iterable[Status]) -> Outcome:
    """What a group of rules settles to: ``fail`` when any failed, else ``inconclusive`` when
    any could not be settled, else ``pass`` (warnings and skips do not change an outcome)."""
    found = set(statuses)
    if "fail" in found:
        return FAIL
    if "inconclusive" in found:
        return INCONCLUSIVE
    return PASS


def counts(checks: Sequence[Check]) -> dict[str, int]:
    return {s: sum(c.status == s for c in checks) for s in STATUSES}


def run_timed(checks: Sequence[Callable[[], Check]]) -> list[Check]:
    """Run every check (one failure never hides the next), each with its own duration."""
    results = []
    for check in checks:
        start = time.perf_counter()
        result = check()
        results.append(replace(result, seconds=time.perf_counter() - start))
    return results
