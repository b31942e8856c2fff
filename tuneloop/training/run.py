"""The ``train`` stage's work on every rank: checkpoints, phases, MLflow, the output.

``stages/train.py`` is the entry point and says what the stage reads, writes and does; it
decides whether to watch, relaunch under torchrun, or call ``train`` here. Kept apart so
the process that only watches or relaunches never imports torch and transformers.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import EarlyStoppingCallback, TrainerCallback, TrainingArguments

from tuneloop.io import atomic_dir, write_json
from tuneloop.models import load_tokenizer
from tuneloop.params import Params
from tuneloop.stage import write_metrics
from tuneloop.telemetry.actions import AlertHook, send_alert
from tuneloop.telemetry.callback import HeartbeatCallback
from tuneloop.tracking import init_from, lineage, runs
from tuneloop.training import checkpoints, methods, preemption
from tuneloop.training.metrics import PhaseMetrics, TrainMetrics
from tuneloop.training.plan import Rank, TrainPlan
from tuneloop.training.stoploss import StepMeter, StopLossCallback, StopRules, TrainingStopped

STAGE = "train"
TAG_PHASE = "tuneloop.train.phase"  # on the nested run of a phase after the first
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PhaseResult:
    phase: str
    folder: Path
    """``<paths.checkpoints>/<phase>/final``: the phase's weights and tokenizer."""
    metrics: PhaseMetrics


def inputs(params: Params) -> dict[str, Path]:
    """The data the run reads: the fingerprint of its checkpoints and the manifest's inputs."""
    found = {"packed": params.paths.packed}
    if "dpo" in params.train.phases:
        found["dpo_pairs"] = params.paths.clean / "dpo.jsonl"
    return found


def phase_args(phase: str, params: Params, plan: TrainPlan) -> TrainingArguments:
    output_dir = checkpoints.phase_folder(params.paths.checkpoints, phase)
    if phase == "sft":
        return methods.sft_args(
            params, plan, output_dir, methods.val_set(params.paths.packed) is not None
        )
    return methods.dpo_args(params, plan, output_dir)


def sum_over_ranks(value: int, device: torch.device) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return value
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(tensor)
    return int(tensor.item())


def logged(history: list[dict[str, Any]], key: str) -> list[float]:
    return [float(entry[key]) for entry in history if key in entry]


def phase_metrics(
    trainer: Any, seconds: float, tokens: int, resumed_from: Path | None
) -> PhaseMetrics:
    state = trainer.state
    losses = logged(state.log_history, "loss")
    eval_losses = logged(state.log_history, "eval_loss")
    # The phase's result is the best checkpoint: its validation loss, not the last one.
    best = state.best_metric
    # DPO's own curves; an SFT phase logs neither.
    accuracies = logged(state.log_history, "rewards/accuracies")
    margins = logged(state.log_history, "rewards/margins")
    return PhaseMetrics(
        # The Trainer's own training_loss divides a resumed run's sum by all its steps.
        train_loss=round(statistics.fmean(losses), 6) if losses else None,
        first_logged_loss=losses[0] if losses else None,
        last_logged_loss=losses[-1] if losses else None,
        eval_loss=best if best is not None else (eval_losses[-1] if eval_losses else None),
        best_step=state.best_global_step,
        global_steps=state.global_step,
        max_steps=state.max_steps,
        epochs=round(float(state.epoch or 0.0), 4),
        stopped_early=state.global_step < state.max_steps,
        resumed_from_step=checkpoints.checkpoint_step(resumed_from) if resumed_from else None,
        seconds=round(seconds, 2),
        tokens=tokens,
        tokens_per_second=round(tokens / seconds, 1) if seconds > 0 else None,
        trainable_parameters=methods.trainable_parameters(trainer.model),
        rewards_accuracies=accuracies[-1] if accuracies else None,
        rewards_margins=margins[-1] if margins else None,
    )


@contextlib.contextmanager
def phase_mlflow_run(phase: str, params: Params, rank: Rank) -> Iterator[None]:
    """The first phase logs into the stage's run; a later one into a nested run of its own.

    The transformers callback logs every Trainer argument as a param, and MLflow refuses a
    param that changes value within a run: DPO's learning rate is not SFT's.
    """
    if not rank.is_main or phase == params.train.phases[0]:
        yield
        return
    import mlflow  # rank 0's alone, as every use of it here

    stage = lineage.dvc_stage(STAGE, params)  # train@support
    with mlflow.start_run(
        run_name=f"{stage}/{phase}",
        nested=True,
        tags={runs.TAG_STAGE: stage, TAG_PHASE: phase},
    ):
        yield


