"""Stop-loss: rules that end a training run cleanly before it wastes more GPU hours.

- ``max_wall_hours``: the stage has run this long (a budget; a checkpoint is saved first, so
  raising the limit and running the stage again continues the run);
- ``max_host_memory_gb``: a process's resident memory went over it (checkpoint saved first);
- ``max_gpu_memory_gb``: CUDA max allocated on a GPU went over it (checkpoint saved first);
- ``loss_spike_factor``: an SFT step's loss exceeded ``factor`` times the median of the last
  ``loss_spike_window`` steps, or was not finite. No checkpoint of the spiked weights is
  saved; the last regular one stays the newest, and the step is named so the data can be
  looked at. (DPO's loss falls toward zero, where a ratio to its median means nothing, so
  the rule watches SFT only.)

Every rank must stop at the same step or the others wait in a collective forever, so the
callback reduces its inputs (max over ranks) once per optimizer step and every rank takes the
same decision from the same numbers. With one process and no rule set it does nothing.

The callback only stops the Trainer and records a ``StopEvent``; the stage marks the MLflow run,
alerts and exits non-zero (``TrainingStopped``).
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psutil
import torch
import torch.distributed as dist
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from tuneloop.params import TrainParams

log = logging.getLogger(__name__)

GB = 1024**3


@dataclass(frozen=True)
class StopRules:
    max_wall_seconds: float | None = None
    max_host_memory_bytes: float | None = None
    max_gpu_memory_bytes: float | None = None
    spike_factor: float | None = None
    spike_window: int = 20

    @classmethod
    def from_params(cls, train: TrainParams, phase: str) -> StopRules:
        def gib(value: float | None) -> float | None:
            return value * GB if value is not None else None

        return cls(
            max_wall_seconds=train.max_wall_hours * 3600 if train.max_wall_hours else None,
            max_host_memory_bytes=gib(train.max_host_memory_gb),
            max_gpu_memory_bytes=gib(train.max_gpu_memory_gb),
            spike_factor=train.loss_spike_factor if phase == "sft" else None,
            spike_window=train.loss_spike_window,
        )

    @property
    def any(self) -> bool:
        return any(
            value is not None
            for value in (
                self.max_wall_seconds,
                self.max_host_memory_bytes,
                self.max_gpu_memory_bytes,
                self.spike_factor,
            )
        )


@dataclass(frozen=True)
class StopEvent:
    rule: str
    """The key of the rule that fired: max_wall_hours, max_host_memory_gb, ... loss_spike_factor."""
    step: int
    detail: str

    def message(self, phase: str) -> str:
        return f"{phase} phase stopped at step {self.step} by train.{self.rule}: {self.detail}"


class TrainingStopped(RuntimeError):
    """A stop-loss rule ended the run; ``metrics`` are the phase's numbers up to the stop."""

    def __init__(self, event: StopEvent, phase: str, metrics: dict[str, Any]) -> None:
        super().__init__(event.message(phase))
        self.event = event
        self.phase = phase
        self.metrics = metrics


def is_loss_spike(history: Sequence[float], loss: float, factor: float, window: int) -> bool:
    """True when ``loss`` is not finite, or over ``factor`` x the median of the last ``window``.

    The rule waits for a full window: the first steps from a fresh start fall steeply and
    their median says little.
    """
    if not math.isfinite(loss):
        return True
    recent = list(history)[-window:]
    if len(recent) < window:
        return False
    return loss > factor * statistics.median(recent)


class StepMeter:
    """What the trainer saw in the current optimizer step and in the whole run.

    The trainer adds each micro-batch's loss (already divided by the accumulation steps, so a
    step's sum is its mean loss) and token count as tensors, so no micro-batch waits for the
    device; the callback reads the step's loss once per optimizer step.
    """

    def __init__(self) -> None:
        self._step_loss: torch.Tensor | None = None
        self._tokens: torch.Tensor | int = 0

    def add(self, loss: torch.Tensor, tokens: torch.Tensor | int) -> None:
        loss = loss.detach()
        self._step_loss = loss if self._step_loss is None else self._step_loss + loss
        self._tokens = self._tokens + tokens

    def pop_step_loss(self) -> torch.Tensor | None:
        loss, self._step_loss = self._step_loss, None
        return loss

    def tokens(self) -> int:
        return int(self._tokens)


