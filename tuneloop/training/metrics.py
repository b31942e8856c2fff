"""What the ``train`` stage records: ``metrics/train.json``, one ``PhaseMetrics`` per phase,
and the cluster job that ran it.

Apart from ``run`` and ``tuneloop.cluster`` (which compute them) so that their readers (the
model card, the retrain flow's summary) import no torch, and the stages that read them (the
cards are written by ``evaluate``) depend on this file alone.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from tuneloop.io import Omissible


class NodeUsage(BaseModel):
    """One node's GPU time in a cluster job."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    node: str = Field(description="the node's name, as the scheduler gives it")
    seconds: float = Field(
        description="wall time the job held the node, every run of it (requeues) together, s"
    )
    gpus: int = Field(description="GPUs the job held on the node (cluster.gpus_per_node)")
    gpu_hours: float = Field(description="gpus x seconds / 3600")


class JobReport(BaseModel):
    """What the stage records of a cluster job (``tuneloop.cluster``): ``TrainMetrics.cluster``
    and the MLflow run."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    launcher: str = Field(description="slurm or kubernetes")
    job_id: str = Field(description="the scheduler's job id (Kubernetes: the TrainJob's name)")
    state: str = Field(description="the job's last state, in Slurm's words: COMPLETED, FAILED, ...")
    nodes: tuple[str, ...] = Field(description="the nodes the scheduler last reported it on")
    restarts: int = Field(description="times the scheduler requeued or restarted it")
    elapsed_s: float = Field(description="the job's wall time, s")
    gpu_hours: float = Field(description="GPU-hours over every node: the sum of usage")
    usage: tuple[NodeUsage, ...] = Field(description="GPU time by node")
    logs: str = Field(
        description="the folder with the job's output and each node's watchdog evidence"
    )


class PhaseMetrics(BaseModel):
    """One training phase (sft, dpo): its losses, steps and speed."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    train_loss: float | None = Field(
        description="mean of the logged losses (None: no step logged one)"
    )
    first_logged_loss: float | None = Field(
        description="the first logged training loss; None: none logged"
    )
    last_logged_loss: float | None = Field(
        description="the last logged training loss; None: none logged"
    )
    eval_loss: float | None = Field(
        description="the best checkpoint's validation loss, else the last logged one; None: no "
        "validation"
    )
    best_step: int | None = Field(description="the step of that checkpoint; None: no validation")
    global_steps: int = Field(description="optimizer steps done")
    max_steps: int = Field(description="optimizer steps planned")
    epochs: float = Field(description="epochs done (fractional)")
    stopped_early: bool = Field(description="early stopping ended it before max_steps")
    resumed_from_step: int | None = Field(
        description="the checkpoint step it resumed from; None: started afresh"
    )
    seconds: float = Field(description="this run's training time of the phase, s")
    tokens: int = Field(description="real tokens this run trained on, every rank together")
    tokens_per_second: float | None = Field(description="tokens / seconds; None: no time measured")
    trainable_parameters: int = Field(
        description="parameters the phase trained (a LoRA: the adapter's)"
    )
    rewards_accuracies: Omissible[float] = Field(
        default=None, description="DPO's last logged rewards/accuracies; absent for SFT"
    )
    rewards_margins: Omissible[float] = Field(
        default=None, description="DPO's last logged rewards/margins; absent for SFT"
    )


class TrainMetrics(BaseModel):
    """``metrics/train.json``: the first phase's losses on top (what the flow reads), every
    phase under ``phases``, and the run's time and cost."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    method: str = Field(description="train.method")
    phases: dict[str, PhaseMetrics] = Field(description="phase (sft, dpo) -> its metrics")
    train_loss: float | None = Field(description="the first phase's train_loss")
    first_logged_loss: float | None = Field(description="the first phase's first_logged_loss")
    last_logged_loss: float | None = Field(description="the first phase's last_logged_loss")
    eval_loss: float | None = Field(description="the first phase's eval_loss")
    global_steps: int = Field(description="the first phase's optimizer steps")
    epochs: float = Field(description="the first phase's epochs")
    seconds: float = Field(description="every phase's training time, s")
    tokens_per_second: float | None = Field(
        description="every phase's tokens / seconds; None: no time measured"
    )
    gpu_hours: float = Field(
        description="GPUs x the stage's wall time; the scheduler's accounting on a cluster"
    )
    trainable_parameters: int = Field(description="the last phase's trainable parameters")
    lora_alpha: int | None = Field(
        description="train.lora_alpha as used (null there: 2 x lora_r); None: not a LoRA method"
    )
    gradient_accumulation_steps: int = Field(description="micro-batches per optimizer step")
    world_size: int = Field(description="training processes (ranks)")
    cluster: Omissible[JobReport] = Field(
        default=None,
        description="the Slurm or Kubernetes job that ran the ranks; absent when run locally",
    )
