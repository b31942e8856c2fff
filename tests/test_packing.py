"""Packing and rank balancing: tokens kept exactly once, bins within bounds, TRL-compatible
position ids, equal work per rank, determinism, and packing at least as tight as TRL's."""

from __future__ import annotations

import copy
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from trl import pack_dataset
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

from tuneloop.data import pack, shards
from tuneloop.data.pack import (
    Bin,
    Overlong,
    PackResult,
    balance_ranks,
    pack_samples,
)
from tuneloop.data.shards import IGNORE_INDEX

# The fast tier: no pipeline, server or rank.
pytestmark = pytest.mark.fast

OVERLONG: tuple[Overlong, ...] = ("truncate", "drop", "split")


@st.composite
def samples(draw: st.DrawFn) -> tuple[list[list[int]], list[list[int]], int]:
    """Samples whose token ids are unique across the dataset, so each token can be traced."""
    seq_len = draw(st.integers(1, 48))
    lengths = draw(st.lists(st.integers(1, 2 * seq_len + 3), max_size=40))
    masks = [draw(st.lists(st.booleans(), min_size=n, max_size=n)) for n in lengths]
    input_ids, labels, next_id = [], [], 0
    for mask in masks:
        ids = list(range(next_id, next_id + len(mask)))
        next_id += len(mask)
        input_ids.append(ids)
        labels.append([t if keep else IGNORE_INDEX for t, keep in zip(ids, mask, strict=True)])
    return input_ids, labels, seq_len


def expected_pieces(
    input_ids: list[list[int]], labels: list[list[int]], seq_len: int, overlong: Overlong
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """What should be packed, written the obvious way."""
    pieces = []
    for ids, labs in zip(input_ids, labels, strict=True):
        if len(ids) > seq_len and overlong == "drop":
            continue
        stop = seq_len if overlong == "truncate" else len(ids)
        for start in range(0, stop, seq_len):
            end = min(start + seq_len, stop)
            pieces.append((tuple(ids[start:end]), tuple(labs[start:end])))
    return pieces


def bins(result: PackResult) -> list[Bin]:
    return [result.bins.bin(i) for i in range(len(result.bins))]


def packed_pieces(result: PackResult) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    pieces = []
    for b in bins(result):
        start = 0
        for n in b.seq_lengths:
            pieces.append(
                (tuple(b.input_ids[start : start + n]), tuple(b.labels[start : start + n]))
            )
            start += n
    return pieces


@settings(max_examples=200, deadline=None)
@given(samples(), st.sampled_from(OVERLONG))
def test_every_kept_token_is_packed_exactly_once(
    data: tuple[list[list[int]], list[list[int]], int], overlong: Overlong
) -> None:
    input_ids, labels, seq_len = data
    result = pack_samples(input_ids, labels, seq_len, overlong)
    expected = expected_pieces(input_ids, labels, seq_len, overlong)

    assert sorted(packed_pieces(result)) == sorted(expected)
    packed_labels = Counter(t for b in bins(result) for t in b.labels if t != IGNORE_INDEX)
    kept_labels = Counter(t for _, labs in expected for t in labs if t != IGNORE_INDEX)
    assert packed_labels == kept_labels
    assert set(packed_labels.values()) <= {1}

    n_overlong = sum(len(ids) > seq_len for ids in input_ids)
    assert result.n_samples_in == len(input_ids)
    assert result.n_truncated == (n_overlong if overlong == "truncate" else 0)
    assert result.n_dropped == (n_overlong if overlong == "drop" else 0)
    assert result.n_split == (n_overlong if overlong == "split" else 0)
    assert result.n_no_label == sum(set(labs) == {IGNORE_INDEX} for _, labs in expected)
    assert result.real_tokens == sum(len(ids) for ids, _ in expected)
    assert result.tokens_cut == sum(map(len, input_ids)) - result.real_tokens
    assert result.label_tokens == sum(packed_labels.values())
    if len(result.bins):
        assert result.efficiency == result.real_tokens / (len(result.bins) * seq_len)
    assert result.bins.tokens_per_bin.tolist() == [len(b.input_ids) for b in bins(result)]
    for b in bins(result):
        assert len(b.input_ids) == len(b.labels) == sum(b.seq_lengths) <= seq_len
        assert len(b.sample_indices) == len(b.seq_lengths)


@settings(max_examples=200, deadline=None)
@given(samples(), st.sampled_from(OVERLONG))
def test_no_two_bins_would_fit_in_one(
    data: tuple[list[list[int]], list[list[int]], int], overlong: Overlong
) -> None:
    # Any best-fit packing has this; next-fit or a broken room index would not.
    input_ids, labels, seq_len = data
    fills = sorted(
        sum(b.seq_lengths) for b in bins(pack_samples(input_ids, labels, seq_len, overlong))
    )
    if len(fills) >= 2:
        assert fills[0] + fills[1] > seq_len


def test_best_fit_decreasing_on_a_small_case() -> None:
    lengths = [4, 6, 5, 5, 3]
    ids = [[i] * n for i, n in enumerate(lengths)]
    result = pack_samples(ids, ids, seq_len=10, overlong="truncate")
    # 6 opens a bin (room 4); the first 5 opens one (room 5); the second 5 takes the room-5 bin;
    # 4 fills the 6; 3 opens a third bin.
    assert [b.sample_indices for b in bins(result)] == [[1, 0], [2, 3], [4]]
    assert [b.seq_lengths for b in bins(result)] == [[6, 4], [5, 5], [3]]
    assert result.efficiency == 23 / 30


def test_trl_collator_restarts_position_ids_per_sample() -> None:
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 200, size=300)
    ids = [rng.integers(0, 1000, size=n).tolist() for n in lengths]
    result = pack_samples(ids, ids, seq_len=512, overlong="split")
    collator = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)
    for b in bins(result)[:20]:
        batch = collator(
            [{"input_ids": b.input_ids, "labels": b.labels, "seq_lengths": b.seq_lengths}]
        )
        expected = torch.cat([torch.arange(n) for n in b.seq_lengths])
        assert torch.equal(batch["position_ids"][0], expected)
        assert batch["cu_seq_lens_q"].tolist() == np.cumsum([0, *b.seq_lengths]).tolist()


