"""What a training run will do on this machine, decided and checked before any work starts.

``resolve_plan`` turns the ``train`` and ``batch`` params and a probe of the machine into a
``TrainPlan``: precision, attention kernel, gradient checkpointing, the DeepSpeed or FSDP config
file, and whether the stage must first re-exec itself under torchrun. Every combination that
cannot run fails here with a ``TrainSetupError`` that names the key and the fix; nothing falls
back silently (a QLoRA request on a machine without CUDA fails, it does not train LoRA).

Launching: ``python -m stages.train`` (what ``dvc repro`` runs) with ``batch.world_size`` 1 and
``train.distributed: none`` trains in its own process. Any other ``train.distributed`` needs a
launcher: when the stage finds none (``LOCAL_RANK`` unset) it replaces itself with
``python -m torch.distributed.run --standalone --nproc-per-node <world_size> -m stages.train``,
keeping its pid for ``tuneloop watch``. Started by torchrun, ``accelerate launch`` or
``deepspeed`` (several nodes, say), it checks that the launcher's ``WORLD_SIZE`` is the
``batch.world_size`` that ``pack`` cut the shards for, and trains.

This module imports no torch at module level; ``Environment.probe`` does, when called.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from tuneloop.params import Params

# configs/ sits beside the package, not in the working directory: a stage may run anywhere.
CONFIGS = Path(__file__).resolve().parents[2] / "configs"
# train.distributed -> the file the Trainer gets; one table, read nowhere else.
DEEPSPEED_CONFIGS = {
    "zero2": CONFIGS / "deepspeed" / "zero2.json",
    "zero3": CONFIGS / "deepspeed" / "zero3.json",
}
FSDP_CONFIG = CONFIGS / "fsdp" / "fsdp2.json"
STAGE_MODULE = "stages.train"

Precision = Literal["bf16", "fp16", "fp32"]


class TrainSetupError(RuntimeError):
    """The requested run cannot start on this machine; the message names the key and the fix."""


@dataclass(frozen=True)
class Environment:
    """What the machine and the launcher offer; ``probe()`` reads it, tests build it by hand."""

    cuda: bool
    cuda_devices: int
    bf16: bool
    flash_attn: bool
    bitsandbytes: bool
    deepspeed: bool
    launcher_world_size: int | None
    """``WORLD_SIZE`` when a launcher started this process (``LOCAL_RANK`` set), else None."""
    accelerate_mode: Literal["deepspeed", "fsdp"] | None = None
    """What ``accelerate launch --config_file`` asked for, from the variables it exports."""

    @classmethod
    def probe(cls) -> Environment:
        import torch

        cuda = torch.cuda.is_available()
        launched = "LOCAL_RANK" in os.environ
        accelerate_mode: Literal["deepspeed", "fsdp"] | None = None
        if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
            accelerate_mode = "deepspeed"
        elif os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true":
            accelerate_mode = "fsdp"
        return cls(
            cuda=cuda,
            cuda_devices=torch.cuda.device_count() if cuda else 0,
            bf16=cuda and torch.cuda.is_bf16_supported(),
            flash_attn=importlib.util.find_spec("flash_attn") is not None,
            bitsandbytes=importlib.util.find_spec("bitsandbytes") is not None,
            deepspeed=importlib.util.find_spec("deepspeed") is not None,
            launcher_world_size=int(os.environ.get("WORLD_SIZE", "1")) if launched else None,
            accelerate_mode=accelerate_mode,
        )


@dataclass(frozen=True)
class TrainPlan:
    method: Literal["lora", "qlora", "full"]
    phases: tuple[Literal["sft", "dpo"], ...]
    distributed: Literal["none", "ddp", "zero2", "zero3", "fsdp"]
    world_size: int
    cuda: bool
    precision: Precision
    attn_implementation: str
    gradient_checkpointing: bool
    deepspeed_config: Path | None
    fsdp_config: Path | None
    needs_launcher: bool
    """True in the process ``dvc repro`` started when the run needs torchrun first."""

    @property
    def uses_lora(self) -> bool:
        return self.method in ("lora", "qlora")

    def describe(self) -> dict[str, object]:
        """The decisions, for the log, MLflow and the manifest."""
        return {
            "method": self.method,
            "phases": list(self.phases),
            "distributed": self.distributed,
            "world_size": self.world_size,
            "device": "cuda" if self.cuda else "cpu",
            "precision": self.precision,
            "attn_implementation": self.attn_implementation,
            "gradient_checkpointing": self.gradient_checkpointing,
            "deepspeed_config": self.deepspeed_config.name if self.deepspeed_config else None,
            "fsdp_config": self.fsdp_config.name if self.fsdp_config else None,
        }


def resolve_plan(params: Params, env: Environment) -> TrainPlan:
    train, world_size = params.train, params.batch.world_size
    problems = [
        *_method_problems(train.method, env),
        *_distributed_problems(train.distributed, world_size, env),
    ]
    if problems:
        raise TrainSetupError("\n".join(problems))
    precision: Precision = "fp32"
    if env.cuda:
        # fp16 only on GPUs without bf16 (before Ampere); on a CPU mixed precision only costs time.
        precision = "bf16" if env.bf16 else "fp16"
    return TrainPlan(
        method=train.method,
        phases=train.phases,
        distributed=train.distributed,
        world_size=world_size,
        cuda=env.cuda,
        precision=precision,
        attn_implementation="flash_attention_2" if env.cuda and env.flash_attn else "sdpa",
        # Recomputing activations saves GPU memory; on a CPU it only costs time (about 2.3x).
        gradient_checkpointing=env.cuda,
        deepspeed_config=DEEPSPEED_CONFIGS.get(train.distributed),
        fsdp_config=FSDP_CONFIG if train.distributed == "fsdp" else None,
        needs_launcher=train.distributed != "none" and env.launcher_world_size is None,
    )


def _method_problems(method: str, env: Environment) -> list[str]:
    if method != "qlora":
        return []
    if not env.cuda:
        return [
            "train.method 'qlora' loads the base model in 4-bit with bitsandbytes, which needs a "
            "CUDA GPU, and this machine has none. Use train.method: lora here (the same "
            "adapter, on an unquantized base), or run on a GPU host."
        ]
    if not env.bitsandbytes:
        return [
            "train.method 'qlora' needs bitsandbytes, which is not installed: pip install "
            "'bitsandbytes>=0.45' (or the project's gpu extra: pip install -e '.[gpu]')."
        ]
    return []


def _distributed_problems(distributed: str, world_size: int, env: Environment) -> list[str]:
    problems = []
    if distributed == "none" and world_size > 1:
        problems.append(
            f"batch.world_size is {world_size} but train.distributed is 'none': set "
            "train.distributed to ddp, zero2, zero3 or fsdp (or batch.world_size to 1)"
        )
    if distributed == "ddp" and world_size == 1:
        problems.append(
            "train.distributed 'ddp' with batch.world_size 1 has nothing to share: set "
            "train.distributed: none, or batch.world_size to the number of GPUs"
        )
    if distributed in DEEPSPEED_CONFIGS and not env.deepspeed:
        problems.append(
            f"train.distributed '{distributed}' needs DeepSpeed, which is not installed: "
            "pip install deepspeed==0.19.8 (or the project's gpu extra: pip install -e '.[gpu]')"
        )
    if distributed == "fsdp" and not env.cuda:
        # transformers 5.17: FSDP2 through the Trainer quietly runs plain DDP on a CPU, FSDP1
        # raises; refusing is better than a run that says FSDP and does not shard.
        problems.append(
            "train.distributed 'fsdp' needs CUDA GPUs: on a CPU the Trainer's FSDP does not shard "
            "(FSDP2 falls back to plain DDP, FSDP1 fails). Use train.distributed: ddp on a CPU."
        )
    launched = env.launcher_world_size
    if launched is not None and launched != world_size:
        problems.append(
            f"the launcher started {launched} processes but batch.world_size is {world_size}, the "
            "number of shards pack wrote: launch batch.world_size processes, or change "
            "batch.world_size and rerun pack"
        )
    if launched is None and distributed != "none" and env.cuda and world_size > env.cuda_devices:
        problems.append(
            f"batch.world_size {world_size} needs {world_size} GPUs on this node, which has "
            f"{env.cuda_devices}; for several nodes start the stage with torchrun or accelerate "
            "launch on each"
        )
    wanted = {"zero2": "deepspeed", "zero3": "deepspeed", "fsdp": "fsdp"}.get(distributed)
    if env.accelerate_mode is not None and env.accelerate_mode != wanted:
        problems.append(
            f"accelerate launch was configured for {env.accelerate_mode} but "
            f"train.distributed is '{distributed}': use the configs/accelerate/ file of the "
            "same name, or change train.distributed"
        )
    return problems


@dataclass(frozen=True)
class Rank:
    rank: int

    @classmethod
    def from_env(cls) -> Rank:
        # torchrun, accelerate and deepspeed all export RANK (global, across nodes).
        return cls(int(os.environ.get("RANK", "0")))

    @property
    def is_main(self) -> bool:
        return self.rank == 0


@dataclass(frozen=True)
class Rendezvous:
    """torchrun's c10d rendezvous across nodes; values may be shell references ("$SLURM_NODEID")."""

    nodes: int
    node_rank: str
    endpoint: str
    """host:port on the first node, where the c10d store runs."""
    run_id: str


