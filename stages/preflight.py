"""Stage ``preflight``: refuse, in about a second, a run that would hang or waste GPU hours.

Reads:  ``paths.packed`` shards and manifest; the base model's config and tokenizer.
Writes: ``reports/preflight.json`` and ``reports/preflight.md`` (every check
        with its status, detail and duration); ``metrics/preflight.json``.
Params: ``preflight``, ``pack``, ``batch``, ``model.base``, ``paths``.

Every check runs (a failure does not hide the next one); the stage exits
non-zero when any check fails, so ``train`` never starts after it, whether
under ``dvc repro`` or the retrain flow.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import mlflow
import pyarrow.parquet as pq

from tuneloop.chat import IGNORE
from tuneloop.io import write_json, write_text
from tuneloop.models import base_model_ref, model_limits
from tuneloop.params import Params, load_params
from tuneloop.shards import shard_name
from tuneloop.stage import setup_logging, write_metrics
from tuneloop.tracking import stage_run

STAGE = "preflight"
log = logging.getLogger(__name__)
Status = Literal["pass", "warn", "fail"]


@dataclass(frozen=True)
class CheckResult:
    name: str
    status: Status
    detail: str
    seconds: float = 0.0


@dataclass(frozen=True)
class Shards:
    """The packed shards, as columns: what every data check reads."""

    seq_lengths: list[list[list[int]]]  # rank -> bin -> sample lengths
    labels: list[list[list[int]]]  # rank -> bin -> labels
    max_token_id: int

    @classmethod
    def read(cls, folder: Path, world_size: int) -> Shards:
        lengths: list[list[list[int]]] = []
        labels: list[list[list[int]]] = []
        max_id = -1
        for rank in range(world_size):
            path = folder / shard_name(rank)
            if not path.exists():
                lengths.append([])
                labels.append([])
                continue
            table = pq.read_table(path, columns=["input_ids", "labels", "seq_lengths"])
            lengths.append(table.column("seq_lengths").to_pylist())
            labels.append(table.column("labels").to_pylist())
            ids = table.column("input_ids").combine_chunks().flatten()
            if len(ids):
                max_id = max(max_id, int(ids.to_numpy().max()))
        return cls(lengths, labels, max_id)


def check_ranks_balanced(shards: Shards, params: Params) -> CheckResult:
    """Every rank must run the same number of micro-batches, or DDP waits forever at epoch end."""
    micro = params.batch.micro_batch_size
    counts = [-(-len(bins) // micro) for bins in shards.seq_lengths]
    partial = [r for r, bins in enumerate(shards.seq_lengths) if len(bins) % micro]
    if len(set(counts)) > 1 or partial:
        listing = ", ".join(f"rank {r}: {c}" for r, c in enumerate(counts))
        return CheckResult(
            "ranks_balanced",
            "fail",
            f"micro-batches per rank differ ({listing}); ranks with fewer batches leave the "
            "others waiting in a collective at the epoch end (a silent hang). Re-run `pack` "
            "with the same batch.world_size as training.",
        )
    accumulation = params.batch.gradient_accumulation_steps
    if counts[0] % accumulation:
        return CheckResult(
            "ranks_balanced",
            "fail",
            f"{counts[0]} micro-batches per rank is not a multiple of gradient accumulation "
            f"({accumulation}); re-run `pack`.",
        )
    return CheckResult(
        "ranks_balanced",
        "pass",
        f"{counts[0]} micro-batches on each of {len(counts)} rank(s) = "
        f"{counts[0] // accumulation} optimizer steps per epoch",
    )


def check_not_empty(shards: Shards, params: Params) -> CheckResult:
    bins = sum(len(rank) for rank in shards.seq_lengths)
    if bins < params.preflight.min_train_bins:
        return CheckResult(
            "data_not_empty",
            "fail",
            f"{bins} packed bins < preflight.min_train_bins={params.preflight.min_train_bins}",
        )
    return CheckResult("data_not_empty", "pass", f"{bins} packed bins")


def check_labels(shards: Shards, params: Params) -> CheckResult:
    """A sample whose labels are all masked trains nothing and hides a template bug."""
    empty = 0
    for rank_lengths, rank_labels in zip(shards.seq_lengths, shards.labels, strict=True):
        for lengths, labels in zip(rank_lengths, rank_labels, strict=True):
            start = 0
            for length in lengths:
                if all(t == IGNORE for t in labels[start : start + length]):
                    empty += 1
                start += length
    if empty:
        return CheckResult(
            "labels_present",
            "fail",
            f"{empty} sample(s) have no label tokens (no assistant reply survived "
            "tokenization/truncation); check the chat template or pack.overlong",
        )
    return CheckResult("labels_present", "pass", "every sample has label tokens")


def check_lengths(shards: Shards, params: Params, context: int) -> CheckResult:
    longest = max((sum(lengths) for rank in shards.seq_lengths for lengths in rank), default=0)
    limit = min(params.pack.seq_len, context) if context else params.pack.seq_len
    if longest > limit:
        return CheckResult(
            "lengths_fit",
            "fail",
            f"a bin holds {longest} tokens > {limit} (pack.seq_len={params.pack.seq_len}, "
            f"model context={context})",
        )
    if context and params.pack.seq_len > context:
        return CheckResult(
            "lengths_fit",
            "warn",
            f"pack.seq_len={params.pack.seq_len} exceeds the model context {context}",
        )
    return CheckResult("lengths_fit", "pass", f"longest bin {longest} <= {limit} tokens")


def check_vocab(shards: Shards, params: Params, vocab: int) -> CheckResult:
    if shards.max_token_id >= vocab:
        return CheckResult(
            "vocab_fits",
            "fail",
            f"token id {shards.max_token_id} >= embedding size {vocab}: the data was "
            "tokenized with another tokenizer; re-run `pack`",
        )
    return CheckResult("vocab_fits", "pass", f"max token id {shards.max_token_id} < {vocab}")


def run_checks(checks: list[Callable[[], CheckResult]]) -> list[CheckResult]:
    results = []
    for check in checks:
        start = time.perf_counter()
        result = check()
        results.append(
            CheckResult(result.name, result.status, result.detail, time.perf_counter() - start)
        )
    return results


def report_markdown(results: list[CheckResult]) -> str:
    rows = [f"| {r.name} | {r.status} | {r.seconds * 1000:.1f} ms | {r.detail} |" for r in results]
    return "\n".join(["| check | status | time | detail |", "|---|---|---|---|", *rows]) + "\n"


def main() -> None:
    setup_logging()
    params = load_params()
    with stage_run(STAGE, params):
        started = time.perf_counter()
        ref = base_model_ref(params)
        shards = Shards.read(params.paths.packed, params.batch.world_size)
        context, vocab = model_limits(ref)
        results = run_checks(
            [
                lambda: check_not_empty(shards, params),
                lambda: check_ranks_balanced(shards, params),
                lambda: check_labels(shards, params),
                lambda: check_lengths(shards, params, context),
                lambda: check_vocab(shards, params, vocab),
            ]
        )
        elapsed = time.perf_counter() - started
        failed = [r for r in results if r.status == "fail"]
        write_json(
            params.paths.reports / "preflight.json",
            {"seconds": elapsed, "checks": [asdict(r) for r in results]},
        )
        table = report_markdown(results)
        write_text(params.paths.reports / "preflight.md", table)
        write_metrics(
            params,
            STAGE,
            {
                "seconds": round(elapsed, 4),
                "passed": sum(r.status == "pass" for r in results),
                "warnings": sum(r.status == "warn" for r in results),
                "failed": len(failed),
            },
        )
        mlflow.log_text(table, "preflight.md")
        print(table)
        if failed:
            raise SystemExit(
                "preflight refused the run: " + "; ".join(f"{r.name}: {r.detail}" for r in failed)
            )


if __name__ == "__main__":
    main()
