"""Checkpoints of a training run: which ones belong to it, the newest complete one, phase results.

Layout under the stage's checkpoint folder (``paths.checkpoints``, outside DVC's outs)::

    run.json                 fingerprint of what is trained, params hash, MLflow run id
    sft/checkpoint-200/      the Trainer's checkpoints: weights, optimizer, scheduler, RNG, state
    sft/final/               the phase's result (the best checkpoint's weights), for the next phase
    dpo/...

A checkpoint or a phase result counts only once it holds ``tuneloop-complete.json``, written
after every rank has finished writing its part: a process killed in the middle of a save
leaves a folder without it, and ``prune_incomplete`` removes such folders before a resume.

``run.json``'s fingerprint covers what decides the trained weights (the train stage's params
less the operational keys, the data, and the weights it starts from); ``prepare`` keeps the
checkpoints of a run with the same fingerprint for ``train.resume: auto`` and otherwise clears
what it owns (``run.json`` and the phase folders), so a run never continues from another run's
optimizer state. Anything else
in the folder is left alone: it is not this module's to delete.

Checkpoint folders are named ``checkpoint-N`` by the Trainer; ``checkpoint_dir`` and
``checkpoint_step`` are the one place this code names or parses them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from tuneloop.io import file_stamp, read_json, write_json
from tuneloop.params import TRAIN_PHASE_ORDER, Params
from tuneloop.tracking import init_from, lineage

log = logging.getLogger(__name__)

MARKER = "tuneloop-complete.json"
RUN_RECORD = "run.json"
FINAL = "final"
_CHECKPOINT = re.compile(rf"^{re.escape(PREFIX_CHECKPOINT_DIR)}-(\d+)$")

# Keys of the train group that change how a run is watched or kept, not the weights it makes:
# raising max_wall_hours after a stop must resume the run, not start it again.
OPERATIONAL_KEYS = (
    "resume",
    "save_steps",
    "save_total_limit",
    "logging_steps",
    "max_wall_hours",
    "max_host_memory_gb",
    "max_gpu_memory_gb",
    "loss_spike_factor",
    "loss_spike_window",
    "alert_webhook",
    "alert_command",
)


@dataclass(frozen=True)
class RunRecord:
    fingerprint: str
    params_hash: str
    mlflow_run_id: str | None = None


@dataclass(frozen=True)
class Preparation:
    resumed: bool
    """True when the folder holds this run's checkpoints and they are kept."""
    previous: RunRecord | None
    detail: str


def data_identity(path: Path) -> str:
    """A cheap identity of an input file or folder: its manifest's bytes, or file names and sizes.

    Hashing every shard would take minutes on a real data set; ``pack`` and ``clean`` write a
    new manifest (with its creation time) whenever they write new data.
    """
    if path.is_file():
        return hashlib.sha256(path.read_bytes()).hexdigest()
    manifest = path / "manifest.json"
    if manifest.is_file():
        return hashlib.sha256(manifest.read_bytes()).hexdigest()
    sizes = sorted((p.name, p.stat().st_size) for p in path.iterdir() if p.is_file())
    return hashlib.sha256(json.dumps(sizes).encode()).hexdigest()


def base_identity(params: Params) -> str | None:
    """The base model's weights, where the params do not pin them: the folder the base stage
    built (its manifest: ``model.tiny`` shapes builtin:tiny and is no train param), or a local
    folder (its files' stamps: weights saved over it keep their names and sizes). A hub id is
    pinned by ``model.revision``, which the params part of the fingerprint holds."""
    source = params.model.source
    if source == "builtin" and params.paths.base_model.is_dir():
        return data_identity(params.paths.base_model)
    if source == "local":
        files = sorted(p for p in Path(params.model.base).iterdir() if p.is_file())
        stamps = [(p.name, file_stamp(p.stat())) for p in files]
        return hashlib.sha256(json.dumps(stamps).encode()).hexdigest()
    return None


def fingerprint(params: Params, inputs: Mapping[str, Path]) -> str:
    """What decides the trained weights: the train stage's params less operational keys, data,
    and the weights training starts from (the base, or the champion ``init`` fetched).

    Not the training code or library versions: resuming after a fix to the code is what a
    resume is for; ``train.resume: never`` starts afresh.
    """
    groups = lineage.stage_param_groups(lineage.dvc_stage("train", params))
    subset = lineage.params_subset(params, groups)
    subset["train"] = {
        key: value for key, value in subset.get("train", {}).items() if key not in OPERATIONAL_KEYS
    }
    data = {name: data_identity(path) for name, path in sorted(inputs.items())}
    start = {"init": asdict(init_from.recorded(params)), "base": base_identity(params)}
    canonical = json.dumps(
        {"params": subset, "data": data, "start": start}, sort_keys=True, default=str
    )
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def checkpoint_dir(phase_dir: Path, step: int) -> Path:
    """The folder the Trainer saves the checkpoint of ``step`` in: ``checkpoint-N``."""
    return phase_dir / f"{PREFIX_CHECKPOINT_DIR}-{step}"


