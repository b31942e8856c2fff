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
    model_config = ConfigDict(frozen=True, extra="forbid")

    node: str
    seconds: float
    """Wall time the job held the node, every run of it (requeues) together."""
    gpus: int
    gpu_hours: float


class JobReport(BaseModel):
    """What the stage records of a cluster job (``tuneloop.cluster``): ``TrainMetrics.cluster``
    and the MLflow run."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    launcher: str
    job_id: str
    state: str
    nodes: tuple[str, ...]
    restarts: int
    elapsed_s: float
    gpu_hours: float
    usage: tuple[NodeUsage, ...]
    logs: str
    """The folder with the job's output and each node's watchdog evidence."""


class PhaseMetrics(BaseModel):
    """One training phase (sft, dpo): its losses, steps and speed."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    train_loss: float | None = Field(
        description="mean of the logged losses (None: no step logged one)"
    )
    first_logged_loss: float | None
    last_logged_loss: float | None
    eval_loss: float | None = Field(description="the best checkpoint's validation loss")
    best_step: int | None  # the step of that checkpoint
    global_steps: int
    max_steps: int
    epochs: float
    stopped_early: bool  # early stopping ended it before max_steps
    resumed_from_step: int | None  # None: started afresh
    seconds: float
    tokens: int  # real tokens trained on, every rank
    tokens_per_second: float | None
    trainable_parameters: int
    # DPO's own curves, last logged value; an SFT phase has none.
    rewards_accuracies: Omissible[float] = None
    rewards_margins: Omissible[float] = None


class TrainMetrics(BaseModel):
    """``metrics/train.json``: the first phase's losses on top (what the flow reads), every
    phase under ``phases``, and the run's time and cost."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    method: str  # train.method
    phases: dict[str, PhaseMetrics]
    train_loss: float | None
    first_logged_loss: float | None
    last_logged_loss: float | None
    eval_loss: float | None
    global_steps: int
    epochs: float
    seconds: float  # every phase's training time
    tokens_per_second: float | None
    gpu_hours: float = Field(
        description="GPUs x the stage's wall time; the scheduler's accounting on a cluster"
    )
    trainable_parameters: int  # of the last phase
    lora_alpha: int | None  # None: not a LoRA method
    gradient_accumulation_steps: int
    world_size: int
    # The Slurm or Kubernetes job that ran the ranks (tuneloop.cluster); absent when local.
    cluster: Omissible[JobReport] = None
