"""Model and dataset cards: what a registered version is, what made it, and how it was judged.

Both follow the Hugging Face ``README.md`` layout (YAML front matter, then Markdown), so
they read the same on a model hub, in MLflow and in the exported folders. The evaluate
stage writes them to ``reports/``; registration copies the model card into the logged
merged and FP8 folders as their ``README.md`` and logs both cards on the version's run.

Everything in a card comes from a file the pipeline already wrote (params, the stages'
``metrics/*.json``, the pool's provenance, ``dvc.lock``, the git state, the watchdog's
summary); a fact that is not there is said to be missing, never guessed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tuneloop.data.metrics import CleanMetrics, IngestMetrics
from tuneloop.data.records import pool_records
from tuneloop.io import ModelT, read_model
from tuneloop.judge.decision import Comparison, Decision
from tuneloop.params import Params
from tuneloop.quantization import FORMATS
from tuneloop.tracking import lineage
from tuneloop.training.metrics import TrainMetrics

CARD = "README.md"  # the file name a model folder's card has on a hub


@dataclass
class Facts:
    """What the cards report, gathered once from the pipeline's own files."""

    # The stages' metrics; None where the file is missing.
    ingest: IngestMetrics | None = None
    clean: CleanMetrics | None = None
    train: TrainMetrics | None = None
    pool: Counter[tuple[str, str]] = field(default_factory=Counter)  # (month, source) -> records
    md5s: dict[str, str] = field(default_factory=dict)  # DVC out -> md5, from dvc.lock
    commit: str = "unknown"
    dirty: bool = True
    watch: dict[str, Any] | None = None  # the watchdog's summary of the training run
    watch_path: str | None = None


def _metrics(path: Path, model: type[ModelT]) -> ModelT | None:
    return read_model(path, model) if path.exists() else None


def _json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _month(record_meta: dict[str, Any], provenance: dict[str, Any]) -> str:
    """YYYY-MM of when the record was made; when it was ingested if it does not say."""
    stamp = record_meta.get("created_at") or provenance.get("ingested_at") or ""
    return str(stamp)[:7] if len(str(stamp)) >= 7 else "unknown"


def gather(params: Params, repo: Path, watch_root: Path | None = None) -> Facts:
    """Read what the cards need; ``watch_root`` holds the watchdog's ``*/watch.json``."""
    metrics = repo / params.paths.metrics
    facts = Facts(
        # Ingest is shared by the tasks: its metrics lie in the project's folder, not the task's.
        ingest=_metrics(repo / params.project_path("metrics") / "ingest.json", IngestMetrics),
        clean=_metrics(metrics / "clean.json", CleanMetrics),
        train=_metrics(metrics / "train.json", TrainMetrics),
    )
    pool = repo / params.paths.pool
    if pool.exists():
        for record in pool_records(pool, params.task):
            source = str(record.meta.get("source") or "unknown")
            facts.pool[(_month(record.meta, record.provenance), source)] += 1
    for md5s in lineage.dvc_lock_md5s(repo).values():
        facts.md5s |= md5s["outs"]
    git = lineage.git_state(repo)
    facts.commit, facts.dirty = git.commit, git.dirty
    if watch_root is not None and (repo / watch_root).exists():
        summaries = sorted((repo / watch_root).glob("*/watch.json"))
        if summaries:  # folders are named by start time: the last one is the newest run
            facts.watch = _json(summaries[-1])
            facts.watch_path = summaries[-1].relative_to(repo).as_posix()
    return facts


def _front_matter(data: dict[str, Any]) -> str:
    return "---\n" + yaml.safe_dump(data, sort_keys=False, allow_unicode=True) + "---\n"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def _data_lines(params: Params, facts: Facts) -> list[str]:
    """Months and sources of the pool, and what clean made of it."""
    lines: list[str] = []
    if facts.pool:
        months = sorted({m for m, _ in facts.pool})
        sources = sorted({s for _, s in facts.pool})
        rows = [[m, *(str(facts.pool[(m, s)]) for s in sources)] for m in months]
        rows.append(["all", *(str(sum(facts.pool[(m, s)] for m in months)) for s in sources)])
        lines += [
            f"Records in the pool (`{params.paths.pool}`) by month (`created_at`, else the "
            "ingest date) and source:",
            "",
            *_table(["month", *sources], rows),
            "",
        ]
    else:
        lines += [f"No pool records found under `{params.paths.pool}`.", ""]
    if (clean := facts.clean) is not None:
        lines += [
            f"Clean data (`{params.paths.clean}`): {clean.train} training and "
            f"{clean.val} validation chats, {clean.dpo_pairs} "
            f"DPO pairs, from {clean.records_in} pooled records; removed: "
            + (", ".join(f"{k} {v}" for k, v in sorted(clean.removed.items())) or "none")
            + ".",
            "",
        ]
    else:
        lines += ["metrics/clean.json is missing: clean counts unknown.", ""]
    return lines


