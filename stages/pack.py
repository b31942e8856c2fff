"""Stage ``pack``: chats into packed, rank-balanced training shards.

Reads:  ``paths.clean``/train.jsonl and val.jsonl (and the parts clean wrote them in,
        ``train.parts.json`` and ``val.parts.json``); the base model's tokenizer;
        ``paths.pack_cache``.
Writes: ``paths.packed``/rank-NNNNN.parquet (one shard per training rank, each
        with exactly the same number of micro-batches), val.parquet,
        manifest.json (counts, tokens per rank, efficiency); ``paths.pack_cache`` (the
        packed bins of each part, and the token ids and labels of each line, reused for
        the parts and lines clean left as they were); ``metrics/pack.json``.
Params: ``pack``, ``batch``, ``model.base``, ``paths``.

The shard schema (one row per bin of ``pack.seq_len`` tokens at most, with the layout TRL's
padding-free collator reads) is ``tuneloop.data.shards``'s; packing part by part and its cache are
``tuneloop.data.pack_cache``'s. Tokens go from the tokenizer into flat numpy arrays and from there
into Arrow columns, without a Python object per token.
"""

from __future__ import annotations

import logging

from tuneloop.data import pack_cache, shards
from tuneloop.data.chat import ChatTokenizer, load_chat_tokenizer
from tuneloop.data.metrics import PackMetrics
from tuneloop.data.pack import balance_ranks
from tuneloop.data.pack_cache import Packed
from tuneloop.io import atomic_dir, write_json
from tuneloop.models import base_model_ref
from tuneloop.params import Params
from tuneloop.stage import logged_after, setup_logging, stage_params, write_metrics
from tuneloop.tracking import lineage

STAGE = "pack"
log = logging.getLogger(__name__)


def pack_split(split: str, tokenizer: ChatTokenizer, params: Params) -> Packed:
    """Pack a clean file part by part: the parts packed before from ``paths.pack_cache``, the
    others from tokens (the lines tokenized before, from the same cache)."""
    packed = pack_cache.pack_file(
        params.paths.clean / f"{split}.jsonl",
        params.paths.pack_cache,
        split,
        tokenizer,
        params.pack.seq_len,
        params.pack.overlong,
    )
    log.info(
        "pack: %s: %d of %d parts packed before; %d lines tokenized, the rest cached",
        split,
        packed.parts_reused,
        packed.parts,
        packed.lines_tokenized,
    )
    return packed


def main() -> None:
    setup_logging()
    params = stage_params()
    with logged_after(STAGE, params):
        tokenizer = load_chat_tokenizer(base_model_ref(params))
        train_parts = pack_split("train", tokenizer, params)
        val_parts = pack_split("val", tokenizer, params)
        pack_cache.prune(params.paths.pack_cache, [*train_parts.keys, *val_parts.keys])
        train, val = train_parts.result, val_parts.result
        batch = params.batch
        plan = balance_ranks(
            train.bins.tokens_per_bin,
            batch.world_size,
            batch.micro_batch_size,
            batch.gradient_accumulation_steps,
        )
        summary = PackMetrics(
            samples=train.n_samples_in,
            bins=len(train.bins),
            real_tokens=train.real_tokens,
            label_tokens=train.label_tokens,
            efficiency=round(train.efficiency, 6),
            truncated=train.n_truncated,
            dropped_overlong=train.n_dropped,
            split_overlong=train.n_split,
            samples_without_labels=train.n_no_label,
            world_size=batch.world_size,
            micro_batch_size=batch.micro_batch_size,
            gradient_accumulation_steps=batch.gradient_accumulation_steps,
            micro_batches_per_rank=plan.micro_batches_per_rank,
            optimizer_steps_per_epoch=plan.optimizer_steps,
            tokens_per_rank=tuple(plan.tokens_per_rank),
            max_min_rank_token_ratio=round(plan.max_min_token_ratio, 6),
            bins_dropped_for_balance=plan.n_bins_dropped,
            tokens_dropped_for_balance=plan.tokens_dropped,
            val_samples=val.n_samples_in,
            val_bins=len(val.bins),
        )
        with atomic_dir(params.paths.packed) as out:
            for rank, indices in enumerate(plan.shards):
                shards.write_shard(
                    train.bins.select(indices).table(), out / shards.shard_name(rank)
                )
            shards.write_shard(val.bins.table(), out / shards.VAL_SHARD)
            write_json(
                out / "manifest.json",
                lineage.manifest(
                    STAGE, params, inputs={"clean": params.paths.clean}, **summary.model_dump()
                ),
            )
        write_metrics(params, STAGE, summary.model_dump())
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
