"""``HeartbeatCallback``: the Hugging Face Trainer's steps and pauses, for the watchdog.

Kept apart from ``heartbeat.py`` so that a plain torch script can beat without
importing transformers.

The Trainer calls ``on_step_end`` before it evaluates and saves, and
``DefaultFlowCallback`` (always first in the list) has by then decided whether
this step evaluates or saves; so the section opens there, and ``on_evaluate``
and ``on_save`` close it. Evaluation comes before the save in the Trainer, so a
step that does both goes "eval" then "checkpoint". The next step's start closes
whatever is still open (a save the "best model" rule cancelled).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from tuneloop.telemetry.heartbeat import Heartbeat


class HeartbeatCallback(TrainerCallback):
    """Writes the step heartbeat and checkpoint/eval sections that ``tuneloop watch`` reads.

    ``path`` defaults to ``$TUNELOOP_HEARTBEAT``; without either the callback does nothing.
    """

    def __init__(self, path: Path | str | None = None, heartbeat: Heartbeat | None = None) -> None:
        self.heartbeat = heartbeat if heartbeat is not None else Heartbeat(path)

    def _pending_section(self, control: TrainerControl) -> None:
        if control.should_evaluate:
            self.heartbeat.enter_section("eval")
        elif control.should_save:
            self.heartbeat.enter_section("checkpoint")

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        # The run the job logs into, for a watcher that was not told it. Only when the job
        # already uses MLflow: importing it here would cost every other job a second.
        mlflow = sys.modules.get("mlflow")
        if mlflow is not None and state.is_world_process_zero and (run := mlflow.active_run()):
            self.heartbeat.set_run_id(run.info.run_id)

    def on_epoch_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        # Data-loader workers restart here and the first batch can take a while; the
        # section closes when the first step starts, with its batch in hand.
        self.heartbeat.enter_section("epoch-start")

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.heartbeat.exit_section()

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.heartbeat.exit_section()
        self.heartbeat.beat(state.global_step)
        self._pending_section(control)

    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._pending_section(control)

    def on_evaluate(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if control.should_save:
            self.heartbeat.enter_section("checkpoint")
        else:
            self.heartbeat.exit_section()

    def on_prediction_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        # trainer.evaluate()/predict() called outside training have no start hook.
        if self.heartbeat.section_name is None:
            self.heartbeat.enter_section("eval")

    def on_predict(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        metrics: Any,
        **kwargs: Any,
    ) -> None:
        self.heartbeat.exit_section()

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.heartbeat.exit_section()

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        # What follows (final save, merge, push) has no steps; the section's maximum still
        # catches a hang in it, e.g. a ZeRO-3 gather for the final save.
        self.heartbeat.enter_section("after-train")