@dataclass(frozen=True)
class PhaseTrainer:
    trainer: Any
    meter: StepMeter
    stop: StopLossCallback
    save_on_request: preemption.SaveOnRequest | None


def build_trainer(
    phase: str,
    args: TrainingArguments,
    params: Params,
    plan: TrainPlan,
    previous: Path | None,
    rank: int,
    started_at: float,
) -> PhaseTrainer:
    """The phase's model and trainer, from the starting model or the previous phase's result."""
    base = init_from.model_ref(params)
    tokenizer = load_tokenizer(previous or base)
    if plan.uses_lora:
        model = methods.load_model(base, plan, adapter=previous)
    else:
        model = methods.load_model(previous or base, plan)
    peft_config = None
    if plan.uses_lora and previous is None:
        methods.check_target_modules(model, params)
        peft_config = methods.lora_config(params)

    meter = StepMeter()
    stop = StopLossCallback(StopRules.from_params(params.train, phase), meter, started_at)
    callbacks: list[TrainerCallback] = [
        HeartbeatCallback(),
        checkpoints.MarkCompleteCheckpoints(),
        stop,
    ]
    request = preemption.request_file()
    save_on_request = preemption.SaveOnRequest(request) if request is not None else None
    if save_on_request is not None:
        callbacks.insert(0, save_on_request)
    if phase == "dpo":
        trainer = methods.MeteredDPOTrainer(
            model=model,
            args=args,
            train_dataset=methods.dpo_pairs(params.paths.clean / "dpo.jsonl"),
            processing_class=tokenizer,
            peft_config=peft_config,
            callbacks=callbacks,
            meter=meter,
        )
        return PhaseTrainer(trainer, meter, stop, save_on_request)
    val = methods.val_set(params.paths.packed)
    patience = params.train.early_stopping_patience
    if val is not None and patience is not None:
        callbacks.append(EarlyStoppingCallback(early_stopping_patience=patience))
    sft = methods.PackedSFTTrainer(
        model=model,
        args=args,
        train_dataset=methods.rank_shard(params.paths.packed, rank),
        eval_dataset=val,
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=callbacks,
        meter=meter,
    )
    return PhaseTrainer(sft, meter, stop, save_on_request)


def run_phase(
    phase: str,
    args: TrainingArguments,
    params: Params,
    plan: TrainPlan,
    previous: Path | None,
    rank: Rank,
    started_at: float,
) -> PhaseResult:
    """Train one phase, resuming where a checkpoint allows; save its best weights."""
    phase_dir = checkpoints.phase_folder(params.paths.checkpoints, phase)
    built = build_trainer(phase, args, params, plan, previous, rank.rank, started_at)
    trainer, meter, stop = built.trainer, built.meter, built.stop

    resume_from = checkpoints.newest_complete(phase_dir) if params.train.resume == "auto" else None
    if resume_from is not None and rank.is_main:
        log.info("train: %s phase continues from %s", phase, resume_from)
    with phase_mlflow_run(phase, params, rank):
        started = time.perf_counter()
        trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
        seconds = time.perf_counter() - started
        tokens = sum_over_ranks(meter.tokens(), args.device)
        metrics = phase_metrics(trainer, seconds, tokens, resume_from)
        if stop.event is not None:  # inside the phase's run, which ends FAILED with it
            raise TrainingStopped(stop.event, phase, metrics.model_dump())
        if built.save_on_request is not None and built.save_on_request.step is not None:
            raise saved_on_request(phase, phase_dir, built.save_on_request.step)
        if rank.is_main and phase != params.train.phases[0]:
            runs.log_metrics(metrics.model_dump())

    final = phase_dir / checkpoints.FINAL
    methods.drop_reference_adapter(trainer.model)
    # The Trainer sets the model's use_cache to TrainingArguments.use_cache (False) for training;
    # saved so, a full fine-tune generated without its KV cache in `transformers serve` and in
    # every user's `generate`. What is saved is for inference.
    trainer.model.config.use_cache = True
    trainer.save_model(str(final))  # every rank: ZeRO-3 and FSDP gather the weights for it
    checkpoints.barrier()
    if rank.is_main:
        checkpoints.mark_complete(final, {"phase": phase, "metrics": metrics.model_dump()})
    checkpoints.barrier()
    del trainer, built
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return PhaseResult(phase, final, metrics)


