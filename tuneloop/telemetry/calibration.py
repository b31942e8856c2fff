"""Per-GPU-model calibration: what idle, compute, communication ... look like in watts.

A calibration file (JSON, ``calibrations/<model>.json`` in this package, or one
that ``tuneloop calibrate`` measured) holds:

- ``idle_w`` with and without a CUDA context, in watts (idle does not scale with
  an administrator's power cap), or ``idle_frac_of_cap`` for the generic file;
- ``bands_frac_of_cap``: the typical window-median power of each state as a
  fraction of the enforced power cap. The synthetic trace generator draws from
  these; the classifier seeds the job's compute level with the compute band;
- ``thresholds`` the classifier applies on the job's own dynamic range
  ``x = (power - idle_with_context) / (job compute level - idle_with_context)``:
  below ``stall_below`` a GPU is stalled (checkpoint-or-deadlock, or idle), at or
  above ``compute_above`` it computes, in between it communicates when its
  utilisation is at least ``busy_util`` % (kernels stay resident) and is starved
  of data otherwise.

Shipped files for H100, H200, B200 and B300 are estimates from public figures
and say so (``estimated: true`` and their ``source``): no shipped band has been
measured on a card, and the NVML sampling path (``sampler.NvmlSource``) has so
far run only against a stand-in for NVML, never on a GPU. Every report of
per-state figures says where its bands came from (``calibration_source``).
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from tuneloop.io import write_json
from tuneloop.telemetry.trace import STATES, State

log = logging.getLogger(__name__)

SCHEMA = 1
BUILTIN_MODELS = ("h100", "h200", "b200", "b300")
GENERIC = "generic"


class CalibrationError(ValueError):
    """A calibration file is wrong or missing; the message names the file and key."""


@dataclass(frozen=True)
class Calibration:
    gpu_model: str
    match: tuple[str, ...]  # regular expressions tried against the NVML device name
    tdp_w: float | None
    bands: Mapping[State, tuple[float, float]]  # fractions of the enforced power cap
    stall_below: float
    compute_above: float
    busy_util: float
    estimated: bool
    source: str
    idle_no_context_w: float | None = None
    idle_context_w: float | None = None
    idle_no_context_frac: float | None = None
    idle_context_frac: float | None = None

    def matches(self, device_name: str) -> bool:
        return any(re.search(pattern, device_name) for pattern in self.match)

    def cap_w(self, reported_cap_w: float | None) -> float:
        """The power cap to scale by: what NVML enforces, else the model's TDP."""
        if reported_cap_w:
            return reported_cap_w
        if self.tdp_w:
            return self.tdp_w
        raise CalibrationError(
            f"calibration {self.gpu_model!r}: NVML reported no power cap and the file has no "
            "tdp_w; add tdp_w to the file or calibrate the card"
        )

    def idle_w(self, cap_w: float, context: bool = True) -> float:
        watts = self.idle_context_w if context else self.idle_no_context_w
        if watts is not None:
            return watts
        frac = self.idle_context_frac if context else self.idle_no_context_frac
        if frac is None:  # excluded by parse(); kept for the type checker
            raise CalibrationError(f"calibration {self.gpu_model!r} has no idle figure")
        return frac * cap_w

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "schema": SCHEMA,
            "gpu_model": self.gpu_model,
            "match": list(self.match),
            "tdp_w": self.tdp_w,
            "bands_frac_of_cap": {state: list(self.bands[state]) for state in STATES},
            "thresholds": {
                "stall_below": self.stall_below,
                "compute_above": self.compute_above,
                "busy_util": self.busy_util,
            },
            "estimated": self.estimated,
            "source": self.source,
        }
        if self.idle_context_w is not None:
            data["idle_w"] = {"no_context": self.idle_no_context_w, "context": self.idle_context_w}
        else:
            data["idle_frac_of_cap"] = {
                "no_context": self.idle_no_context_frac,
                "context": self.idle_context_frac,
            }
        return data


_KEYS = {
    "schema",
    "gpu_model",
    "match",
    "tdp_w",
    "idle_w",
    "idle_frac_of_cap",
    "bands_frac_of_cap",
    "thresholds",
    "estimated",
    "source",
}


