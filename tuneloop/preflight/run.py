"""The whole preflight gate: read once, run every check, report.

All checks run, so one failure never hides the next; the caller refuses the run when any
check failed.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pynvml
from pydantic import BaseModel, ConfigDict, Field

from tuneloop.data.chat import load_chat_tokenizer
from tuneloop.io import read_json
from tuneloop.judge import suites
from tuneloop.judge.verdict import Check, run_timed
from tuneloop.models import base_model_ref, model_limits
from tuneloop.params import Params, TrainParams
from tuneloop.preflight import doctor
from tuneloop.preflight.config import (
    check_effective_batch,
    check_epochs,
    check_learning_rate,
    check_lora_shape,
    check_warmup,
)
from tuneloop.preflight.data import (
    JsonLines,
    Shards,
    StepPlan,
    check_eval_contamination,
    check_labels_aligned,
    check_labels_present,
    check_lengths,
    check_ranks_balanced,
    check_shards_complete,
    check_template_roundtrip,
    check_vocab,
)
from tuneloop.preflight.launch import check_launch
from tuneloop.preflight.machine import (
    check_checkpoint_dir,
    check_checkpoint_disk,
    check_devices,
    check_interconnect,
    check_precision,
    check_stop_loss,
    check_train_plan,
    decided_precision,
    existing_parent,
    model_weight_bytes,
    training_environment,
    visible_gpus,
)


class PreflightMetrics(BaseModel):
    """``metrics/preflight.json``: the gate's time and how many checks ended each way (every
    check with its detail is in ``reports/preflight.json``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    seconds: float = Field(description="the whole gate: reading everything and every check, s")
    read_seconds: float = Field(
        description="reading the shards, tokenizer, config and GPU inventory, s"
    )
    passed: int = Field(description="checks that passed")
    warnings: int = Field(description="checks that warned: it will work, slower or riskier")
    failed: int = Field(description="checks that failed (the stage then stops)")
    skipped: int = Field(description="checks that do not apply here")
    optimizer_steps: int = Field(description="optimizer steps the run will take, as planned")


@dataclass(frozen=True)
class Report:
    checks: list[Check]
    seconds: float
    """The whole gate: reading everything and every check."""
    read_seconds: float
    """Reading the shards, the tokenizer, the model config and the GPU inventory."""
    plan: StepPlan

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.status == "fail"]

    def counts(self) -> dict[str, int]:
        return doctor.status_counts(self.checks)

    def metrics(self) -> PreflightMetrics:
        counts = self.counts()
        return PreflightMetrics(
            seconds=round(self.seconds, 4),
            read_seconds=round(self.read_seconds, 4),
            passed=counts["pass"],
            warnings=counts["warn"],
            failed=counts["fail"],
            skipped=counts["skip"],
            optimizer_steps=self.plan.total_steps,
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": not self.failed,
            "seconds": round(self.seconds, 4),
            "read_seconds": round(self.read_seconds, 4),
            "counts": self.counts(),
            "plan": asdict(self.plan),
            "checks": [asdict(c) for c in self.checks],
        }


def phase_rates(train: TrainParams) -> dict[str, tuple[str, float]]:
    keys = {
        "sft": ("train.learning_rate", train.learning_rate),
        "dpo": ("train.dpo_learning_rate", train.dpo_learning_rate),
    }
    return {phase: keys[phase] for phase in train.phases}


def dvc_out_folders(params: Params) -> list[Path]:
    p = params.paths
    exports = [p.fp8, p.nvfp4, p.nvfp4a16]
    return [p.incoming, p.pool, p.clean, p.packed, p.base_model, p.adapter, p.merged, *exports]


