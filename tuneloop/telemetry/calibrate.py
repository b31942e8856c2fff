"""``tuneloop calibrate``: measure a GPU model's power states and write its calibration file.

GPU only: it refuses clearly without CUDA. On one card it runs known workloads
with torch while sampling NVML at 10 Hz, one after another:

=================  ======================================================
workload           what runs
=================  ======================================================
idle-no-context    nothing (measured before this process touches CUDA)
idle-context       a CUDA context holding one small tensor, then sleep
compute            a bf16 matmul burn (8192 x 8192)
communication      an NCCL all-reduce loop over every visible GPU; with a
                   single GPU, a device-to-device copy loop stands in
                   (bandwidth-bound, low arithmetic) and the file says so
data-starvation    short matmul bursts between sleeps, like a starved loader
checkpoint         a 4 GiB state dict copied to the host and saved, repeatedly
=================  ======================================================

``calibration_from_measurements`` turns the samples into bands and thresholds
(pure, so it is tested without a GPU); it refuses when the low band overlaps the
middle ones, because then power cannot tell a checkpoint from a slow job.
Run it on an otherwise idle card: other processes' draw lands in the figures.
``calibrate`` measures and returns the calibration; the command
(``tuneloop/cli/host.py``) writes it.

Not yet run on a GPU: the workloads and the NVML sampling have only been
exercised without one (the refusal, and a stand-in for NVML), so the first run on
a card should be checked against ``nvidia-smi``.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import re
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tuneloop.telemetry.calibration import Calibration, CalibrationError
from tuneloop.telemetry.sampler import NvmlSource, TelemetryUnavailable
from tuneloop.telemetry.trace import STATES, Sample, State

log = logging.getLogger(__name__)

WORKLOADS = (
    "idle-no-context",
    "idle-context",
    "compute",
    "communication",
    "data-starvation",
    "checkpoint",
)
WINDOW_S = 5.0
SAMPLE_HZ = 10.0
WARMUP_S = 3.0  # clocks and the power average settle before sampling starts


def _windows(samples: Sequence[Sample]) -> list[tuple[float, float]]:
    """(mean power, mean utilisation) of each full window of one workload's samples."""
    if not samples:
        return []
    t0 = min(s.t for s in samples)
    chunks: dict[int, list[Sample]] = {}
    for sample in samples:
        chunks.setdefault(int((sample.t - t0) // WINDOW_S), []).append(sample)
    chunks.pop(max(chunks))  # the last window is cut short by the end of the measurement
    result = []
    for _, part in sorted(chunks.items()):
        powers = [s.power_w for s in part if s.power_w is not None]
        utils = [s.gpu_util for s in part if s.gpu_util is not None]
        if powers and utils:
            result.append((statistics.fmean(powers), statistics.fmean(utils)))
    return result


def _spread(values: Sequence[float]) -> tuple[float, float]:
    """10th and 90th percentile."""
    if len(values) < 2:
        return values[0], values[0]
    deciles = statistics.quantiles(values, n=10)
    return deciles[0], deciles[-1]


def calibration_from_measurements(
    gpu_model: str,
    match: Sequence[str],
    cap_w: float,
    tdp_w: float | None,
    measurements: Mapping[str, Sequence[Sample]],
    source: str,
) -> Calibration:
    """Bands and thresholds from each workload's samples (keys: ``WORKLOADS``)."""
    missing = [w for w in WORKLOADS if len(_windows(measurements.get(w, ()))) < 2]
    if missing:
        raise CalibrationError(
            f"calibration needs at least two {WINDOW_S:.0f} s windows of {missing}"
        )
    windows = {w: _windows(measurements[w]) for w in WORKLOADS}
    power = {w: [p for p, _ in windows[w]] for w in WORKLOADS}
    util = {w: [u for _, u in windows[w]] for w in WORKLOADS}
    idle_no_context = statistics.median(power["idle-no-context"])
    idle_context = statistics.median(power["idle-context"])
    level = statistics.median(power["compute"])
    if level <= idle_context:
        raise CalibrationError(
            f"compute drew {level:.0f} W, no more than idle ({idle_context:.0f} W): "
            "is another process holding the card, or a power cap in force?"
        )

    def x(watts: float) -> float:
        return (watts - idle_context) / (level - idle_context)

    spread = {w: _spread(power[w]) for w in WORKLOADS}
    low_top = x(spread["checkpoint"][1])
    middle_bottom = x(min(spread["communication"][0], spread["data-starvation"][0]))
    middle_top = x(max(spread["communication"][1], spread["data-starvation"][1]))
    compute_bottom = x(spread["compute"][0])
    if low_top >= middle_bottom:
        raise CalibrationError(
            f"checkpoint power (up to {spread['checkpoint'][1]:.0f} W) overlaps communication/"
            "data-starvation; power cannot separate them on this card"
        )
    if middle_top >= compute_bottom:
        raise CalibrationError(
            f"communication/data-starvation power (up to x={middle_top:.2f}) overlaps compute "
            f"(from x={compute_bottom:.2f})"
        )
    starved_util = max(util["data-starvation"])
    comm_util = min(util["communication"])
    if starved_util >= comm_util:
        raise CalibrationError(
            f"data-starvation utilisation ({starved_util:.0f} %) reaches communication's "
            f"({comm_util:.0f} %); utilisation cannot separate them on this card"
        )
    state_of: dict[State, str] = {
        "compute": "compute",
        "communication": "communication",
        "data-starvation": "data-starvation",
        "checkpoint-or-deadlock": "checkpoint",
    }
    bands: dict[State, tuple[float, float]] = {
        state: (round(spread[w][0] / cap_w, 3), round(spread[w][1] / cap_w, 3))
        for state, w in state_of.items()
    }
    idle_all = power["idle-no-context"] + power["idle-context"]
    bands["idle"] = (round(min(idle_all) / cap_w, 3), round(max(idle_all) / cap_w, 3))
    return Calibration(
        gpu_model=gpu_model,
        match=tuple(match),
        tdp_w=tdp_w,
        bands={s: bands[s] for s in STATES},
        stall_below=round((low_top + middle_bottom) / 2, 3),
        compute_above=round((middle_top + compute_bottom) / 2, 3),
        busy_util=round((starved_util + comm_util) / 2, 1),
        estimated=False,
        source=source,
        idle_no_context_w=round(idle_no_context, 1),
        idle_context_w=round(idle_context, 1),
    )


# --- the GPU workloads ----------------------------------------------------------------


def _workloads(torch: Any, gpu: int, workdir: Path) -> dict[str, Callable[[threading.Event], None]]:
    device = torch.device("cuda", gpu)

    def idle_context(stop: threading.Event) -> None:
        torch.zeros(1, device=device)
        torch.cuda.synchronize(device)
        stop.wait()

    def compute(stop: threading.Event) -> None:
        a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
        out = torch.empty_like(a)
        while not stop.is_set():
            for _ in range(20):
                torch.matmul(a, a, out=out)
            torch.cuda.synchronize(device)

    def communication(stop: threading.Event) -> None:
        count = torch.cuda.device_count()
        if count >= 2:
            tensors = [torch.ones(64 * 2**20, device=torch.device("cuda", i)) for i in range(count)]
            while not stop.is_set():
                torch.cuda.nccl.all_reduce(tensors)
                for i in range(count):
                    torch.cuda.synchronize(i)
        else:
            src = torch.ones(256 * 2**20, device=device)
            dst = torch.empty_like(src)
            while not stop.is_set():
                for _ in range(10):
                    dst.copy_(src)
                torch.cuda.synchronize(device)

    def starved(stop: threading.Event) -> None:
        a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
        out = torch.empty_like(a)
        while not stop.is_set():
            burst_end = time.monotonic() + 0.2
            while time.monotonic() < burst_end:
                torch.matmul(a, a, out=out)
                torch.cuda.synchronize(device)
            time.sleep(0.4)  # the "loader" keeps the GPU waiting

    def checkpoint(stop: threading.Event) -> None:
        state = {f"w{i}": torch.randn(2**28, device=device) for i in range(4)}  # 4 GiB fp32
        target = workdir / "calibration-checkpoint.pt"
        while not stop.is_set():
            torch.save({k: v.to("cpu") for k, v in state.items()}, target)
        target.unlink(missing_ok=True)

    return {
        "idle-context": idle_context,
        "compute": compute,
        "communication": communication,
        "data-starvation": starved,
        "checkpoint": checkpoint,
    }


def _measure(
    source: NvmlSource, seconds: float, work: Callable[[threading.Event], None] | None
) -> list[Sample]:
    stop = threading.Event()
    failure: list[BaseException] = []

    def run() -> None:
        try:
            if work is not None:
                work(stop)
        except BaseException as err:  # re-raised in the measuring thread below
            failure.append(err)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    time.sleep(WARMUP_S)
    samples: list[Sample] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end and not failure:
        samples += source.read(time.monotonic())
        time.sleep(1.0 / SAMPLE_HZ)
    stop.set()
    thread.join()
    if failure:
        raise CalibrationError(f"calibration workload failed: {failure[0]}") from failure[0]
    return samples


def calibrate(gpu: int = 0, seconds: float = 30.0, workdir: Path | None = None) -> Calibration:
    """Measure GPU ``gpu`` (NVML index) under every workload; needs CUDA and NVML."""
    # NVML numbers GPUs in PCI order; make CUDA agree before it initialises.
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    import torch

    if not torch.cuda.is_available():
        raise CalibrationError(
            "calibrate measures a real GPU and needs CUDA: torch.cuda.is_available() is False "
            "here (no GPU, no driver, or a CPU-only torch). Run it on the GPU node."
        )
    try:
        source = NvmlSource.open([gpu])
    except TelemetryUnavailable as err:
        raise CalibrationError(f"calibrate needs NVML: {err}") from err
    device = source.devices()[0]
    if device.power_cap_w is None:
        raise CalibrationError(f"NVML reports no power cap for GPU {gpu} ({device.name})")
    measurements: dict[str, list[Sample]] = {}
    try:
        with tempfile.TemporaryDirectory(dir=workdir) as tmp:
            # Before any CUDA context exists in this process.
            log.info("measuring idle-no-context for %.0f s", seconds)
            measurements["idle-no-context"] = _measure(source, seconds, None)
            for name, work in _workloads(torch, gpu, Path(tmp)).items():
                log.info("measuring %s for %.0f s", name, seconds)
                measurements[name] = _measure(source, seconds, work)
    finally:
        source.close()
    count = torch.cuda.device_count()
    how = "NCCL all-reduce" if count >= 2 else "device-to-device copies (single GPU proxy)"
    date = dt.datetime.now(dt.UTC).date().isoformat()
    return calibration_from_measurements(
        gpu_model=_slug(device.name),
        match=[re.escape(device.name)],
        cap_w=device.power_cap_w,
        tdp_w=device.power_cap_w,
        measurements=measurements,
        source=(
            f"measured by tuneloop calibrate on {device.name} (GPU {gpu}, cap "
            f"{device.power_cap_w:.0f} W, power field {device.power_field}) on {date}, "
            f"{seconds:.0f} s per workload; communication measured with {how}"
        ),
    )


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