def torchrun_argv(
    nproc_per_node: int, rendezvous: Rendezvous | None = None, python: str = sys.executable
) -> list[str]:
    """The command that starts ``nproc_per_node`` ranks of this stage on this node.

    Alone: a standalone rendezvous on a free port. Across nodes (``rendezvous``): every node
    runs the same line, meeting at the first node's c10d store; a cluster launcher writes it.
    """
    if rendezvous is None:
        # A free port and a local rendezvous: two runs on one machine do not collide.
        meet = ["--standalone"]
    else:
        meet = [
            f"--nnodes={rendezvous.nodes}",
            f"--node-rank={rendezvous.node_rank}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={rendezvous.endpoint}",
            f"--rdzv-id={rendezvous.run_id}",
        ]
    return [
        python,
        "-m",
        "torch.distributed.run",
        *meet,
        f"--nproc-per-node={nproc_per_node}",
        "-m",
        STAGE_MODULE,
    ]


def exec_under_torchrun(world_size: int) -> None:
    """Replace this process with torchrun running the stage; never returns.

    exec, not a child process: the pid that ``dvc repro`` or ``tuneloop watch`` started stays
    the job's root, and torchrun's exit status is the stage's.
    """
    argv = torchrun_argv(world_size)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(argv[0], argv)
