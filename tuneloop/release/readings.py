"""What the release reads from the routers: their figures and requests, checked on the way in.

Every reply is hostile JSON until read here: a router that answers something else
raises ``StatsError``, which names the endpoint.

- ``parse_stats`` and ``merge``: the cumulative figures of ``GET /admin/stats``, every
  replica summed into one ``Snapshot`` (for ``tuneloop status``; the analysis does not
  use them);
- ``tally``: one interval's own requests, from the per-request samples of
  ``GET /admin/samples``, as ``Traffic`` (what each canary analysis tests);
- ``read_pairs``: the shadow step's mirrored requests, both arms' answers to each one,
  from ``GET /admin/shadow``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tuneloop.release import ARMS


class StatsError(ValueError):
    """A router answered ``/admin/stats``, ``/admin/samples`` or ``/admin/shadow`` with something
    the controller cannot read."""


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


# --- the shadow step's pairs --------------------------------------------------------------------


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
