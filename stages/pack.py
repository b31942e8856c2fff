"""Stage ``pack``: chats into packed, rank-balanced training shards.

Reads:  ``paths.clean``/train.jsonl and val.jsonl; the base model's tokenizer.
Writes: ``paths.packed``/rank-NNNNN.parquet (one shard per training rank, each
        with exactly the same number of micro-batches), val.parquet,
        manifest.json (counts, tokens per rank, efficiency); ``metrics/pack.json``.
Params: ``pack``, ``batch``, ``model.base``, ``paths``.

Each row is one bin of ``pack.seq_len`` tokens at most: ``input_ids``,
``labels`` (assistant tokens only) and ``seq_lengths``, the layout TRL's
padding-free collator reads to restart position ids at every sample, so
attention never crosses samples; ``sample_indices`` gives each packed
sequence's row in the source file (the collator ignores it).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from tuneloop import lineage
from tuneloop.chat import IGNORE, tokenize_chat
from tuneloop.io import atomic_dir, read_jsonl, write_json
from tuneloop.models import base_model_ref, load_tokenizer
from tuneloop.packing import Bin, PackResult, balance_ranks, pack_samples
from tuneloop.params import Params, load_params
from tuneloop.shards import VAL_SHARD, shard_name
from tuneloop.stage import setup_logging, write_metrics
from tuneloop.tracking import stage_run

STAGE = "pack"
log = logging.getLogger(__name__)


def bins_table(bins: list[Bin]) -> pa.Table:
    def as_list(values: Any) -> list[int]:
        return values.tolist() if hasattr(values, "tolist") else list(values)

    return pa.table(
        {
            "input_ids": [as_list(b.input_ids) for b in bins],
            "labels": [as_list(b.labels) for b in bins],
            "seq_lengths": [as_list(b.seq_lengths) for b in bins],
            # Row of the input file each sequence came from: preflight traces bins back to chats.
            "sample_indices": [as_list(b.sample_indices) for b in bins],
        }
    )


def tokenize_file(path: Path, tokenizer: Any) -> tuple[list[list[int]], list[list[int]]]:
    ids, labels = [], []
    for sample in read_jsonl(path):
        tokens = tokenize_chat(tokenizer, sample["messages"])
        ids.append(tokens.input_ids)
        labels.append(tokens.labels)
    return ids, labels


def pack_split(path: Path, tokenizer: Any, params: Params) -> PackResult:
    ids, labels = tokenize_file(path, tokenizer)
    return pack_samples(ids, labels, params.pack.seq_len, params.pack.overlong)


def main() -> None:
    setup_logging()
    params = load_params()
    with stage_run(STAGE, params):
        tokenizer = load_tokenizer(base_model_ref(params))
        train = pack_split(params.paths.clean / "train.jsonl", tokenizer, params)
        val = pack_split(params.paths.clean / "val.jsonl", tokenizer, params)
        batch = params.batch
        plan = balance_ranks(
            train.bins, batch.world_size, batch.micro_batch_size, batch.gradient_accumulation_steps
        )
        label_tokens = sum(sum(1 for t in b.labels if t != IGNORE) for b in train.bins)
        summary = {
            "samples": train.n_samples_in,
            "bins": len(train.bins),
            "real_tokens": train.real_tokens,
            "label_tokens": label_tokens,
            "efficiency": round(train.efficiency, 6),
            "truncated": train.n_truncated,
            "dropped_overlong": train.n_dropped,
            "split_overlong": train.n_split,
            "samples_without_labels": train.n_no_label,
            "world_size": batch.world_size,
            "micro_batch_size": batch.micro_batch_size,
            "gradient_accumulation_steps": batch.gradient_accumulation_steps,
            "micro_batches_per_rank": plan.micro_batches_per_rank,
            "optimizer_steps_per_epoch": plan.optimizer_steps,
            "tokens_per_rank": plan.tokens_per_rank,
            "max_min_rank_token_ratio": round(plan.max_min_token_ratio, 6),
            "bins_dropped_for_balance": plan.n_bins_dropped,
            "tokens_dropped_for_balance": plan.tokens_dropped,
            "val_samples": val.n_samples_in,
            "val_bins": len(val.bins),
        }
        with atomic_dir(params.paths.packed) as out:
            for rank, indices in enumerate(plan.shards):
                pq.write_table(bins_table([train.bins[i] for i in indices]), out / shard_name(rank))
            pq.write_table(bins_table(val.bins), out / VAL_SHARD)
            write_json(
                out / "manifest.json",
                lineage.manifest(STAGE, params, inputs={"clean": params.paths.clean}, **summary),
            )
        write_metrics(params, STAGE, summary)
        log.info(
            "pack: %d samples -> %d bins (efficiency %.1f%%), %d micro-batches on each of %d ranks",
            train.n_samples_in,
            len(train.bins),
            100 * train.efficiency,
            plan.micro_batches_per_rank,
            batch.world_size,
        )


if __name__ == "__main__":
    main()
