"""Per-arm figures of the canary router, as JSON and as Prometheus text.

Counters (requests, errors, badcases, badcase users, refused requests) are
cumulative since the router started. Badcases count only flags that a valid,
first-time request id attributes to the arm's current model version;
``badcase_users`` counts the distinct users among them (each user once per arm),
which is what the canary analysis compares, so one user flagging many answers
cannot steer it.
Percentiles are taken over a bounded window of each arm's most recent requests:
the release controller compares the arms *now*, and a window keeps memory and
the cost of a scrape fixed however long the router runs. This is the usual
Prometheus summary: windowed quantiles, cumulative ``_sum`` and ``_count``.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

ErrorKind = Literal["http_5xx", "connect", "timeout"]
ERROR_KINDS: tuple[ErrorKind, ...] = ("http_5xx", "connect", "timeout")
QUANTILES = (0.5, 0.9, 0.99)


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (a value that was observed, no interpolation); NaN when empty."""
    return _ranked(sorted(values), q)


def _ranked(ordered: Sequence[float], q: float) -> float:
    if not ordered:
        return math.nan
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[rank - 1]


@dataclass
class Window:
    """A bounded recent window of observations plus all-time sum and count."""

    size: int
    recent: deque[float] = field(init=False)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.recent = deque(maxlen=self.size)

    def observe(self, value: float) -> None:
        self.recent.append(value)
        self.total += value
        self.count += 1

    def quantiles(self) -> dict[float, float]:
        ordered = sorted(self.recent)
        return {q: _ranked(ordered, q) for q in QUANTILES}


@dataclass
class ArmStats:
    window: int
    requests: int = 0
    badcases: int = 0
    badcase_users: int = 0
    errors: dict[ErrorKind, int] = field(default_factory=lambda: dict.fromkeys(ERROR_KINDS, 0))
    latency: Window = field(init=False)
    ttft: Window = field(init=False)

    def __post_init__(self) -> None:
        self.latency = Window(self.window)
        self.ttft = Window(self.window)

    def as_json(self) -> dict[str, object]:
        def ms(window: Window) -> dict[str, float | None]:
            # JSON has no NaN: an empty window reads as null.
            return {
                f"p{round(q * 100)}": None if math.isnan(v) else round(v * 1000, 3)
                for q, v in window.quantiles().items()
            }

        errors = sum(self.errors.values())
        return {
            "requests": self.requests,
            "errors": errors,
            "errors_by_kind": dict(self.errors),
            "error_rate": errors / self.requests if self.requests else 0.0,
            "badcases": self.badcases,
            "badcase_users": self.badcase_users,
            "latency_ms": ms(self.latency),
            "ttft_ms": ms(self.ttft),
            "window": {"latency": len(self.latency.recent), "ttft": len(self.ttft.recent)},
        }


def new_stats(arms: Iterable[str], window: int) -> dict[str, ArmStats]:
    return {arm: ArmStats(window) for arm in arms}


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _num(value: float) -> str:
    return "NaN" if math.isnan(value) else repr(float(value))


def render_prometheus(
    stats: Mapping[str, ArmStats],
    versions: Mapping[str, str],
    challenger_percent: int,
    refused: Mapping[tuple[str, int], int],
) -> str:
    """Prometheus text exposition format 0.0.4."""
    lines: list[str] = []

    def family(name: str, kind: str, help_text: str) -> None:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")

    family("tuneloop_router_challenger_percent", "gauge", "User buckets on the challenger.")
    lines.append(f"tuneloop_router_challenger_percent {challenger_percent}")

    family("tuneloop_router_arm_info", "gauge", "Model version each arm serves.")
    for arm, version in versions.items():
        lines.append(
            f'tuneloop_router_arm_info{{arm="{_label(arm)}",model_version="{_label(version)}"}} 1'
        )

    family("tuneloop_router_requests_total", "counter", "Requests routed to each arm.")
    for arm, s in stats.items():
        lines.append(f'tuneloop_router_requests_total{{arm="{_label(arm)}"}} {s.requests}')

    family(
        "tuneloop_router_errors_total",
        "counter",
        "Backend 5xx responses, connection errors and timeouts, per arm.",
    )
    for arm, s in stats.items():
        for kind, n in s.errors.items():
            lines.append(f'tuneloop_router_errors_total{{arm="{_label(arm)}",kind="{kind}"}} {n}')

    family(
        "tuneloop_router_badcases_total",
        "counter",
        "Responses flagged bad via /v1/feedback, attributed by a valid request id.",
    )
    for arm, s in stats.items():
        lines.append(f'tuneloop_router_badcases_total{{arm="{_label(arm)}"}} {s.badcases}')

    family(
        "tuneloop_router_badcase_users_total",
        "counter",
        "Distinct users with an attributed badcase (each user once per arm).",
    )
    for arm, s in stats.items():
        lines.append(
            f'tuneloop_router_badcase_users_total{{arm="{_label(arm)}"}} {s.badcase_users}'
        )

    family(
        "tuneloop_router_refused_total",
        "counter",
        "Requests refused before doing anything (401, 400, 413, 429, ...), per endpoint.",
    )
    for (endpoint, status), n in sorted(refused.items()):
        lines.append(
            f'tuneloop_router_refused_total{{endpoint="{_label(endpoint)}",status="{status}"}} {n}'
        )

    for name, attr, help_text in (
        ("tuneloop_router_latency_seconds", "latency", "Request latency through the router."),
        (
            "tuneloop_router_ttft_seconds",
            "ttft",
            "Time to the first streamed token (streaming requests only).",
        ),
    ):
        family(name, "summary", help_text + " Quantiles over a recent window.")
        for arm, s in stats.items():
            window: Window = getattr(s, attr)
            a = _label(arm)
            for q, v in window.quantiles().items():
                lines.append(f'{name}{{arm="{a}",quantile="{q}"}} {_num(v)}')
            lines.append(f'{name}_sum{{arm="{a}"}} {_num(window.total)}')
            lines.append(f'{name}_count{{arm="{a}"}} {window.count}')
    return "\n".join(lines) + "\n"