def saved_on_request(phase: str, phase_dir: Path, step: int) -> preemption.SaveRequested:
    """The save the scheduler asked for; an error (the rank exits non-zero) when it is not
    complete, so the batch script still requeues and the next run resumes from an older one."""
    folder = checkpoints.checkpoint_dir(phase_dir, step)
    if not checkpoints.is_complete(folder):
        raise RuntimeError(
            f"train: asked to save before the job's end, but {folder} is not complete; "
            "the next run resumes from the newest complete checkpoint"
        )
    return preemption.SaveRequested(phase, step, folder)


def run_phases(
    params: Params, plan: TrainPlan, first_args: TrainingArguments, rank: Rank, started_at: float
) -> list[PhaseResult]:
    results: list[PhaseResult] = []
    previous: Path | None = None
    for phase in plan.phases:
        final = checkpoints.phase_folder(params.paths.checkpoints, phase) / checkpoints.FINAL
        if checkpoints.is_complete(final):
            log.info("train: %s phase finished in an earlier run; continuing from %s", phase, final)
            done = PhaseMetrics.model_validate(checkpoints.read_marker(final)["metrics"])
            result = PhaseResult(phase, final, done)
        else:
            args = first_args if phase == plan.phases[0] else phase_args(phase, params, plan)
            result = run_phase(phase, args, params, plan, previous, rank, started_at)
        results.append(result)
        previous = result.folder
    return results


def stage_metrics(
    params: Params, plan: TrainPlan, results: list[PhaseResult], wall_seconds: float
) -> TrainMetrics:
    """metrics/train.json: the first phase on top (what the flow reads), every phase below."""
    first = results[0].metrics
    seconds = sum(r.metrics.seconds for r in results)
    tokens = sum(r.metrics.tokens for r in results)
    gpus = plan.world_size if plan.cuda else 0
    return TrainMetrics(
        method=params.train.method,
        phases={r.phase: r.metrics for r in results},
        train_loss=first.train_loss,
        first_logged_loss=first.first_logged_loss,
        last_logged_loss=first.last_logged_loss,
        eval_loss=first.eval_loss,
        global_steps=first.global_steps,
        epochs=first.epochs,
        seconds=round(seconds, 2),
        tokens_per_second=round(tokens / seconds, 1) if seconds > 0 else None,
        gpu_hours=round(gpus * wall_seconds / 3600, 6),
        trainable_parameters=results[-1].metrics.trainable_parameters,
        lora_alpha=params.train.resolved_lora_alpha if plan.uses_lora else None,
        gradient_accumulation_steps=params.batch.gradient_accumulation_steps,
        world_size=plan.world_size,
    )


def continue_mlflow_run(prep: checkpoints.Preparation, params_hash: str, experiment: str) -> None:
    """Log a resumed run into the MLflow run that a kill cut off, so its curve continues there.

    Only when nothing else chose the run (a flow passes MLFLOW_RUN_ID) and the params are the
    same (MLflow refuses a param that changes value within a run).
    """
    previous = prep.previous
    if not prep.resumed or previous is None or previous.mlflow_run_id is None:
        return
    if "MLFLOW_RUN_ID" in os.environ or previous.params_hash != params_hash:
        return
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    runs.setup(experiment)
    try:
        status = MlflowClient().get_run(previous.mlflow_run_id).info.status
    except MlflowException:
        return
    if status == "RUNNING":
        log.info("train: logging into the interrupted MLflow run %s", previous.mlflow_run_id)
        os.environ["MLFLOW_RUN_ID"] = previous.mlflow_run_id


def name_continued_run(prep: checkpoints.Preparation | None, run_id: str) -> None:
    """Tag a run that resumed another run's checkpoints with that run's id."""
    previous = prep.previous if prep is not None and prep.resumed else None
    if previous is not None and previous.mlflow_run_id not in (None, run_id):
        import mlflow

        mlflow.set_tag(runs.TAG_RESUMES, previous.mlflow_run_id)