def long_tailed(n: int, seq_len: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(4.0, 1.1, size=n), 1, 2 * seq_len).astype(int)
    return [rng.integers(3, 1000, size=k).tolist() for k in lengths]


@pytest.mark.parametrize("trl_batch", [1000, None], ids=["trl-default-batches", "trl-one-batch"])
def test_packs_at_least_as_tight_as_trl(trl_batch: int | None) -> None:
    seq_len = 512
    ids = long_tailed(3000, seq_len, seed=7)
    ours = pack_samples(ids, ids, seq_len, overlong="truncate")

    dataset = datasets.Dataset.from_dict({"input_ids": ids})
    map_kwargs = {"batch_size": trl_batch if trl_batch else len(dataset)}
    theirs = pack_dataset(dataset, seq_len, strategy="bfd", map_kwargs=map_kwargs)
    their_tokens = sum(map(len, theirs["input_ids"]))
    assert ours.real_tokens == their_tokens
    assert len(ours.bins) <= len(theirs)
    assert ours.efficiency >= their_tokens / (len(theirs) * seq_len)


def test_deterministic_and_leaves_input_alone() -> None:
    ids = long_tailed(2000, 256, seed=3)
    labels = [[IGNORE_INDEX] * (len(x) // 2) + x[len(x) // 2 :] for x in ids]
    before = copy.deepcopy((ids, labels))
    first = pack_samples(ids, labels, 256, overlong="split")
    assert pack_samples(ids, labels, 256, overlong="split") == first
    assert (ids, labels) == before
    plan = balance_ranks(first.bins.tokens_per_bin, 3, 2, 2)
    assert balance_ranks(first.bins.tokens_per_bin, 3, 2, 2) == plan


def test_numpy_rows_pack_like_lists() -> None:
    ids = long_tailed(500, 128, seed=5)
    as_arrays = [np.array(x) for x in ids]
    # Not in the signature (an array is no Sequence to mypy), but accepted at run time.
    from_arrays = pack_samples(as_arrays, as_arrays, 128, overlong="split")  # type: ignore[arg-type]
    assert from_arrays == pack_samples(ids, ids, 128, overlong="split")
    assert type(from_arrays.bins.bin(0).input_ids[0]) is int


def test_arrow_rows_pack_like_lists_and_shards_round_trip(tmp_path: Path) -> None:
    ids = long_tailed(600, 128, seed=6)
    labels = [[IGNORE_INDEX] * (len(x) // 3) + x[len(x) // 3 :] for x in ids]
    expected = pack_samples(ids, labels, 128, overlong="split")
    id_column = pa.array(ids, pa.list_(pa.int64()))
    label_column = pa.array(labels, pa.list_(pa.int64()))
    assert pack_samples(id_column, label_column, 128, overlong="split") == expected
    # A chunked column whose chunks are slices of a bigger array, as a read Parquet file gives.
    chunked = pa.chunked_array([id_column.slice(0, 250), id_column.slice(250)])
    chunked_labels = pa.chunked_array([label_column.slice(0, 99), label_column.slice(99)])
    assert pack_samples(chunked, chunked_labels, 128, overlong="split") == expected

    chosen = [5, 0, 3, len(expected.bins) - 1]
    path = tmp_path / shards.shard_name(0)
    shards.write_shard(expected.bins.select(chosen).table(), path)
    assert pq.read_table(path).to_pylist() == [asdict(expected.bins.bin(i)) for i in chosen]
    columns = shards.read_shard(path)
    assert columns[shards.INPUT_IDS][0].tolist() == [
        len(expected.bins.bin(i).input_ids) for i in chosen
    ]


def test_int32_shards_reach_the_trainer_as_int64_tensors(tmp_path: Path) -> None:
    ids = long_tailed(200, 128, seed=8)
    packed = pack_samples(ids, ids, 128, overlong="split")
    path = tmp_path / shards.shard_name(0)
    shards.write_shard(packed.bins.table(), path)
    assert pq.read_schema(path).field(shards.INPUT_IDS).type == pa.list_(pa.int32())
    # As training reads a shard (tuneloop.training.methods.rank_shard) and TRL collates it.
    rows = datasets.Dataset.from_parquet(str(path))
    collator = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)
    batch = collator([rows[0], rows[1]])
    assert batch["input_ids"].dtype == batch["labels"].dtype == torch.int64
    first = packed.bins.bin(0).input_ids + packed.bins.bin(1).input_ids
    assert batch["input_ids"][0].tolist() == first


def test_a_value_past_int32_is_refused_not_wrapped() -> None:
    packed = pack_samples([[1, 2, 3]], [[1, 2, 2**31]], 8, overlong="split")
    with pytest.raises(ValueError, match="must fit in int32"):
        packed.bins.table()


def test_bad_input_names_the_sample() -> None:
    with pytest.raises(ValueError, match="sample 1 has 2 input ids but 1 labels"):
        pack_samples([[1], [2, 3]], [[1], [2]], 8, "truncate")
    with pytest.raises(ValueError, match="sample 1 has no tokens"):
        pack_samples([[1], []], [[1], []], 8, "truncate")
    with pytest.raises(ValueError, match="input_ids has 2 samples but labels has 1"):
        pack_samples([[1], [2]], [[1]], 8, "truncate")
    with pytest.raises(ValueError, match="overlong must be one of"):
        pack_samples([[1]], [[1]], 8, "wrap")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="seq_len must be at least 1"):
        pack_samples([[1]], [[1]], 0, "truncate")


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(1, 4096), max_size=400),
    world_size=st.integers(1, 16),
    micro_batch_size=st.integers(1, 4),
    accumulation=st.integers(1, 4),
)
def test_every_rank_gets_the_same_whole_steps(
    tokens: list[int], world_size: int, micro_batch_size: int, accumulation: int
) -> None:
    per_step = world_size * micro_batch_size * accumulation
    if len(tokens) < per_step:
        with pytest.raises(ValueError, match=f"{len(tokens)} bins cannot fill one optimizer step"):
            balance_ranks(tokens, world_size, micro_batch_size, accumulation)
        return
    plan = balance_ranks(tokens, world_size, micro_batch_size, accumulation)

    assert len(plan.shards) == world_size
    assert {len(shard) for shard in plan.shards} == {plan.micro_batches_per_rank * micro_batch_size}
    assert plan.micro_batches_per_rank == plan.optimizer_steps * accumulation
    assert plan.optimizer_steps == len(tokens) // per_step

    kept = [i for shard in plan.shards for i in shard]
    assert sorted(kept + plan.dropped_bins) == list(range(len(tokens)))
    assert plan.n_bins_dropped == len(plan.dropped_bins) < per_step
    assert plan.tokens_dropped == sum(tokens[i] for i in plan.dropped_bins)
    if plan.dropped_bins:
        assert max(tokens[i] for i in plan.dropped_bins) <= min(tokens[i] for i in kept)

    assert plan.tokens_per_rank == [sum(tokens[i] for i in shard) for shard in plan.shards]
    assert max(plan.tokens_per_rank) - min(plan.tokens_per_rank) <= max(tokens[i] for i in kept)
    assert plan.max_min_token_ratio == max(plan.tokens_per_rank) / min(plan.tokens_per_rank)


