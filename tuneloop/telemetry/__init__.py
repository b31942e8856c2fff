"""GPU telemetry and the power watchdog.

When a collective hangs, GPU utilisation can still read 100 % while board
power falls toward idle; PyTorch's NCCL timeout (10 min) and the Trainer's
``ddp_timeout`` (30 min) keep the job silent meanwhile. The watchdog samples
NVML, classifies each window as compute, communication, data-starvation,
checkpoint-or-deadlock or idle, and with the trainer's heartbeat tells a
checkpoint from a hang in tens of seconds.

Modules, one concern each:

- ``trace``: samples, the CSV trace format, ``TraceSource`` and ``ReplaySource``
- ``sampler``: ``NvmlSource`` (nvidia-ml-py) and the ring buffer
- ``calibration``: per-GPU-model files (``calibrations/*.json``)
- ``calibrate``: ``tuneloop calibrate``, measuring a new card (GPU only)
- ``classify``: window features and the per-GPU classifier
- ``heartbeat``: the training side: ``beat``, ``section``, per-rank files
- ``callback``: ``HeartbeatCallback`` for the Hugging Face Trainer
- ``watchdog``: the deadlock detector, the watchdog, offline ``replay``
- ``actions``: stacks, ending the job, MLflow, alerts
- ``accounting``: GPU-hours and energy per state
- ``watch``: ``tuneloop watch -- <command>``
- ``synth``: synthetic traces with ground truth
- ``plot``: the timeline PNG

The Trainer callback is not imported here, so that a training script that only
beats does not pay for importing transformers.
"""

from tuneloop.telemetry.calibrate import calibrate_main
from tuneloop.telemetry.calibration import Calibration, calibration_for, load_calibration
from tuneloop.telemetry.heartbeat import HEARTBEAT_ENV, Heartbeat, beat, section
from tuneloop.telemetry.sampler import NvmlSource, Sampler, TelemetryUnavailable
from tuneloop.telemetry.trace import (
    STATES,
    DeviceInfo,
    ReplaySource,
    Sample,
    State,
    Trace,
    TraceSource,
    read_trace,
    write_trace,
)
from tuneloop.telemetry.watch import WATCHDOG_EXIT_CODE, WatchOptions, watch, watch_main
from tuneloop.telemetry.watchdog import Alarm, WatchConfig, Watchdog, replay

__all__ = [
    "HEARTBEAT_ENV",
    "STATES",
    "WATCHDOG_EXIT_CODE",
    "Alarm",
    "Calibration",
    "DeviceInfo",
    "Heartbeat",
    "NvmlSource",
    "ReplaySource",
    "Sample",
    "Sampler",
    "State",
    "TelemetryUnavailable",
    "Trace",
    "TraceSource",
    "WatchConfig",
    "WatchOptions",
    "Watchdog",
    "beat",
    "calibrate_main",
    "calibration_for",
    "load_calibration",
    "read_trace",
    "replay",
    "section",
    "watch",
    "watch_main",
    "write_trace",
]
