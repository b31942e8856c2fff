"""Sampling GPUs through NVML (nvidia-ml-py), and the ring buffer of recent samples.

Per GPU and tick: power, the total energy counter, utilisation (kernel and
memory), memory in use, SM and memory clocks. Power comes from the
instantaneous field (``nvmlDeviceGetFieldValues`` with
``NVML_FI_DEV_POWER_INSTANT``) where the driver has it, else from
``nvmlDeviceGetPowerUsage``, which is a one-second average on recent cards;
``DeviceInfo.power_field`` records which.

Without NVML (no driver, no GPU: ``nvmlInit`` raises ``NVMLError``) opening the
source raises ``TelemetryUnavailable`` and the watchdog runs on the heartbeat
alone.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pynvml

from tuneloop.telemetry.trace import (
    DeviceInfo,
    PowerField,
    ReplaySource,
    Sample,
    TraceSource,
    read_trace,
)

log = logging.getLogger(__name__)

MIN_HZ, MAX_HZ = 1.0, 10.0


class TelemetryUnavailable(RuntimeError):
    """No GPU telemetry here (no NVML library, no driver or no device)."""


def _text(value: str | bytes) -> str:
    # nvidia-ml-py returns str; older pynvml builds returned bytes.
    return value.decode() if isinstance(value, bytes) else value


class NvmlSource:
    """Live readings from NVML. ``nvml`` is the pynvml module; tests pass a stand-in."""

    def __init__(self, nvml: Any, gpus: Sequence[int] | None = None) -> None:
        self._nvml = nvml
        count = nvml.nvmlDeviceGetCount()
        indices = list(range(count)) if gpus is None else list(gpus)
        missing = [i for i in indices if not 0 <= i < count]
        if missing:
            raise TelemetryUnavailable(f"GPU index(es) {missing} not present; NVML sees {count}")
        if not indices:
            raise TelemetryUnavailable("NVML sees no GPU")
        self._handles = {i: nvml.nvmlDeviceGetHandleByIndex(i) for i in indices}
        self._instant = {i: self._has_instant_power(h) for i, h in self._handles.items()}
        self._warned: set[tuple[int, str]] = set()
        self._devices = [self._describe(i, h) for i, h in self._handles.items()]

    @classmethod
    def open(cls, gpus: Sequence[int] | None = None, nvml: Any = None) -> NvmlSource:
        nvml = pynvml if nvml is None else nvml
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as err:
            raise TelemetryUnavailable(f"NVML is not available: {err}") from err
        try:
            return cls(nvml, gpus)
        except BaseException:
            nvml.nvmlShutdown()
            raise

    def _has_instant_power(self, handle: Any) -> bool:
        return self._instant_power_w(handle) is not None

    def _instant_power_w(self, handle: Any) -> float | None:
        nvml = self._nvml
        try:
            (field,) = nvml.nvmlDeviceGetFieldValues(handle, [nvml.NVML_FI_DEV_POWER_INSTANT])
        except nvml.NVMLError:
            return None
        if field.nvmlReturn != nvml.NVML_SUCCESS:
            return None
        kinds = {
            nvml.NVML_VALUE_TYPE_DOUBLE: "dVal",
            nvml.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
            nvml.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal",
            nvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal",
            nvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal",
            nvml.NVML_VALUE_TYPE_SIGNED_INT: "siVal",
        }
        member = kinds.get(field.valueType)
        if member is None:
            return None
        return float(getattr(field.value, member)) / 1000.0  # milliwatts

    def _try(self, gpu: int, what: str, read: Any, *args: Any) -> Any:
        """One NVML reading, or None when the card cannot give it (logged once per kind)."""
        try:
            return read(*args)
        except self._nvml.NVMLError as err:
            if (gpu, what) not in self._warned:
                self._warned.add((gpu, what))
                log.warning(
                    "GPU %d: cannot read %s through NVML (%s); recording blanks", gpu, what, err
                )
            return None

    def _describe(self, index: int, handle: Any) -> DeviceInfo:
        nvml = self._nvml
        name = _text(nvml.nvmlDeviceGetName(handle))
        cap_mw = self._try(index, "power cap", nvml.nvmlDeviceGetEnforcedPowerLimit, handle)
        memory = self._try(index, "memory", nvml.nvmlDeviceGetMemoryInfo, handle)
        power_field: PowerField = "instant" if self._instant[index] else "average"
        return DeviceInfo(
            index=index,
            name=name,
            power_cap_w=cap_mw / 1000.0 if cap_mw else None,
            memory_total_mib=memory.total / 2**20 if memory is not None else None,
            power_field=power_field,
        )

    def devices(self) -> Sequence[DeviceInfo]:
        return self._devices

    def read(self, now: float) -> list[Sample]:
        nvml = self._nvml
        samples = []
        for gpu, handle in self._handles.items():
            power = self._instant_power_w(handle) if self._instant[gpu] else None
            if power is None:
                milliwatts = self._try(gpu, "power", nvml.nvmlDeviceGetPowerUsage, handle)
                power = milliwatts / 1000.0 if milliwatts is not None else None
            energy_mj = self._try(
                gpu, "energy counter", nvml.nvmlDeviceGetTotalEnergyConsumption, handle
            )
            rates = self._try(gpu, "utilisation", nvml.nvmlDeviceGetUtilizationRates, handle)
            memory = self._try(gpu, "memory", nvml.nvmlDeviceGetMemoryInfo, handle)
            sm_clock = self._try(
                gpu, "SM clock", nvml.nvmlDeviceGetClockInfo, handle, nvml.NVML_CLOCK_SM
            )
            mem_clock = self._try(
                gpu, "memory clock", nvml.nvmlDeviceGetClockInfo, handle, nvml.NVML_CLOCK_MEM
            )
            samples.append(
                Sample(
                    t=now,
                    gpu=gpu,
                    power_w=power,
                    energy_j=energy_mj / 1000.0 if energy_mj is not None else None,
                    gpu_util=float(rates.gpu) if rates is not None else None,
                    mem_util=float(rates.memory) if rates is not None else None,
                    mem_used_mib=memory.used / 2**20 if memory is not None else None,
                    sm_clock_mhz=float(sm_clock) if sm_clock is not None else None,
                    mem_clock_mhz=float(mem_clock) if mem_clock is not None else None,
                )
            )
        return samples

    def close(self) -> None:
        self._nvml.nvmlShutdown()


def open_source(
    replay: Path | None = None,
    heartbeat_only: bool = False,
    gpus: Sequence[int] | None = None,
) -> TraceSource | None:
    """The source ``tuneloop watch`` samples: a replayed trace, NVML, or None (heartbeat only)."""
    if heartbeat_only:
        return None
    if replay is not None:
        return ReplaySource(read_trace(replay))
    try:
        return NvmlSource.open(gpus)
    except TelemetryUnavailable as err:
        log.warning("%s; the watchdog runs on the heartbeat alone", err)
        return None


class Sampler:
    """Reads a source at each tick and keeps the last ``buffer_s`` seconds in a ring buffer."""

    def __init__(self, source: TraceSource | None, hz: float, buffer_s: float = 900.0) -> None:
        if not MIN_HZ <= hz <= MAX_HZ:
            raise ValueError(f"sample rate hz={hz} is outside {MIN_HZ}..{MAX_HZ}")
        self.source = source
        self.hz = hz
        devices = len(source.devices()) if source is not None else 0
        self.ring: deque[Sample] = deque(maxlen=max(1, int(buffer_s * hz) * max(devices, 1)))

    @property
    def available(self) -> bool:
        return self.source is not None

    def devices(self) -> Sequence[DeviceInfo]:
        return self.source.devices() if self.source is not None else ()

    def poll(self, now: float) -> list[Sample]:
        if self.source is None:
            return []
        samples = self.source.read(now)
        self.ring.extend(samples)
        return samples

    def recent(self, since: float) -> list[Sample]:
        return [s for s in self.ring if s.t >= since]

    def close(self) -> None:
        if self.source is not None:
            self.source.close()