def checkpoint_step(folder: Path) -> int | None:
    """The step of a ``checkpoint-N`` folder; None for any other name."""
    match = _CHECKPOINT.match(folder.name)
    return int(match.group(1)) if match else None


def phase_folder(root: Path, phase: str) -> Path:
    """Where a phase's checkpoints (the Trainer's ``output_dir``) and its result go."""
    return root / phase


def owned(root: Path) -> list[Path]:
    """What a run writes in the checkpoint folder: its record and one folder per phase."""
    return [root / RUN_RECORD, *(phase_folder(root, phase) for phase in TRAIN_PHASE_ORDER)]


def read_record(root: Path) -> RunRecord | None:
    try:
        return RunRecord(**read_json(root / RUN_RECORD))
    except (FileNotFoundError, TypeError, json.JSONDecodeError):
        return None


def write_record(root: Path, record: RunRecord) -> None:
    write_json(root / RUN_RECORD, asdict(record))


def prepare(root: Path, record: RunRecord, resume: bool) -> Preparation:
    """Keep this run's complete checkpoints (when resuming), else clear what earlier runs wrote.

    Call it on one process (rank 0) before training; the others wait for it.
    """
    previous = read_record(root)
    if previous is not None and resume and previous.fingerprint == record.fingerprint:
        for phase in TRAIN_PHASE_ORDER:
            for removed in prune_incomplete(phase_folder(root, phase)):
                log.info("removed %s: a save that did not finish", removed)
        write_record(
            root, RunRecord(record.fingerprint, record.params_hash, previous.mlflow_run_id)
        )
        return Preparation(True, previous, f"resuming the run in {root}")
    if previous is None:
        detail = "no earlier run"
    elif not resume:
        detail = "train.resume is 'never'"
    else:
        detail = (
            f"the checkpoints in {root} were made with other params or data "
            f"(fingerprint {previous.fingerprint}, now {record.fingerprint})"
        )
    for path in owned(root):
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    write_record(root, record)
    return Preparation(False, previous, f"starting afresh: {detail}")


def checkpoints(phase_dir: Path) -> list[tuple[int, Path]]:
    """The Trainer's checkpoint folders in ``phase_dir``, oldest step first."""
    if not phase_dir.is_dir():
        return []
    found = []
    for path in phase_dir.iterdir():
        step = checkpoint_step(path)
        if step is not None and path.is_dir():
            found.append((step, path))
    return sorted(found)


def is_complete(folder: Path) -> bool:
    return (folder / MARKER).is_file()


def newest_complete(phase_dir: Path) -> Path | None:
    complete = [path for _, path in checkpoints(phase_dir) if is_complete(path)]
    return complete[-1] if complete else None


def prune_incomplete(phase_dir: Path) -> list[Path]:
    """Remove checkpoint and result folders whose save never finished; returns them."""
    doomed = [path for _, path in checkpoints(phase_dir) if not is_complete(path)]
    final = phase_dir / FINAL
    if final.exists() and not is_complete(final):
        doomed.append(final)
    for path in doomed:
        shutil.rmtree(path)
    return doomed


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def mark_complete(folder: Path, payload: Mapping[str, Any]) -> None:
    """Written last, by one process, once every rank has written its part (callers barrier)."""
    write_json(folder / MARKER, {"time": time.time(), **payload})


def read_marker(folder: Path) -> dict[str, Any]:
    data: dict[str, Any] = read_json(folder / MARKER)
    return data


class MarkCompleteCheckpoints(TrainerCallback):
    """Marks each checkpoint complete once every rank has saved its part of it.

    The Trainer calls ``on_save`` on every rank right after its own part of the save
    (weights on rank 0, each rank's RNG state, each rank's optimizer shard under ZeRO).
    """

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        barrier()
        folder = checkpoint_dir(Path(str(args.output_dir)), state.global_step)
        if state.is_world_process_zero and folder.is_dir():
            mark_complete(folder, {"step": state.global_step})


def link_tree(source: Path, target: Path, skip: frozenset[str] = frozenset({MARKER})) -> None:
    """Fill ``target`` with ``source``'s files: hard links where possible, else copies.

    A full model's weights are tens of GB; a link costs nothing and the checkpoint folder
    never rewrites a file in place (a new run removes the folder first).
    """
    for folder, _, files in os.walk(source):
        relative = Path(folder).relative_to(source)
        (target / relative).mkdir(parents=True, exist_ok=True)
        for name in files:
            if name in skip:
                continue
            src, dst = Path(folder) / name, target / relative / name
            try:
                os.link(src, dst)
            except OSError:
                shutil.copy2(src, dst)
