"""GPU-hours and energy per state over a run.

Every classified window adds its length (per GPU) and its energy to its state:
the energy counter's delta where the card has one, median power times length
otherwise. Windows without power data count as "unknown".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tuneloop.telemetry.trace import STATES, State

UNKNOWN = "unknown"
_KEYS: tuple[str, ...] = (*STATES, UNKNOWN)


def _zeros() -> dict[str, float]:
    return dict.fromkeys(_KEYS, 0.0)


@dataclass
class Accounting:
    gpu_seconds: dict[str, float] = field(default_factory=_zeros)
    energy_j: dict[str, float] = field(default_factory=_zeros)

    def add(
        self,
        state: State | None,
        seconds: float,
        energy_j: float | None = None,
        power_w: float | None = None,
    ) -> None:
        key = state or UNKNOWN
        self.gpu_seconds[key] += seconds
        if energy_j is not None:
            self.energy_j[key] += energy_j
        elif power_w is not None:
            self.energy_j[key] += power_w * seconds

    def gpu_hours(self) -> dict[str, float]:
        return {k: v / 3600.0 for k, v in self.gpu_seconds.items()}

    def to_dict(self) -> dict[str, Any]:
        total = sum(self.gpu_seconds.values())
        return {
            "gpu_hours": {k: round(v, 6) for k, v in self.gpu_hours().items()},
            "share": {
                k: round(v / total, 4) if total else 0.0 for k, v in self.gpu_seconds.items()
            },
            "energy_kwh": {k: round(v / 3.6e6, 6) for k, v in self.energy_j.items()},
            "total_gpu_hours": round(total / 3600.0, 6),
        }

    def table(self) -> str:
        total = sum(self.gpu_seconds.values()) or 1.0
        lines = [f"{'state':<24}{'GPU-hours':>12}{'share':>8}{'kWh':>10}"]
        for key in _KEYS:
            seconds = self.gpu_seconds[key]
            lines.append(
                f"{key:<24}{seconds / 3600:>12.4f}{seconds / total:>8.1%}"
                f"{self.energy_j[key] / 3.6e6:>10.3f}"
            )
        return "\n".join(lines)