def _lineage_lines(facts: Facts, candidate_key: str | None) -> list[str]:
    lines = [
        f"- git commit: `{facts.commit}`" + (" (uncommitted changes)" if facts.dirty else ""),
    ]
    if candidate_key:
        lines.append(f"- merged folder manifest sha256: `{candidate_key}`")
    if facts.md5s:
        lines += ["- DVC outs (dvc.lock):"]
        lines += [f"  - `{path}`: `{md5}`" for path, md5 in sorted(facts.md5s.items())]
    else:
        lines.append("- DVC outs: no dvc.lock yet (stages run outside `dvc repro`)")
    return lines


def _compute_lines(facts: Facts) -> list[str]:
    train = facts.train
    lines = []
    if train is not None:
        lines.append(
            f"Training: {train.seconds} s wall, {train.gpu_hours} "
            f"GPU-hours (GPUs x wall time), {train.tokens_per_second} tokens/s."
        )
    else:
        lines.append("metrics/train.json is missing: training time unknown.")
    accounting = (facts.watch or {}).get("accounting") or {}
    by_state = accounting.get("gpu_hours") or {}
    if by_state:
        estimated = any(
            c.get("estimated") for c in (facts.watch or {}).get("calibrations", {}).values()
        )
        lines += [
            "",
            f"GPU-hours by watchdog state (`{facts.watch_path}`)"
            + (
                "; the power bands are estimates until a calibration run on these GPUs:"
                if estimated
                else ":"
            ),
            "",
            *_table(
                ["state", "GPU-hours", "share"],
                [
                    [state, f"{hours:.4f}", f"{accounting.get('share', {}).get(state, 0):.1%}"]
                    for state, hours in sorted(by_state.items())
                ],
            ),
        ]
    else:
        lines.append("GPU-hours by watchdog state: not recorded (no GPU, or no watchdog summary).")
    return lines


def _interval(c: Comparison) -> str:
    return "n/a" if c.diff is None else f"{c.diff:+.3f} [{c.low:+.3f}, {c.high:+.3f}]"


def _eval_lines(decision: Decision) -> list[str]:
    conf = decision.statistics.confidence
    rows = []
    for c in decision.comparisons:
        value = "n/a" if c.value is None else f"{c.value:.3f}"
        ref = "n/a" if c.reference_value is None else f"{c.reference_value:.3f}"
        rows.append([c.suite, c.metric, f"{c.model} vs {c.reference}", value, ref, _interval(c)])
    # Which engine answered for each model (older decisions do not say).
    by_engine: dict[str, list[str]] = {}
    for model, engine in decision.engines.items():
        by_engine.setdefault(engine, []).append(model)
    lines = [
        *(f"Scored with {e}: {', '.join(ms)}." for e, ms in by_engine.items()),
        *([""] if by_engine else []),
        f'Paired differences ("better by"; {conf:.0%} bootstrap intervals) on '
        + ", ".join(f"{s} ({n} items)" for s, n in decision.items.items())
        + ":",
        "",
        *_table(["suite", "metric", "comparison", "model", "reference", "better by"], rows),
    ]
    slices = decision.slices
    if slices:
        lines += [
            "",
            f"By slice, candidate vs {decision.reference}:",
            "",
            *_table(
                ["suite", "slice", "metric", "items", "better by", ""],
                [
                    [
                        s.suite,
                        s.slice or "",
                        s.metric,
                        str(s.items),
                        _interval(s),
                        "regressed" if s.regressed else "",
                    ]
                    for s in slices
                ],
            ),
        ]
    for suite, why in decision.forgetting.could_not_run.items():
        lines.append(f"\n- {suite}: {why}")
    return lines


def _exports(params: Params, decision: Decision) -> str:
    """The sentence on the exports: each format of ``export.formats`` with its scheme, and
    whether the gate refused it."""
    if not params.export.formats:
        return "Not exported (export.formats is empty): served as the adapter or merged model."
    shown = []
    for fmt in params.export.formats:
        scheme = params.export.scheme if fmt == "fp8" else FORMATS[fmt].scheme
        refused = decision.refused(fmt)
        shown.append(
            f"{fmt} ({scheme}{'; refused by the gate, not registered' if refused else ''})"
        )
    return (
        f"Exported with llm-compressor to {', '.join(shown)} (layers "
        f"{', '.join(params.export.ignore) or 'none'} kept in {params.export.dtype})."
    )


