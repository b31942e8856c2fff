"""Preflight's machine checks: GPUs, precision, interconnect, checkpoint disk and folder.

They read the same NVML inventory as ``tuneloop doctor`` and return the same ``Check``.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from tuneloop.io import read_json
from tuneloop.judge.verdict import Check
from tuneloop.params import Params
from tuneloop.preflight import doctor
from tuneloop.preflight.config import ADAPTER_METHODS
from tuneloop.training.plan import Environment, TrainSetupError, resolve_plan

# --- environment checks ----------------------------------------------------------------


# A full-weight checkpoint keeps bf16 weights (2 bytes/param) plus fp32 master weights and two
# Adam moments (12 bytes/param): 7x the weights. An adapter method's run writes at most a merged
# model's worth (the merge stage), so 1x the weights is its conservative bound.
FULL_CHECKPOINT_FACTOR = 7

# The lowest compute capability each precision needs (bf16 arrived with Ampere, FP8 with Ada).
MIN_CC = {"bf16": doctor.BF16_MIN_CC, "fp8": doctor.FP8_MIN_CC}


def check_precision(decided: str | None, inv: doctor.GpuInventory) -> Check:
    """The precision train decided (it has no knob: bf16 where the GPUs have it), against every
    GPU's capability.

    ``decided`` is None when train could not plan the run (see train_plan). torch answers
    "bf16?" for GPU 0 only; NVML sees every GPU, so a mixed node is caught here.
    """
    name = "precision"
    if inv.fault:
        return Check(name, "fail", f"GPU inventory failed: {inv.fault}")
    shown = f"train decided {decided or '(no plan)'}"
    wanted = decided
    if not inv.gpus:
        if wanted not in (None, "fp32"):
            return Check(name, "fail", f"{shown}, but there is no CUDA device ({inv.error})")
        return Check(name, "pass", f"{shown}: no CUDA device (bf16 needs sm 8.0+, FP8 sm 8.9+)")
    lowest = min(g.compute_capability for g in inv.gpus)
    sm = f"sm {lowest[0]}.{lowest[1]}"
    if wanted in MIN_CC and lowest < MIN_CC[wanted]:
        need = MIN_CC[wanted]
        return Check(
            name,
            "fail",
            f"{shown}, but the lowest GPU is {sm}; {wanted} needs sm {need[0]}.{need[1]}+",
        )
    if lowest < doctor.BF16_MIN_CC:
        return Check(
            name,
            "warn",
            f"{shown} on {sm}: no bf16, so fp16 with loss scaling, or fp32 at half speed",
        )
    fp8 = "and FP8" if lowest >= doctor.FP8_MIN_CC else "(FP8 needs sm 8.9+)"
    return Check(name, "pass", f"{shown} on {sm}: bf16 {fp8} available")


def training_environment(world_size: int) -> Environment:
    """The machine as train will see it (``Environment.probe``), launched as it will be.

    One node: ``dvc repro`` starts train without a launcher and it re-execs under torchrun.
    More ranks than this node's GPUs: a launcher starts every rank on every node with
    WORLD_SIZE = world_size, so the plan is judged as those ranks will see it (whole nodes
    are the devices check's business).
    """
    env = Environment.probe()
    if env.cuda and world_size > env.cuda_devices:
        return dataclasses.replace(env, launcher_world_size=world_size)
    return env


def decided_precision(params: Params, env: Environment) -> str | None:
    try:
        return resolve_plan(params, env).precision
    except TrainSetupError:
        return None


def check_train_plan(params: Params, env: Environment) -> Check:
    """What train itself would refuse at start, after minutes of loading: refused now."""
    name = "train_plan"
    try:
        plan = resolve_plan(params, env)
    except TrainSetupError as error:
        return Check(name, "fail", str(error).replace("\n", "; "))
    shown = ", ".join(f"{k} {v}" for k, v in plan.describe().items() if v is not None)
    return Check(name, "pass", shown)


def visible_gpus(inv: doctor.GpuInventory, env: Mapping[str, str]) -> int:
    """GPUs a launched process can use: CUDA_VISIBLE_DEVICES narrows NVML's list."""
    listed = env.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return len(inv.gpus)
    entries = [e.strip() for e in listed.split(",") if e.strip()]
    # CUDA stops at the first invalid entry; "-1" is the usual way to hide every GPU.
    valid = len(entries) if "-1" not in entries else entries.index("-1")
    return min(valid, len(inv.gpus))


def check_devices(
    world_size: int, inv: doctor.GpuInventory, visible: int, cuda_available: bool
) -> Check:
    """batch.world_size against the GPUs NVML sees and a process here may use.

    (How train.distributed fits world_size is train's own rule: see train_plan.)
    """
    name = "devices"
    if inv.fault:
        return Check(name, "fail", f"GPU inventory failed: {inv.fault}")
    if not inv.gpus:
        if world_size > 1:
            return Check(
                name,
                "warn",
                f"batch.world_size={world_size} on a host without GPU: gloo runs it on CPU, "
                "for tests, not for training",
            )
        return Check(name, "pass", f"no GPU ({inv.error}): one CPU process")
    if not cuda_available:
        return Check(
            name,
            "fail",
            f"NVML sees {len(inv.gpus)} GPU(s) but torch cannot use CUDA (a CPU-only torch build "
            "or a driver too old for it): training would run on the CPU",
        )
    if visible == 0:
        return Check(name, "fail", "CUDA_VISIBLE_DEVICES hides every GPU")
    if world_size < visible:
        return Check(
            name,
            "warn",
            f"batch.world_size={world_size} leaves {visible - world_size} of {visible} visible "
            "GPUs idle; raise it or narrow CUDA_VISIBLE_DEVICES",
        )
    if world_size % visible:
        return Check(
            name,
            "fail",
            f"batch.world_size={world_size} is no whole number of nodes of {visible} GPUs",
        )
    nodes = world_size // visible
    return Check(
        name,
        "pass",
        f"{world_size} rank(s) = {nodes} node(s) x {visible} GPU(s)"
        + (f"; launch with torchrun --nnodes {nodes}" if nodes > 1 else ""),
    )


def check_interconnect(inv: doctor.GpuInventory, env: Mapping[str, str], multi_node: bool) -> Check:
    """NVLink as NVML sees it, and NCCL settings that slow collectives or keep a hang silent."""
    name = "interconnect"
    if not inv.gpus and not inv.fault:
        return Check(name, "skip", f"no GPU ({inv.error}): NVLink and NCCL do not apply")
    nvlink = doctor.check_nvlink(inv)
    status, notes = nvlink.status, [nvlink.detail]
    if inv.fault:
        status = "fail"
    if env.get("NCCL_P2P_DISABLE") == "1" and len(inv.gpus) > 1:
        status = "warn" if status == "pass" else status
        notes.append("NCCL_P2P_DISABLE=1 sends every transfer through host memory, not NVLink")
    if env.get("NCCL_IB_DISABLE") == "1" and multi_node:
        status = "warn" if status == "pass" else status
        notes.append("NCCL_IB_DISABLE=1 puts inter-node traffic on TCP sockets")
    if env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING") == "0":
        status = "warn" if status == "pass" else status
        notes.append("TORCH_NCCL_ASYNC_ERROR_HANDLING=0: a hung collective never raises")
    settings = sorted(f"{k}={v}" for k, v in env.items() if k.startswith(("NCCL_", "TORCH_NCCL_")))
    notes.append(f"NCCL settings: {', '.join(settings) or 'none set'}")
    return Check(name, status, "; ".join(notes))


def model_weight_bytes(model_ref: str) -> int | None:
    """Size of the base model's weights, from its files (local or in the HF cache), no download."""
    folder = Path(model_ref)
    if folder.is_dir():
        index = next(iter(sorted(folder.glob("*.safetensors.index.json"))), None)
        if index is not None:
            return int(read_json(index)["metadata"]["total_size"])
        weights = [*folder.glob("*.safetensors"), *folder.glob("pytorch_model*.bin")]
        return sum(p.stat().st_size for p in weights) or None
    from huggingface_hub import try_to_load_from_cache

    for filename in ("model.safetensors.index.json", "model.safetensors"):
        cached = try_to_load_from_cache(model_ref, filename)
        if isinstance(cached, str):
            path = Path(cached)
            return (
                int(read_json(path)["metadata"]["total_size"])
                if filename.endswith(".json")
                else path.stat().st_size
            )
    return None


def _size(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def checkpoint_bytes(method: str, weight_bytes: int, save_total_limit: int, phases: int) -> int:
    """What train keeps per phase: the newest ``save_total_limit`` checkpoints and the best one
    (with optimizer state), and the phase's final weights."""
    factor = 1 if method in ADAPTER_METHODS else FULL_CHECKPOINT_FACTOR
    return phases * ((save_total_limit + 1) * factor * weight_bytes + weight_bytes)


def existing_parent(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def check_checkpoint_disk(
    folder: Path,
    method: str,
    weight_bytes: int | None,
    save_total_limit: int,
    phases: int,
    free_bytes: int,
) -> Check:
    name = "checkpoint_disk"
    if weight_bytes is None:
        return Check(
            name, "skip", "cannot size the base model's weights offline (not local, not cached)"
        )
    needed = checkpoint_bytes(method, weight_bytes, save_total_limit, phases)
    shown = (
        f"{folder}: {_size(free_bytes)} free; a {method} run on {_size(weight_bytes)} of weights "
        f"keeps ~{_size(needed)} ({phases} phase(s) x {save_total_limit} newest + best "
        "checkpoints + final weights)"
    )
    if free_bytes < needed:
        return Check(
            name, "fail", f"{shown}: the run would die at its first save; free space first"
        )
    return Check(name, "pass", shown)


def check_checkpoint_dir(folder: Path, dvc_outs: Sequence[Path], packed: Path) -> Check:
    """Writable, outside every DVC-managed folder, ideally on another disk than the data."""
    name = "checkpoint_dir"
    resolved = folder.resolve()
    for out in dvc_outs:
        if resolved.is_relative_to(out.resolve()):
            return Check(
                name,
                "fail",
                f"{folder} is inside {out}, a DVC out: the next stage run replaces that "
                "folder and the checkpoints with it",
            )
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".preflight-"):
            pass
    except OSError as exc:
        return Check(name, "fail", f"{folder} is not writable ({exc})")
    if packed.exists() and os.stat(folder).st_dev == os.stat(packed).st_dev:
        return Check(
            name,
            "warn",
            f"{folder} is writable, on the same device as {packed}: checkpoint saves (tens of "
            "GB at once) stall data reads; put checkpoints on another disk",
        )
    return Check(name, "pass", f"{folder} is writable, on another device than the data")


def check_stop_loss(max_wall_hours: float | None, world_size: int, on_gpu: bool) -> Check:
    name = "stop_loss"
    if max_wall_hours is None:
        # On GPUs an unbounded run burns rented hours; on a CPU (the demo, tests) it costs none.
        return Check(
            name,
            "fail" if on_gpu else "warn",
            "no stop-loss budget: set train.max_wall_hours, so a run that hangs or overruns is "
            "ended instead of burning GPU hours until someone notices",
        )
    return Check(
        name,
        "pass",
        f"train.max_wall_hours={max_wall_hours:g}: at most "
        f"{max_wall_hours * world_size:g} device-hours on {world_size} rank(s)",
    )
