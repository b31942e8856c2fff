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
- ``calibration``: per-GPU-model files (``calibrations/*.json``; the shipped ones are estimates)
- ``calibrate``: ``tuneloop calibrate``, measuring a new card (GPU only)
- ``classify``: window features and the per-GPU classifier
- ``heartbeat``: the training side: ``beat``, ``section``, per-rank files
- ``callback``: ``HeartbeatCallback`` for the Hugging Face Trainer
- ``watchdog``: the deadlock detector, the watchdog, offline ``replay``
- ``processes``: every process of a watched job, and ending them all
- ``actions``: stacks, MLflow, alerts
- ``accounting``: GPU-hours and energy per state
- ``watch``: ``tuneloop watch -- <command>``
- ``synth``: synthetic traces with ground truth
- ``plot``: the timeline PNG

This file imports nothing: import the module you use (``from tuneloop.telemetry.heartbeat
import beat``). A training script that only beats then loads two small modules, not
transformers or matplotlib, and the train stage's DVC deps list only the modules it imports,
so editing ``calibrate`` or ``synth`` does not make ``dvc repro`` retrain.
"""