def parse(data: Mapping[str, Any], origin: str) -> Calibration:
    """Validate a calibration document; ``origin`` names it in errors."""

    def fail(key: str, what: str) -> CalibrationError:
        return CalibrationError(f"{origin}: {key}: {what}")

    unknown = set(data) - _KEYS
    if unknown:
        raise fail(", ".join(sorted(unknown)), f"unknown key(s); allowed: {sorted(_KEYS)}")
    if data.get("schema") != SCHEMA:
        raise fail("schema", f"must be {SCHEMA}")
    for key in ("gpu_model", "bands_frac_of_cap", "thresholds", "estimated", "source"):
        if key not in data:
            raise fail(key, "missing")
    if ("idle_w" in data) == ("idle_frac_of_cap" in data):
        raise fail("idle_w", "give exactly one of idle_w (watts) or idle_frac_of_cap")
    idle = data.get("idle_w") or data.get("idle_frac_of_cap") or {}
    idle_key = "idle_w" if "idle_w" in data else "idle_frac_of_cap"
    if set(idle) != {"no_context", "context"}:
        raise fail(idle_key, "needs exactly the keys no_context and context")
    bands_in = data["bands_frac_of_cap"]
    if set(bands_in) != set(STATES):
        raise fail("bands_frac_of_cap", f"needs exactly the states {list(STATES)}")
    bands: dict[State, tuple[float, float]] = {}
    for state in STATES:
        low, high = (float(v) for v in bands_in[state])
        if not 0.0 <= low <= high <= 1.05:
            raise fail(f"bands_frac_of_cap.{state}", f"[{low}, {high}] is not a range within 0..1")
        bands[state] = (low, high)
    thresholds = data["thresholds"]
    if set(thresholds) != {"stall_below", "compute_above", "busy_util"}:
        raise fail("thresholds", "needs exactly stall_below, compute_above, busy_util")
    stall, compute = float(thresholds["stall_below"]), float(thresholds["compute_above"])
    if not 0.0 < stall < compute < 1.0:
        raise fail("thresholds", f"need 0 < stall_below ({stall}) < compute_above ({compute}) < 1")
    busy = float(thresholds["busy_util"])
    if not 0.0 < busy < 100.0:
        raise fail("thresholds.busy_util", f"{busy} is not a percentage")
    tdp = data.get("tdp_w")
    in_watts = idle_key == "idle_w"
    return Calibration(
        gpu_model=str(data["gpu_model"]),
        match=tuple(str(p) for p in data.get("match", ())),
        tdp_w=float(tdp) if tdp is not None else None,
        bands=bands,
        stall_below=stall,
        compute_above=compute,
        busy_util=busy,
        estimated=bool(data["estimated"]),
        source=str(data["source"]),
        idle_no_context_w=float(idle["no_context"]) if in_watts else None,
        idle_context_w=float(idle["context"]) if in_watts else None,
        idle_no_context_frac=None if in_watts else float(idle["no_context"]),
        idle_context_frac=None if in_watts else float(idle["context"]),
    )


def load_calibration(path: Path) -> Calibration:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise CalibrationError(f"{path}: cannot read a calibration: {err}") from err
    return parse(data, str(path))


def save_calibration(path: Path, calibration: Calibration) -> None:
    write_json(path, calibration.to_json())


CalibrationSource = Literal["measured", "estimate", "none"]


def calibration_source(calibrations: Iterable[Calibration]) -> CalibrationSource:
    """Where the power bands in use came from, for every report of per-state figures.

    "measured": every GPU's file came from ``tuneloop calibrate``; "estimate": at least one
    did not (the shipped files); "none": no GPU was sampled (heartbeat only), so no bands.
    """
    chosen = list(calibrations)
    if not chosen:
        return "none"
    return "estimate" if any(c.estimated for c in chosen) else "measured"


@functools.cache
def builtin_calibration(name: str) -> Calibration:
    """A shipped file by name: one of ``BUILTIN_MODELS`` or ``generic``."""
    if name not in (*BUILTIN_MODELS, GENERIC):
        raise CalibrationError(
            f"no shipped calibration {name!r}; one of {(*BUILTIN_MODELS, GENERIC)}"
        )
    text = (resources.files("tuneloop.telemetry") / "calibrations" / f"{name}.json").read_text(
        encoding="utf-8"
    )
    return parse(json.loads(text), f"tuneloop/telemetry/calibrations/{name}.json")


def calibration_for(device_name: str, extra: Sequence[Calibration] = ()) -> Calibration:
    """The calibration whose ``match`` fits the device name: ``extra`` first, then shipped
    files, then the generic fallback."""
    for calibration in (*extra, *(builtin_calibration(m) for m in BUILTIN_MODELS)):
        if calibration.matches(device_name):
            return calibration
    log.info(
        "no calibration matches %r; using the generic one (run `tuneloop calibrate` on this card)",
        device_name,
    )
    return builtin_calibration(GENERIC)
