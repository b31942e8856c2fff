"""Save a checkpoint and stop when the scheduler is about to end the job (its time limit).

The job's batch script asks by creating the file that ``$TUNELOOP_SAVE_REQUEST`` names, on
storage every node shares, when Slurm's signal before the time limit reaches it. A file and
not the signal itself: srun would pass USR1 on to each node's ``tuneloop watch`` and torchrun,
and neither hands it to the ranks (USR1's default action ends a process; torchrun handles
only TERM, INT, HUP and QUIT, and ends its workers on those).

Every rank looks for the file after each optimizer step and the ranks take the max over
ranks, so all of them save the same step and stop together (a rank that stopped alone would
leave the others waiting in a collective). Rank 0 then writes ``<file>.saved`` naming the
checkpoint: the batch script requeues the job on it, and the next run resumes from that
checkpoint (``train.resume: auto``).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from tuneloop.cluster.job import SAVE_REQUEST_ENV, SAVED_SUFFIX
from tuneloop.io import write_json
from tuneloop.training.stoploss import max_over_ranks

log = logging.getLogger(__name__)


class SaveRequested(Exception):
    """The ranks saved ``checkpoint`` at the scheduler's request and stopped training."""

    def __init__(self, phase: str, step: int, checkpoint: Path) -> None:
        super().__init__(
            f"{phase} phase saved {checkpoint} at step {step} before the job's end; "
            "the requeued job resumes from it"
        )
        self.phase, self.step, self.checkpoint = phase, step, checkpoint


def request_file() -> Path | None:
    """The file whose appearance asks for a save; None when no scheduler set one."""
    named = os.environ.get(SAVE_REQUEST_ENV)
    return Path(named) if named else None


class SaveOnRequest(TrainerCallback):
    """Turns the request into a save and a stop at the next optimizer step, on every rank.

    Listed before the heartbeat callback, so the watchdog sees the save as a checkpoint.
    """

    def __init__(self, request: Path) -> None:
        self.request = request
        self.step: int | None = None

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.step is not None:
            return
        (asked,) = max_over_ranks([1.0 if self.request.exists() else 0.0], args.device)
        if not asked:
            return
        self.step = state.global_step
        control.should_save = True
        control.should_training_stop = True
        if state.is_world_process_zero:
            log.warning("train: the job ends soon; saving step %d and stopping", self.step)


def report_saved(request: Path, saved: SaveRequested) -> None:
    """Rank 0, once the checkpoint is complete: tell the batch script it may requeue."""
    write_json(
        request.with_name(request.name + SAVED_SUFFIX),
        {"phase": saved.phase, "step": saved.step, "checkpoint": str(saved.checkpoint)},
    )
    log.warning("train: %s", saved)