def _train_results(train: TrainMetrics | None) -> dict[str, Any]:
    """What training reached, for the method table (nothing when train.json is missing)."""
    if train is None:
        return {}
    return {
        "result: global_steps": train.global_steps,
        "result: first_logged_loss": train.first_logged_loss,
        "result: last_logged_loss": train.last_logged_loss,
        "result: eval_loss": train.eval_loss,
    }


def model_card(params: Params, facts: Facts, decision: Decision) -> str:
    """The candidate's model card (Hugging Face README.md layout)."""
    train = params.train
    method = train.method
    tags = ["tuneloop", *train.phases, method, "fine-tuned"]
    front = {
        "base_model": params.model.base,
        "library_name": "transformers",
        "tags": tags,
        "pipeline_tag": "text-generation",
    }
    lora = (
        f"LoRA r={train.lora_r}, alpha={train.resolved_lora_alpha}, dropout={train.lora_dropout} "
        f"on {', '.join(train.target_modules)}, merged into the base weights"
        if method in ("lora", "qlora")
        else "every weight trained (full fine-tune)"
    )
    config = {
        "phases": " -> ".join(train.phases),
        "learning rate (sft)": train.learning_rate,
        "epochs (sft)": train.epochs,
        "max steps (sft)": train.max_steps,
        "scheduler": f"{train.lr_scheduler}, warm-up {train.warmup_ratio}",
        "weight decay": train.weight_decay,
        "sequence length (packed)": params.pack.seq_len,
        "processes": f"{params.batch.world_size} ({train.distributed})",
        "micro batch / effective batch": (
            f"{params.batch.micro_batch_size} / {params.batch.effective_batch} "
            f"(gradient accumulation {params.batch.gradient_accumulation_steps})"
        ),
        "seed": train.seed,
    }
    if "dpo" in train.phases:
        config["DPO beta / learning rate / epochs"] = (
            f"{train.dpo_beta} / {train.dpo_learning_rate} / {train.dpo_epochs}"
        )
    config |= _train_results(facts.train)
    verdict = decision.verdict.upper()
    lines = [
        _front_matter(front),
        f"# {params.tracking.registered_model}: candidate",
        "",
        f"Fine-tuned from `{params.model.base}` by tuneloop. Evaluate gate: **{verdict}**"
        + (
            f" (champion compared: v{decision.champion.version})."
            if decision.champion
            else " (no champion yet: first release)."
        ),
        "",
        "## Method",
        "",
        f"{method.upper()} ({lora}); objectives: {', '.join(train.phases)}. "
        + _exports(params, decision),
        "",
        "## Data",
        "",
        *_data_lines(params, facts),
        "## Training configuration",
        "",
        *_table(["setting", "value"], [[k, str(v)] for k, v in config.items()]),
        "",
        "## Evaluation",
        "",
        *_eval_lines(decision),
        "",
        "## Gate",
        "",
        f"Verdict: **{verdict}**. Reasons, blocking ones first:",
        "",
        *(f"- {reason}" for reason in decision.reasons),
        "",
        *_unsettled_lines(decision),
        REVIEW_HEADING,
        "",
        "Not reviewed yet: the release adds the people's blind review here (`tuneloop review`).",
        "",
        "## Compute",
        "",
        *_compute_lines(facts),
        "",
        "## Lineage",
        "",
        *_lineage_lines(facts, decision.candidate_key),
        "",
    ]
    return "\n".join(lines)


REVIEW_HEADING = "## Blind review"


def _unsettled_lines(decision: Decision) -> list[str]:
    """The rules the gate could not settle and let through (gate.on_inconclusive: warn)."""
    let_through = decision.let_through()
    if not let_through:
        return []
    return [
        f"Let through unsettled ({len(let_through)}, gate.on_inconclusive: warn); a person "
        "acknowledges each before approving the release:",
        "",
        *(f"- {u.reason}" for u in let_through),
        "",
    ]


def review_section(table: str, summary: str) -> str:
    """The card's blind-review section: the summary line and the results table."""
    return f"{REVIEW_HEADING}\n\n{summary}.\n\n{table}\n"


