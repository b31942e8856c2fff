"""Stage ``train``: SFT and DPO with TRL, as a LoRA/QLoRA adapter (peft) or on every weight.

Reads:  ``paths.packed``: this rank's ``rank-NNNNN.parquet`` and ``val.parquet``;
        ``paths.clean``/dpo.jsonl when ``train.phases`` holds dpo; the base model.
Writes: ``paths.adapter``: the adapter (lora, qlora) or the whole model (full), with the
        tokenizer and manifest.json (``artifact`` says which); ``metrics/train.json``;
        checkpoints under ``paths.checkpoints``, the watchdog's evidence under ``paths.watch``
        (both outside DVC's outs).
Params: ``train``, ``batch``, ``pack.seq_len``, ``model.base``, ``paths``; ``watchdog`` and
``paths.watch`` too, which are not DVC params: they watch the run, they do not change what the
run makes.

Phases: ``train.phases`` lists the objectives in order. ``sft`` trains on the packed shards;
``dpo`` on clean's preference pairs, starting from the SFT result and using it as DPO's
reference (LoRA: a frozen copy of the SFT adapter; full: the SFT weights). Each phase's result
is saved under ``<paths.checkpoints>/<phase>/final`` and the last one is the stage's output.

Data: the shards arrive packed and rank-balanced by ``pack`` and checked by ``preflight``.
Each rank reads its own shard, ``rank-{RANK:05d}.parquet``, through TRL's padding-free
collator; accelerate's re-split of the loader is undone (``methods.keep_rank_shard``), so the
micro-batches preflight counted are the ones that run.

Processes: one entry point. Started by ``dvc repro`` (or ``python -m stages.train``) with
``watchdog.enabled``, it becomes the watcher: it runs itself again as the job, in a process
group of its own, beside the power watchdog (``tuneloop.telemetry.watch``), and exits with the
job's code, or 86 when the watchdog ended a hung job (stacks dumped, MLflow run marked FAILED,
alert sent; trace, stacks, timeline and verdict under ``<paths.watch>/<time>``, which no run
clears, and the trace and timeline on the MLflow run under ``watchdog/``). The job,
with ``train.distributed: none``, trains in its own process; with ddp, zero2, zero3 or fsdp it
re-execs itself under torchrun with ``batch.world_size`` processes. Under torchrun,
``accelerate launch`` or ``deepspeed`` (several nodes) it trains as the rank it was given and
is not watched: wrap the launcher in ``tuneloop watch --`` on each node. See
``tuneloop.training.plan``; the training itself is ``tuneloop.training.run``.

Clusters: with ``train.launcher: slurm`` this process, on the login node, trains nothing: it
checks the launch (ranks = packed shards, the partition, shared storage), submits one job
whose task on each node is that node's ``tuneloop watch`` around its torchrun (c10d rendezvous
on the first node), streams the job's output into its log, and exits as the job ended: 0 on
COMPLETED, 86 when a node's watchdog ended a hang, else 1 with one sentence naming the state,
the node and the logs; a signal cancels the job (``tuneloop.cluster.submit``). The job's id,
nodes and state are tags on the stage's MLflow run, whose training rank 0 logs into; the
scheduler's GPU-hours go to the run and metrics/train.json (``cluster``). Before the job's time
limit the ranks save the step they are at and stop, and the job requeues itself and resumes
(``tuneloop.training.preemption``).

Checkpoints and resume: every ``train.save_steps`` steps a checkpoint with optimizer,
scheduler and RNG state (the newest ``train.save_total_limit`` and the best are kept), and a
validation loss. With ``train.resume: auto`` a rerun of the same params and data continues from
the newest complete checkpoint (a SIGKILL mid-run loses at most ``save_steps`` steps) and logs
into the same MLflow run when that run was cut off. The best checkpoint by validation loss is
the phase's result; ``train.early_stopping_patience`` evaluations without improvement end it.

Stop-loss: ``train.max_wall_hours``, ``max_host_memory_gb``, ``max_gpu_memory_gb`` and
``loss_spike_factor`` end the run at a step boundary (``tuneloop.training.stoploss``); the stage
then tags the MLflow run with the rule and reason, calls the alert hook (``alert_webhook`` /
``alert_command``), and exits non-zero, so DVC records no output and the pipeline stops.

MLflow: the stage's params and the run's plan; loss, learning-rate and grad-norm curves through
the transformers integration (the first phase into the stage's run, a later phase into a nested
run ``train/<phase>``); tokens/s and GPU-hours (GPUs x wall time) in ``metrics/train.json`` and
the run, stopped runs included; from the watcher, GPU-hours per power state
(``gpu_hours.<state>``), the timeline plot and the telemetry trace under ``watchdog/``, and the
tag ``tuneloop.watchdog.calibration_source`` (``estimate`` while the power bands are the
shipped estimates, ``none`` without a GPU).
"""

from __future__ import annotations

import logging
import os
import sys
import time

from tuneloop.params import Params
from tuneloop.stage import stage_params
from tuneloop.telemetry.actions import AlertHook
from tuneloop.telemetry.heartbeat import HEARTBEAT_ENV
from tuneloop.telemetry.watch import WatchOptions, new_out_dir, watch
from tuneloop.telemetry.watchdog import WatchConfig
from tuneloop.training.plan import Environment, TrainSetupError, exec_under_torchrun, resolve_plan

log = logging.getLogger("stages.train")


def needs_watcher(params: Params) -> bool:
    """True in the process ``dvc repro`` started, when the watchdog is on.

    Not under a watcher already (``tuneloop watch``, or this stage's own), and not as a
    rank a launcher started: ranks are watched from around their launcher.
    """
    launched = "LOCAL_RANK" in os.environ
    return params.watchdog.enabled and HEARTBEAT_ENV not in os.environ and not launched


def needs_submitting(params: Params) -> bool:
    """True in the process ``dvc repro`` started, when a cluster runs the ranks."""
    launched = "LOCAL_RANK" in os.environ or HEARTBEAT_ENV in os.environ
    return params.train.launcher != "local" and not launched


def watch_options(params: Params) -> WatchOptions:
    wd = params.watchdog
    return WatchOptions(
        command=(sys.executable, "-m", "stages.train"),
        out_dir=new_out_dir(params.paths.watch),
        # The params group names its knobs as WatchConfig does; WatchConfig checks them again.
        config=WatchConfig(**wd.model_dump(exclude={"enabled", "calibration"})),
        calibration=wd.calibration,
        alert=AlertHook(params.train.alert_webhook, params.train.alert_command),
    )


def main() -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    started_at = time.time()
    params = stage_params()
    if needs_submitting(params):
        from tuneloop.cluster.submit import run_on_cluster  # the login node's side only

        run_on_cluster(params)
        return
    if needs_watcher(params):
        # This process only watches: no torch here, so the job's imports and memory are its own.
        outcome = watch(watch_options(params))
        if outcome.alarm is not None:
            log.error("train: %s", outcome.alarm.reason)
        log.info("train: watchdog report %s", outcome.manifest)
        if outcome.exit_code != 0:
            raise SystemExit(outcome.exit_code)
        return
    try:
        plan = resolve_plan(params, Environment.probe())
    except TrainSetupError as error:
        raise SystemExit(f"train: cannot start:\n{error}") from None
    if plan.needs_launcher:
        log.info("train: re-running under torchrun with %d processes", plan.world_size)
        exec_under_torchrun(plan.world_size)
    from tuneloop.training.run import train  # torch, transformers, TRL: the job's own imports

    train(params, plan, started_at)


if __name__ == "__main__":
    main()
