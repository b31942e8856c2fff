"""Benchmark ``tuneloop.data.pack.pack_samples`` against ``trl.pack_dataset(strategy="bfd")``.

Synthetic SFT-like samples: lognormal lengths clipped to [8, seq_len], random token ids, the
first 10-90 % of each sample masked as prompt (-100), 1 % of samples masked entirely. Both
packers get the same Arrow table, built before timing: its list columns for ``pack_samples``,
an in-memory ``datasets.Dataset`` over it for TRL; ``pack_samples`` is also timed on Python
lists (what a tokenizer returns), which it converts first. Each is run once to warm up, then
timed ``--repeats`` times; the best time counts. The load average is printed before and after.

    python benchmarks/pack.py                 # 100k samples, seq_len 4096
    python benchmarks/pack.py --samples 20000
"""

from __future__ import annotations

import argparse
import gc
import os
import time
from collections.abc import Callable
from itertools import pairwise
from typing import TypeVar

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from datasets.table import InMemoryTable
from trl import pack_dataset

from tuneloop.data.pack import balance_ranks, pack_samples
from tuneloop.data.shards import IGNORE_INDEX

T = TypeVar("T")


def make_samples(n: int, seq_len: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Flat token ids, flat labels and row offsets of ``n`` long-tailed samples."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(mean=5.5, sigma=1.1, size=n), 8, seq_len).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    token_ids = rng.integers(3, 32_000, size=int(offsets[-1]), dtype=np.int64)
    prompt = (lengths * rng.uniform(0.1, 0.9, size=n)).astype(np.int64)
    all_prompt = rng.random(n) < 0.01
    prompt[all_prompt] = lengths[all_prompt]
    position = np.arange(offsets[-1]) - np.repeat(offsets[:-1], lengths)
    labels = np.where(position < np.repeat(prompt, lengths), IGNORE_INDEX, token_ids)
    return token_ids, labels, offsets


def best_time(fn: Callable[[], T], repeats: int) -> tuple[float, float, T]:
    """Best wall time of ``fn`` alone and of ``fn`` then a full ``gc.collect()``, over ``repeats``
    runs after one warm-up; and the last result.

    The second figure charges a packer for the Python objects it leaves for the garbage
    collector to walk, a cost that otherwise lands on whatever runs next.
    """
    result = fn()
    alone, settled = [], []
    for _ in range(repeats):
        del result
        gc.collect()
        start = time.perf_counter()
        result = fn()
        alone.append(time.perf_counter() - start)
        gc.collect()
        settled.append(time.perf_counter() - start)
    return min(alone), min(settled), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=100_000, help="number of samples to pack")
    parser.add_argument("--seq-len", type=int, default=4096, help="tokens per packed bin")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per packer (best kept)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic samples")
    parser.add_argument("--world-size", type=int, default=8, help="ranks for balance_ranks")
    parser.add_argument("--micro-batch-size", type=int, default=1, help="bins per micro-batch")
    parser.add_argument(
        "--gradient-accumulation-steps", type=int, default=4, help="micro-batches per step"
    )
    args = parser.parse_args()
    datasets.disable_progress_bars()

    token_ids, labels, offsets = make_samples(args.samples, args.seq_len, args.seed)
    ids_rows = [token_ids[a:b].tolist() for a, b in pairwise(offsets)]
    label_rows = [labels[a:b].tolist() for a, b in pairwise(offsets)]
    table = pa.table(
        {
            "input_ids": pa.ListArray.from_arrays(offsets, token_ids),
            "labels": pa.ListArray.from_arrays(offsets, labels),
        }
    )
    dataset = datasets.Dataset(InMemoryTable(table))
    # The input rows are long-lived: keep the cyclic collector from re-walking their 2 x tokens
    # references during either packer's run, which would tax whichever triggers a full collection.
    gc.collect()
    gc.freeze()

    load_before = os.getloadavg()
    trl_s, trl_gc_s, trl_packed = best_time(
        lambda: pack_dataset(dataset, args.seq_len, strategy="bfd"), args.repeats
    )
    ours_s, ours_gc_s, ours = best_time(
        lambda: pack_samples(
            table.column("input_ids"), table.column("labels"), args.seq_len, overlong="truncate"
        ),
        args.repeats,
    )
    lists_s, lists_gc_s, _ = best_time(
        lambda: pack_samples(ids_rows, label_rows, args.seq_len, overlong="truncate"),
        args.repeats,
    )
    trl_tokens = int(pc.sum(pc.list_value_length(trl_packed.data.column("input_ids"))).as_py())
    trl_efficiency = trl_tokens / (len(trl_packed) * args.seq_len)

    balance_s, _, plan = best_time(
        lambda: balance_ranks(
            ours.bins.tokens_per_bin,
            args.world_size,
            args.micro_batch_size,
            args.gradient_accumulation_steps,
        ),
        args.repeats,
    )

    print(
        f"{args.samples:,} samples, {int(offsets[-1]):,} tokens, seq_len {args.seq_len}; "
        f"best of {args.repeats} after a warm-up; {os.cpu_count()} CPU cores; load average "
        f"{load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after"
    )
    print(
        f"{'packer':<24} {'time (s)':>9} {'+ gc (s)':>9} {'bins':>8} {'tokens':>12} "
        f"{'efficiency':>11}"
    )
    print(
        f"{'tuneloop pack_samples':<24} {ours_s:>9.3f} {ours_gc_s:>9.3f} {len(ours.bins):>8,} "
        f"{ours.real_tokens:>12,} {ours.efficiency:>11.5f}"
    )
    print(
        f"{'  same, from lists':<24} {lists_s:>9.3f} {lists_gc_s:>9.3f} {len(ours.bins):>8,} "
        f"{ours.real_tokens:>12,} {ours.efficiency:>11.5f}"
    )
    print(
        f"{'trl pack_dataset bfd':<24} {trl_s:>9.3f} {trl_gc_s:>9.3f} {len(trl_packed):>8,} "
        f"{trl_tokens:>12,} {trl_efficiency:>11.5f}"
    )
    lower_bound = -(-ours.real_tokens // args.seq_len)
    print(f"time ours/trl: {ours_s / trl_s:.2f}; with gc: {ours_gc_s / trl_gc_s:.2f}")
    print(f"bins: {len(ours.bins):,}; lower bound ceil(tokens / seq_len) = {lower_bound:,}")
    print(f"pack_samples: {ours.n_truncated} truncated, {ours.n_no_label} sequences without labels")
    print(
        f"balance_ranks (world_size {args.world_size}, micro_batch_size "
        f"{args.micro_batch_size}, gradient_accumulation_steps "
        f"{args.gradient_accumulation_steps}): {balance_s * 1000:.1f} ms, "
        f"{plan.optimizer_steps} steps, max/min tokens per rank {plan.max_min_token_ratio:.5f}, "
        f"{plan.n_bins_dropped} bins ({plan.tokens_dropped:,} tokens) dropped"
    )


if __name__ == "__main__":
    main()
