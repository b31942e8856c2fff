"""Stage ``pack``: chats into packed, rank-balanced training shards.

Reads:  ``paths.clean``/train.jsonl and val.jsonl; the base model's tokenizer.
Writes: ``paths.packed``/rank-NNNNN.parquet (one shard per training rank, each
        with exactly the same number of micro-batches), val.parquet,
        manifest.json (counts, tokens per rank, efficiency); ``metrics/pack.json``.
Params: ``pack``, ``batch``, ``model.base``, ``paths``.

The shard schema (one row per bin of ``pack.seq_len`` tokens at most, with the layout TRL's
padding-free collator reads) is ``tuneloop.shards``'s. Tokens go from the tokenizer into flat
numpy arrays and from there into Arrow columns, chunk by chunk.
"""

from __future__ import annotations

import json
import logging
from itertools import islice
from pathlib import Path

import numpy as np
import pyarrow as pa

from tuneloop import lineage, shards
from tuneloop.chat import ChatTokenizer, load_chat_tokenizer, tokenize_chats
from tuneloop.io import atomic_dir, write_json
from tuneloop.models import base_model_ref
from tuneloop.packing import PackResult, balance_ranks, pack_samples
from tuneloop.params import Params, load_params
from tuneloop.stage import logged_after, setup_logging, write_metrics

STAGE = "pack"
log = logging.getLogger(__name__)
# Chats tokenized per batch call; bounds the Python objects alive at once.
CHUNK = 4096


def tokenize_file(path: Path, tokenizer: ChatTokenizer) -> tuple[pa.ListArray, pa.ListArray]:
    """Every chat of a clean file as (input ids, labels) list columns, in file order."""
    ids, labels, lengths = [], [], []
    with path.open(encoding="utf-8") as lines:
        while chunk := [json.loads(line)["messages"] for line in islice(lines, CHUNK)]:
            chunk_ids, chunk_labels, offsets = tokenize_chats(tokenizer, chunk)
            ids.append(chunk_ids)
            labels.append(chunk_labels)
            lengths.append(np.diff(offsets))
    if not lengths:
        empty = pa.array([], pa.list_(pa.int64()))
        return empty, empty
    offsets = pa.array(np.concatenate([[0], np.cumsum(np.concatenate(lengths))]), pa.int32())
    return (
        pa.ListArray.from_arrays(offsets, pa.array(np.concatenate(ids))),
        pa.ListArray.from_arrays(offsets, pa.array(np.concatenate(labels))),
    )


def pack_split(path: Path, tokenizer: ChatTokenizer, params: Params) -> PackResult:
    ids, labels = tokenize_file(path, tokenizer)
    return pack_samples(ids, labels, params.pack.seq_len, params.pack.overlong)


def main() -> None:
    setup_logging()
    params = load_params()
    with logged_after(STAGE, params):
        tokenizer = load_chat_tokenizer(base_model_ref(params))
        train = pack_split(params.paths.clean / "train.jsonl", tokenizer, params)
        val = pack_split(params.paths.clean / "val.jsonl", tokenizer, params)
        batch = params.batch
        plan = balance_ranks(
            train.bins.tokens_per_bin,
            batch.world_size,
            batch.micro_batch_size,
            batch.gradient_accumulation_steps,
        )
        summary = {
            "samples": train.n_samples_in,
            "bins": len(train.bins),
            "real_tokens": train.real_tokens,
            "label_tokens": train.label_tokens,
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
                shards.write_shard(
                    train.bins.select(indices).table(), out / shards.shard_name(rank)
                )
            shards.write_shard(val.bins.table(), out / shards.VAL_SHARD)
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