def host_rss_bytes() -> int:
    return int(psutil.Process().memory_info().rss)


def gpu_max_allocated_bytes() -> int:
    return int(torch.cuda.max_memory_allocated()) if torch.cuda.is_available() else 0


def max_over_ranks(values: list[float], device: torch.device) -> list[float]:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return values
    # float64 holds byte counts exactly; gloo wants a CPU tensor, NCCL a CUDA one: args.device.
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return [float(v) for v in tensor.tolist()]


class StopLossCallback(TrainerCallback):
    def __init__(self, rules: StopRules, meter: StepMeter, started_at: float) -> None:
        self.rules = rules
        self.meter = meter
        self.started_at = started_at
        self.history: deque[float] = deque(maxlen=rules.spike_window)
        self.event: StopEvent | None = None

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        step_loss = self.meter.pop_step_loss()
        if not self.rules.any:
            return
        rules = self.rules
        watch_loss = rules.spike_factor is not None and step_loss is not None
        loss = 0.0
        if rules.spike_factor is not None and step_loss is not None:
            loss = float(step_loss)  # the one device sync per step, only with the rule on
            # NaN would vanish in a max over ranks; inf survives it and still counts as a spike.
            loss = loss if math.isfinite(loss) else math.inf
        wall = time.time() - self.started_at
        host = float(host_rss_bytes()) if rules.max_host_memory_bytes is not None else 0.0
        gpu = float(gpu_max_allocated_bytes()) if rules.max_gpu_memory_bytes is not None else 0.0
        loss, wall, host, gpu = max_over_ranks([loss, wall, host, gpu], args.device)
        event = self._decide(state.global_step, loss if watch_loss else None, wall, host, gpu)
        if event is None:
            if watch_loss:
                self.history.append(loss)
            return
        self.event = event
        control.should_training_stop = True
        # A budget or memory stop keeps its progress (resume continues from it); a spike's
        # weights are suspect, so the last regular checkpoint stays the newest.
        control.should_save = event.rule != "loss_spike_factor"
        if event.rule == "loss_spike_factor":
            control.should_evaluate = False
        log.error("stop-loss: %s", event.detail)

    def _decide(
        self, step: int, loss: float | None, wall: float, host: float, gpu: float
    ) -> StopEvent | None:
        rules = self.rules
        if (
            loss is not None
            and rules.spike_factor is not None
            and is_loss_spike(self.history, loss, rules.spike_factor, rules.spike_window)
        ):
            median = statistics.median(self.history) if self.history else math.nan
            return StopEvent(
                "loss_spike_factor",
                step,
                f"step loss {loss:.4g} is over {rules.spike_factor:g} x the median "
                f"{median:.4g} of the last {len(self.history)} steps; look at the data of "
                f"step {step} (a bad batch?) or lower the learning rate",
            )
        if rules.max_wall_seconds is not None and wall > rules.max_wall_seconds:
            return StopEvent(
                "max_wall_hours",
                step,
                f"the stage has run {wall / 3600:.3g} h, over the "
                f"{rules.max_wall_seconds / 3600:g} h budget; a checkpoint was saved, so raising "
                "the limit and running the stage "
                "again continues from it",
            )
        if rules.max_host_memory_bytes is not None and host > rules.max_host_memory_bytes:
            return StopEvent(
                "max_host_memory_gb",
                step,
                f"a training process holds {host / GB:.3g} GiB resident, over the "
                f"{rules.max_host_memory_bytes / GB:g} GiB ceiling",
            )
        if rules.max_gpu_memory_bytes is not None and gpu > rules.max_gpu_memory_bytes:
            return StopEvent(
                "max_gpu_memory_gb",
                step,
                f"a GPU reached {gpu / GB:.3g} GiB allocated, over the "
                f"{rules.max_gpu_memory_bytes / GB:g} GiB ceiling",
            )
        return None
