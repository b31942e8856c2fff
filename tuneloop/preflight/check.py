"""One check's result, shared by preflight and ``tuneloop doctor``.

``pass``: fine. ``warn``: it will work, but slower or riskier than it should; the detail says
what to look at. ``fail``: the run would hang, crash or train on the wrong thing. ``skip``:
does not apply here (no GPU, a tool not installed), and the detail says why.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

Status = Literal["pass", "warn", "fail", "skip"]
STATUSES: tuple[Status, ...] = ("pass", "warn", "fail", "skip")
# From worst to best: what a group of results adds up to.
_WORST: tuple[Status, ...] = ("fail", "warn", "skip", "pass")


@dataclass(frozen=True)
class Check:
    """One line of a report: what was found and, unless it passed, what to do about it."""

    name: str
    status: Status
    detail: str
    value: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


def worst(statuses: Sequence[Status]) -> Status:
    return min(statuses, key=_WORST.index, default="pass")


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