def with_review_section(card: str, section: str) -> str:
    """``card`` with its blind-review section replaced by ``section`` (added before Compute,
    or at the end, in a card without one)."""
    lines = card.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.rstrip() == REVIEW_HEADING), None)
    if start is None:
        start = next(
            (i for i, line in enumerate(lines) if line.rstrip() == "## Compute"), len(lines)
        )
        end = start
    else:
        end = next(
            (i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines)
        )
    return "".join(lines[:start]) + section + "\n" + "".join(lines[end:])


def _size_category(n: int) -> str:
    for bound, name in ((1_000, "n<1K"), (10_000, "1K<n<10K"), (100_000, "10K<n<100K")):
        if n < bound:
            return name
    return "100K<n<1M" if n < 1_000_000 else "n>1M"


def dataset_card(params: Params, facts: Facts) -> str:
    """The card of the month's clean training data (Hugging Face dataset README layout)."""
    clean = facts.clean
    total = clean.train + clean.val if clean else 0
    front = {
        "pretty_name": f"{params.tracking.registered_model} training data",
        "task_categories": ["text-generation"],
        "size_categories": [_size_category(total)],
        "tags": ["tuneloop", "sft", *(["dpo"] if clean and clean.dpo_pairs else [])],
    }
    ingest = facts.ingest
    lines = [
        _front_matter(front),
        f"# {params.tracking.registered_model}: training data (`{params.paths.clean}`)",
        "",
        "Chats for supervised fine-tuning (`train.jsonl`, `val.jsonl`, each line "
        '`{"id", "messages"}`) and preference pairs (`dpo.jsonl`, `{"id", "prompt", '
        '"chosen", "rejected"}`), built by tuneloop\'s `clean` stage from the append-only '
        "pool of ingested records.",
        "",
        "## Sources and months",
        "",
        *_data_lines(params, facts),
        "## Processing",
        "",
    ]
    if ingest is not None:
        reasons, pii = ingest.quarantine_reasons, ingest.pii_scrubbed
        quarantined = f"{ingest.quarantined} quarantined"
        if reasons:
            quarantined += f" ({', '.join(f'{k} {v}' for k, v in sorted(reasons.items()))})"
        # Ingest is shared: a task's card says what of the run was the task's.
        mine = ingest.accepted_by_task.get(params.task) if params.task else None
        of_task = f" ({mine} for task {params.task})" if mine is not None else ""
        lines += [
            f"- ingest (last run{', every task' if params.task else ''}): "
            f"{ingest.lines} lines in, "
            f"{ingest.accepted} accepted{of_task}, {quarantined}, "
            f"{ingest.duplicates} duplicates.",
            "- personal data replaced by typed placeholders before storing: "
            + (", ".join(f"{k} {v}" for k, v in sorted(pii.items())) or "none found")
            + ".",
        ]
    else:
        lines.append("- metrics/ingest.json is missing: ingest counts unknown.")
    removed = clean.removed if clean else {}
    lines += [
        "- clean: chat format normalised, short and degenerate replies and over-long chats "
        "filtered, exact and near duplicates removed, a stable hash split into train and "
        f"validation (`clean.val_fraction` {params.clean.val_fraction}).",
        f"- decontamination: {removed.get('eval_contamination', 0)} chats removed whose user "
        f"turn matches an eval item of any suite under `{params.paths.eval_suites}` "
        f"(MinHash Jaccard >= {params.clean.decontam_threshold}).",
        "",
        "## Lineage",
        "",
        *_lineage_lines(facts, None),
        "",
    ]
    return "\n".join(lines)


@contextlib.contextmanager
def with_card(folders: dict[str, Path], card: Path) -> Iterator[dict[str, Path]]:
    """Copies of ``folders`` with ``card`` as their README.md, for logging to the registry.

    The folders themselves are DVC outs: a card written into them would change what
    ``dvc.lock`` recorded. The copies hard-link every file (no second copy of the
    weights on disk; hence beside the first folder, on its file system) and add the card.
    """
    beside = next(iter(folders.values())).parent
    with tempfile.TemporaryDirectory(prefix=".tuneloop-card-", dir=beside) as tmp:
        copies: dict[str, Path] = {}
        for name, folder in folders.items():
            target = Path(tmp) / name
            shutil.copytree(folder, target, copy_function=_link_or_copy)
            (target / CARD).unlink(missing_ok=True)
            shutil.copyfile(card, target / CARD)
            copies[name] = target
        yield copies


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another file system, or links not allowed: copy instead
        shutil.copy2(src, dst)