def test_too_little_data_says_what_to_change() -> None:
    with pytest.raises(ValueError, match=r"5 bins .* = 16 bins; lower one of those or add data"):
        balance_ranks([10] * 5, 4, 2, 2)


def test_ranks_step_through_bins_of_similar_size() -> None:
    # One bin per rank per round: the ranks' i-th micro-batches are near-equal in tokens.
    rng = np.random.default_rng(0)
    tokens = rng.integers(100, 4097, size=1000).tolist()
    plan = balance_ranks(tokens, 8, 1, 1)
    per_step = np.array([[tokens[i] for i in shard] for shard in plan.shards])
    spread = per_step.max(axis=0) - per_step.min(axis=0)
    assert spread.max() <= 4096 - 100
    assert np.median(spread) < 100
    assert plan.max_min_token_ratio < 1.01


@pytest.mark.parametrize("chunk", [5, 1 << 16])
def test_runs_gathered_a_source_at_a_time_land_where_one_gather_puts_them(
    chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tokencache reads each cached segment where it lies and writes its lines' runs into
    one output (``out``/``at``): the same arrays as one gather over the joined sources."""
    monkeypatch.setattr(pack, "_GATHER_CHUNK", chunk)  # runs cut across chunks too
    rng = np.random.default_rng(3)
    sources = []
    for _ in range(3):
        lengths = rng.integers(1, 9, size=40)
        ids = rng.integers(0, 1000, size=int(lengths.sum()), dtype=np.int32)
        sources.append((ids, -ids, lengths))
    counts = [len(s[2]) for s in sources]
    wanted = rng.permutation(sum(counts))[:70]  # lines of all sources, interleaved
    joined = [np.concatenate([s[i] for s in sources]) for i in range(3)]
    starts = np.cumsum(joined[2]) - joined[2]
    lengths = joined[2][wanted]
    expected = pack.gather_runs((joined[0], joined[1]), starts[wanted], lengths, int(lengths.sum()))

    at = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    out = (np.full(int(lengths.sum()), -7, np.int32), np.full(int(lengths.sum()), -7, np.int32))
    first = np.concatenate([[0], np.cumsum(counts)])
    for s, (ids, labels, source_lengths) in enumerate(sources):
        rows = np.flatnonzero((wanted >= first[s]) & (wanted < first[s + 1]))
        local = wanted[rows] - first[s]
        source_starts = (np.cumsum(source_lengths) - source_lengths)[local]
        total = int(lengths[rows].sum())
        pack.gather_runs((ids, labels), source_starts, lengths[rows], total, out=out, at=at[rows])
    assert [a.tolist() for a in out] == [a.tolist() for a in expected]
    with pytest.raises(ValueError, match="both out and at"):
        pack.gather_runs((joined[0],), starts[:1], lengths[:1], 1, out=out)
