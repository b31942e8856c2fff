"""The router's time, one object the endpoints ask: the wall clock (leases, state-file times,
request-id ages) and the monotonic one (flag rates, warnings).

A router runs on ``SYSTEM``; a test hands ``create_app`` a clock it moves itself, so a lease
lapses or a rate refills when the test says, not after a fixed sleep.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def time(self) -> float:
        """Seconds since the epoch."""
        ...

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back, for intervals."""
        ...


class SystemClock:
    def time(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()


SYSTEM = SystemClock()