def report_stop(
    params: Params, plan: TrainPlan, stopped: TrainingStopped, wall_seconds: float
) -> None:
    """Rank 0: tag the MLflow run with the rule and reason, log the numbers, call the alert hook.

    The run then ends FAILED as the stage exits with the stop's message.
    """
    import mlflow

    event = stopped.event
    run = mlflow.active_run()
    mlflow.set_tags({runs.TAG_STOP_RULE: event.rule, runs.TAG_STOP_REASON: str(stopped)[:5000]})
    gpus = plan.world_size if plan.cuda else 0
    runs.log_metrics(
        {
            **stopped.metrics,
            "stop_step": event.step,
            "gpu_hours": round(gpus * wall_seconds / 3600, 6),
        }
    )
    hook = AlertHook(webhook_url=params.train.alert_webhook, command=params.train.alert_command)
    if not hook.configured:
        return
    payload = {
        "stage": STAGE,
        "reason": str(stopped),
        "rule": event.rule,
        "phase": stopped.phase,
        "step": event.step,
        "mlflow_run_id": run.info.run_id if run else None,
    }
    try:
        send_alert(hook, payload)
    except Exception:  # the stop is the news; a failed alert must not hide it
        log.exception("train: the alert hook failed")


def write_output(
    params: Params, plan: TrainPlan, results: list[PhaseResult], metrics: TrainMetrics
) -> None:
    with atomic_dir(params.paths.adapter) as out:
        checkpoints.link_tree(results[-1].folder, out)
        write_json(
            out / "manifest.json",
            lineage.manifest(
                STAGE,
                params,
                inputs=inputs(params),
                base=params.model.base,
                artifact="adapter" if plan.uses_lora else "model",
                plan=plan.describe(),
                **metrics.model_dump(),
            ),
        )


def train(params: Params, plan: TrainPlan, started_at: float) -> None:
    """Every rank: set up checkpoints, run the phases; rank 0 logs and writes the output."""
    rank = Rank.from_env()
    # The first TrainingArguments starts the process group (gloo, NCCL or DeepSpeed's) that
    # the checkpoint set-up below waits on.
    first_args = phase_args(plan.phases[0], params, plan)
    groups = lineage.stage_param_groups(lineage.dvc_stage(STAGE, params))
    params_hash = lineage.params_hash(params, groups)
    record = checkpoints.RunRecord(checkpoints.fingerprint(params, inputs(params)), params_hash)
    with first_args.main_process_first(local=False, desc="checkpoint set-up"):
        prep = (
            checkpoints.prepare(params.paths.checkpoints, record, params.train.resume == "auto")
            if rank.is_main
            else None
        )
    if prep is not None:
        log.info("train: %s", prep.detail)
        continue_mlflow_run(prep, params_hash, params.tracking.experiment)

    run_context = runs.stage_run(STAGE, params) if rank.is_main else contextlib.nullcontext()
    with run_context as run:
        if run is not None:
            import mlflow

            name_continued_run(prep, run.info.run_id)
            checkpoints.write_record(
                params.paths.checkpoints,
                checkpoints.RunRecord(record.fingerprint, params_hash, run.info.run_id),
            )
            mlflow.log_params({f"plan.{key}": str(value) for key, value in plan.describe().items()})
            mlflow.set_tag(init_from.TAG, init_from.recorded(params).describe())
            for config in (plan.deepspeed_config, plan.fsdp_config):
                if config is not None:  # not a DVC dep: it changes speed and memory, not the result
                    mlflow.log_artifact(str(config), "configs")
        if rank.is_main:
            log.info("train: %s", plan.describe())
        try:
            results = run_phases(params, plan, first_args, rank, started_at)
        except TrainingStopped as stopped:
            if rank.is_main:
                report_stop(params, plan, stopped, time.time() - started_at)
            raise SystemExit(f"train: {stopped}") from None
        except preemption.SaveRequested as saved:
            request = preemption.request_file()
            if rank.is_main and request is not None:
                import mlflow

                preemption.report_saved(request, saved)
                # Not FAILED: the requeued job logs into this run again (MLFLOW_RUN_ID).
                mlflow.end_run("KILLED")
            raise SystemExit(0) from None
        if rank.is_main:
            metrics = stage_metrics(params, plan, results, time.time() - started_at)
            write_output(params, plan, results, metrics)
            write_metrics(params, STAGE, metrics.model_dump())
            log.info("train: %s", metrics.model_dump_json(exclude={"phases"}))
    checkpoints.barrier()  # no rank exits (and tears down the group) while rank 0 still writes