def run_preflight(
    params: Params, env: Mapping[str, str] = os.environ, nvml: doctor.Nvml = pynvml
) -> Report:
    """Every check on this project's data, config and machine."""
    started = time.perf_counter()
    paths, train, batch = params.paths, params.train, params.batch
    ref = base_model_ref(params)
    shards = Shards.read(paths.packed, batch.world_size)
    context, embedding_rows = model_limits(ref)
    tokenizer = load_chat_tokenizer(ref)
    inv = doctor.read_gpus(nvml)
    machine = training_environment(batch.world_size)
    plan = StepPlan.of(shards, batch, train.epochs, train.max_steps)
    read_seconds = time.perf_counter() - started

    # Read once for the two checks that need it (hundreds of MB at 100k chats).
    train_jsonl = paths.clean / "train.jsonl"
    train_data = train_jsonl.read_bytes() if train_jsonl.exists() else None

    def roundtrip() -> Check:
        if train_data is None:
            raise FileNotFoundError(f"{train_jsonl} is missing; run `clean` first")
        lines = JsonLines(train_data)
        manifest = paths.packed / "manifest.json"
        packed_samples = read_json(manifest).get("samples") if manifest.exists() else None
        return check_template_roundtrip(
            shards,
            lines,
            packed_samples,
            tokenizer,
            params.pack.seq_len,
            params.preflight.roundtrip_samples,
        )

    def disk() -> Check:
        free = shutil.disk_usage(existing_parent(paths.checkpoints)).free
        return check_checkpoint_disk(
            paths.checkpoints,
            train.method,
            model_weight_bytes(ref),
            train.save_total_limit,
            len(train.phases),
            free,
        )

    visible = visible_gpus(inv, env)
    checks: list[Callable[[], Check]] = [
        lambda: check_shards_complete(shards, params.preflight.min_train_bins),
        lambda: check_ranks_balanced(shards, batch, plan),
        lambda: check_lengths(shards, params.pack.seq_len, context),
        lambda: check_labels_present(shards),
        lambda: check_labels_aligned(shards),
        lambda: check_vocab(shards, embedding_rows, len(tokenizer)),
        roundtrip,
        lambda: check_eval_contamination(
            train_jsonl,
            # The fixed badcases are trained on by design (suites.held_out_questions).
            list(suites.held_out_questions(paths.eval_suites, paths.fixed_badcases)),
            train_data,
        ),
        lambda: check_learning_rate(train.method, phase_rates(train)),
        lambda: check_warmup(train.warmup_ratio, plan.total_steps),
        lambda: check_lora_shape(train.method, train.lora_r, train.resolved_lora_alpha),
        lambda: check_effective_batch(batch, plan),
        lambda: check_epochs(train.epochs, train.max_steps, plan),
        lambda: check_train_plan(params, machine),
        lambda: check_precision(decided_precision(params, machine), inv),
        lambda: check_devices(batch.world_size, inv, visible, machine.cuda),
        lambda: check_interconnect(inv, env, multi_node=batch.world_size > max(visible, 1)),
        disk,
        lambda: check_checkpoint_dir(paths.checkpoints, dvc_out_folders(params), paths.packed),
        lambda: check_stop_loss(train.max_wall_hours, batch.world_size, bool(inv.gpus)),
        lambda: check_launch(params),
    ]
    results = run_timed(checks)
    return Report(results, time.perf_counter() - started, read_seconds, plan)


def report_markdown(report: Report) -> str:
    counts = report.counts()
    verdict = "REFUSED" if report.failed else "passed"
    lines = [
        f"# preflight {verdict}",
        "",
        f"{counts['fail']} failed, {counts['warn']} warnings, {counts['pass']} passed, "
        f"{counts['skip']} skipped in {report.seconds:.2f} s "
        f"({report.read_seconds:.2f} s reading).",
        "",
        "| check | status | time | detail |",
        "|---|---|---|---|",
    ]
    for c in report.checks:
        detail = c.detail.replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {c.name} | {c.status} | {c.seconds * 1000:.1f} ms | {detail} |")
    return "\n".join(lines) + "\n"
