"""Sequence packing for padding-free training, and an even split of the packed bins across ranks.

``pack_samples`` puts tokenized samples into bins of ``seq_len`` tokens with best-fit decreasing
(BFD), over all of its input at once (the pack stage gives it a part of clean's file at a
time, ``tuneloop.data.pack_cache``). Each bin is a row in TRL's packed format (``input_ids``,
``labels``, ``seq_lengths``), so ``DataCollatorForLanguageModeling(padding_free=True)`` restarts
position ids at every sample and no sample attends to its neighbour.

``balance_ranks`` hands the bins to data-parallel ranks so that every rank runs the same number
of micro-batches and optimizer steps (an uneven count hangs DDP at the end of an epoch), with
real tokens spread as evenly as the bins allow.

Both are pure: same input, same output, no I/O, no randomness. Shuffling is the caller's job.

Tokens stay in flat numpy arrays from input to shard: samples come in as one array of all
tokens plus row offsets (an Arrow list column is that already; Python lists are converted
once), bins go out the same way and become Arrow list columns without a Python object per
token. The earlier list-of-lists bins cost as much again in the garbage collector's walks
over their references as in building them.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from math import inf
from typing import Literal, TypeAlias

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tuneloop.data import shards
from tuneloop.data.shards import IGNORE_INDEX

Overlong = Literal["truncate", "drop", "split"]
# Tokens gathered per index in ``gather_runs``: the index (512 KB) stays in cache; 4M-token
# chunks were 20x slower here, each index a fresh mapping from the kernel.
_GATHER_CHUNK = 1 << 16
_OVERLONG: tuple[Overlong, ...] = ("truncate", "drop", "split")

Rows: TypeAlias = Sequence[Sequence[int]] | pa.ListArray | pa.ChunkedArray
"""Samples: lists of token ids (lists, tuples or 1-D numpy arrays), or an Arrow list column."""


@dataclass(frozen=True, slots=True)
class Bin:
    """One packed row of at most ``seq_len`` tokens, as Python lists (to look at one bin)."""

    input_ids: list[int]
    labels: list[int]
    seq_lengths: list[int]
    """Length of each packed sequence, in order; they sum to ``len(input_ids)``."""
    sample_indices: list[int]
    """Index into the input of each packed sequence (a split sample appears once per chunk)."""


@dataclass(frozen=True, slots=True, eq=False)
class PackedBins:
    """Packed bins as flat arrays: bin ``b`` holds tokens ``bin_offsets[b]:bin_offsets[b + 1]``
    of ``input_ids``/``labels`` and sequences ``seq_offsets[b]:seq_offsets[b + 1]`` of
    ``seq_lengths``/``sample_indices``."""

    input_ids: np.ndarray
    labels: np.ndarray
    bin_offsets: np.ndarray
    seq_lengths: np.ndarray
    sample_indices: np.ndarray
    seq_offsets: np.ndarray

    def __len__(self) -> int:
        return len(self.bin_offsets) - 1

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PackedBins):
            return NotImplemented
        return all(
            np.array_equal(getattr(self, name), getattr(other, name)) for name in self.__slots__
        )

    __hash__ = None  # type: ignore[assignment]

    @property
    def tokens_per_bin(self) -> np.ndarray:
        return np.diff(self.bin_offsets)

    def bin(self, index: int) -> Bin:
        tokens = slice(int(self.bin_offsets[index]), int(self.bin_offsets[index + 1]))
        seqs = slice(int(self.seq_offsets[index]), int(self.seq_offsets[index + 1]))
        return Bin(
            self.input_ids[tokens].tolist(),
            self.labels[tokens].tolist(),
            self.seq_lengths[seqs].tolist(),
            self.sample_indices[seqs].tolist(),
        )

    def select(self, indices: Sequence[int] | np.ndarray) -> PackedBins:
        """The given bins, in the given order."""
        chosen = np.asarray(indices, dtype=np.int64)
        if np.array_equal(chosen, np.arange(len(self))):  # one rank: all of them, as they are
            return self
        tokens = self.tokens_per_bin[chosen]
        seqs = np.diff(self.seq_offsets)[chosen]
        bin_offsets = np.concatenate([[0], np.cumsum(tokens)]).astype(np.int64)
        seq_offsets = np.concatenate([[0], np.cumsum(seqs)]).astype(np.int64)
        input_ids, labels = gather_runs(
            (self.input_ids, self.labels), self.bin_offsets[chosen], tokens, int(bin_offsets[-1])
        )
        seq_lengths, sample_indices = gather_runs(
            (self.seq_lengths, self.sample_indices),
            self.seq_offsets[chosen],
            seqs,
            int(seq_offsets[-1]),
        )
        return PackedBins(input_ids, labels, bin_offsets, seq_lengths, sample_indices, seq_offsets)

    def table(self) -> pa.Table:
        """The bins as a shard table (``tuneloop.data.shards``)."""
        return shards.bins_table(
            self.input_ids,
            self.labels,
            self.bin_offsets,
            self.seq_lengths,
            self.sample_indices,
            self.seq_offsets,
        )


@dataclass(frozen=True, slots=True)
class PackResult:
    bins: PackedBins
    n_samples_in: int
    n_truncated: int
    """Samples cut to ``seq_len`` (``overlong="truncate"``)."""
    n_dropped: int
    """Samples left out for being longer than ``seq_len`` (``overlong="drop"``)."""
    n_split: int
    """Samples cut into ``seq_len`` chunks (``overlong="split"``); each chunk packs on its own."""
    n_no_label: int
    """Packed sequences whose labels are all ``IGNORE_INDEX``: packed anyway, the caller decides."""
    tokens_cut: int
    """Tokens not packed: the cut tails (truncate) or the dropped samples (drop)."""
    real_tokens: int
    label_tokens: int
    """Packed tokens with a label (not ``IGNORE_INDEX``)."""
    efficiency: float
    """``real_tokens / (len(bins) * seq_len)``; 0.0 when there are no bins."""


@dataclass(frozen=True, slots=True)
class RankPlan:
    shards: list[list[int]]
    """Bin indices for each rank, in training order: micro-batch ``j`` of rank ``r`` is
    ``shards[r][j * micro_batch_size : (j + 1) * micro_batch_size]``."""
    micro_batches_per_rank: int
    optimizer_steps: int
    tokens_per_rank: list[int]
    max_min_token_ratio: float
    n_bins_dropped: int
    tokens_dropped: int
    dropped_bins: list[int]
    """Indices of the bins left out so that every rank gets the same number of steps."""


def pack_samples(input_ids: Rows, labels: Rows, seq_len: int, overlong: Overlong) -> PackResult:
    """Pack samples into bins of ``seq_len`` tokens with best-fit decreasing.

    Samples go in longest first (ties by input index), each into the open bin with the least room
    that still fits it, else into a new bin. One pass over the whole dataset packs tighter than
    TRL's ``pack_dataset``, which packs each ``map`` batch of 1000 samples on its own.

    An empty sample, or one whose labels differ in length from its input ids, raises
    ``ValueError``.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be at least 1, got {seq_len}")
    if overlong not in _OVERLONG:
        raise ValueError(f"overlong must be one of {_OVERLONG}, got {overlong!r}")
    if len(labels) != len(input_ids):
        raise ValueError(
            f"input_ids has {len(input_ids)} samples but labels has {len(labels)}; "
            "pass one labels row per sample"
        )
    ids, offsets = _flat(input_ids)
    label_values, label_offsets = _flat(labels)
    lengths = np.diff(offsets)
    _check_rows(lengths, np.diff(label_offsets))

    sources, starts, piece_lengths, n_overlong = _cut_overlong(lengths, seq_len, overlong)
    bins_of_pieces = _best_fit_decreasing(piece_lengths, seq_len)
    pieces_per_bin = np.fromiter(
        map(len, bins_of_pieces), dtype=np.int64, count=len(bins_of_pieces)
    )
    order = np.fromiter(
        chain.from_iterable(bins_of_pieces), dtype=np.int64, count=len(piece_lengths)
    )
    seq_lengths = piece_lengths[order]
    seq_offsets = np.concatenate([[0], np.cumsum(pieces_per_bin)]).astype(np.int64)
    seq_token_starts = np.concatenate([[0], np.cumsum(seq_lengths)]).astype(np.int64)
    bin_offsets = seq_token_starts[seq_offsets]
    real_tokens = int(seq_token_starts[-1])
    out_ids, out_labels = gather_runs(
        (ids, label_values), offsets[sources[order]] + starts[order], seq_lengths, real_tokens
    )
    labelled = out_labels != IGNORE_INDEX
    n_no_label = (
        int(np.count_nonzero(~np.logical_or.reduceat(labelled, seq_token_starts[:-1])))
        if len(seq_lengths)
        else 0
    )
    bins = PackedBins(out_ids, out_labels, bin_offsets, seq_lengths, sources[order], seq_offsets)
    return PackResult(
        bins=bins,
        n_samples_in=len(lengths),
        n_truncated=n_overlong if overlong == "truncate" else 0,
        n_dropped=n_overlong if overlong == "drop" else 0,
        n_split=n_overlong if overlong == "split" else 0,
        n_no_label=n_no_label,
        tokens_cut=int(lengths.sum()) - real_tokens,
        real_tokens=real_tokens,
        label_tokens=int(np.count_nonzero(labelled)),
        efficiency=real_tokens / (len(bins) * seq_len) if len(bins) else 0.0,
    )


def join_packed(parts: Sequence[PackResult], seq_len: int) -> PackResult:
    """Parts packed one after the other as one result: the bins of each part in order, and
    each part's sample indices moved past the samples of the parts before it."""
    if len(parts) == 1:
        return parts[0]
    n_bins = sum(len(p.bins) for p in parts)
    n_tokens = sum(len(p.bins.input_ids) for p in parts)
    n_seqs = sum(len(p.bins.seq_lengths) for p in parts)
    input_ids = np.empty(n_tokens, dtype=np.int32)
    labels = np.empty(n_tokens, dtype=np.int32)
    seq_lengths = np.empty(n_seqs, dtype=np.int64)
    sample_indices = np.empty(n_seqs, dtype=np.int64)
    bin_offsets = np.zeros(n_bins + 1, dtype=np.int64)
    seq_offsets = np.zeros(n_bins + 1, dtype=np.int64)
    bins = tokens = seqs = samples = 0
    for part in parts:
        b = part.bins
        n, t, s = len(b), len(b.input_ids), len(b.seq_lengths)
        input_ids[tokens : tokens + t] = b.input_ids
        labels[tokens : tokens + t] = b.labels
        seq_lengths[seqs : seqs + s] = b.seq_lengths
        sample_indices[seqs : seqs + s] = np.asarray(b.sample_indices) + samples
        bin_offsets[bins + 1 : bins + n + 1] = np.asarray(b.bin_offsets[1:]) + tokens
        seq_offsets[bins + 1 : bins + n + 1] = np.asarray(b.seq_offsets[1:]) + seqs
        bins, tokens, seqs, samples = bins + n, tokens + t, seqs + s, samples + part.n_samples_in
    real_tokens = sum(p.real_tokens for p in parts)
    return PackResult(
        bins=PackedBins(input_ids, labels, bin_offsets, seq_lengths, sample_indices, seq_offsets),
        n_samples_in=samples,
        n_truncated=sum(p.n_truncated for p in parts),
        n_dropped=sum(p.n_dropped for p in parts),
        n_split=sum(p.n_split for p in parts),
        n_no_label=sum(p.n_no_label for p in parts),
        tokens_cut=sum(p.tokens_cut for p in parts),
        real_tokens=real_tokens,
        label_tokens=sum(p.label_tokens for p in parts),
        efficiency=real_tokens / (n_bins * seq_len) if n_bins else 0.0,
    )


def balance_ranks(
    tokens_per_bin: Sequence[int] | np.ndarray,
    world_size: int,
    micro_batch_size: int,
    gradient_accumulation_steps: int,
) -> RankPlan:
    """Give every rank the same number of bins, a whole number of optimizer steps, even tokens.

    ``tokens_per_bin`` is each bin's token count (``PackedBins.tokens_per_bin``). Keeps the
    largest ``steps * world_size * micro_batch_size * gradient_accumulation_steps`` bins and
    drops the rest (the smallest, so the fewest tokens are lost). The kept bins, largest first,
    are dealt in rounds of ``world_size``: in each round the largest bin goes to the rank with
    the fewest tokens so far (longest-processing-time, one bin per rank per round). Ranks
    consume rounds in lockstep, so the ranks' i-th micro-batches hold bins of near-equal size
    and every step is balanced, not only the epoch. Rounds are ordered by their lowest bin
    index, which keeps the caller's bin order as far as balance allows.
    """
    for name, value in (
        ("world_size", world_size),
        ("micro_batch_size", micro_batch_size),
        ("gradient_accumulation_steps", gradient_accumulation_steps),
    ):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    tokens = np.asarray(tokens_per_bin, dtype=np.int64).reshape(-1)
    bins_per_step = world_size * micro_batch_size * gradient_accumulation_steps
    optimizer_steps = len(tokens) // bins_per_step
    if optimizer_steps == 0:
        raise ValueError(
            f"{len(tokens)} bins cannot fill one optimizer step, which takes world_size "
            f"{world_size} x micro_batch_size {micro_batch_size} x gradient_accumulation_steps "
            f"{gradient_accumulation_steps} = {bins_per_step} bins; lower one of those or add data"
        )

    largest_first = np.lexsort((np.arange(len(tokens)), -tokens))
    n_kept = optimizer_steps * bins_per_step
    rounds = largest_first[:n_kept].reshape(-1, world_size)
    dropped = largest_first[n_kept:]

    loads = np.zeros(world_size, dtype=np.int64)
    rank_bins = np.empty_like(rounds)
    if world_size == 1:  # nothing to balance: what the loop gives, without a step per bin
        rank_bins[:] = rounds
        loads[0] = tokens[rounds].sum()
    else:
        for r, round_bins in enumerate(rounds):
            lightest_first = np.argsort(loads, kind="stable")
            rank_bins[r, lightest_first] = round_bins
            loads[lightest_first] += tokens[round_bins]

    in_order = rank_bins[np.argsort(rounds.min(axis=1), kind="stable")]
    return RankPlan(
        shards=in_order.T.tolist(),
        micro_batches_per_rank=len(rounds) // micro_batch_size,
        optimizer_steps=optimizer_steps,
        tokens_per_rank=loads.tolist(),
        # Only hand-made empty bins can leave a rank with no tokens.
        max_min_token_ratio=int(loads.max()) / int(loads.min()) if loads.min() else inf,
        n_bins_dropped=len(dropped),
        tokens_dropped=int(tokens[dropped].sum()),
        dropped_bins=sorted(dropped.tolist()),
    )


def _flat(rows: Rows) -> tuple[np.ndarray, np.ndarray]:
    """(every token, row offsets) of samples, as int64 arrays."""
    if isinstance(rows, pa.ChunkedArray):
        rows = rows.combine_chunks()
    if isinstance(rows, pa.ListArray | pa.LargeListArray):
        if not len(rows):
            return np.zeros(0, dtype=np.int64), np.zeros(1, dtype=np.int64)
        if rows.null_count:
            raise ValueError("samples must not be null; filter null rows out before packing")
        offsets = rows.offsets.to_numpy().astype(np.int64)
        values = pc.list_flatten(rows).to_numpy()
        if values.dtype not in (np.int32, np.int64):
            values = values.astype(np.int64)  # int32 stays: half the memory to touch
        return values, offsets - offsets[0]
    lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    # Numpy rows yield numpy scalars here, lists yield ints; fromiter takes both.
    values = np.fromiter(chain.from_iterable(rows), dtype=np.int64, count=int(offsets[-1]))
    return values, offsets


def gather_runs(
    columns: tuple[np.ndarray, ...],
    starts: np.ndarray,
    lengths: np.ndarray,
    total: int,
    *,
    out: tuple[np.ndarray, ...] | None = None,
    at: np.ndarray | None = None,
) -> tuple[np.ndarray, ...]:
    """Runs ``column[start:start + length]`` of each column, concatenated in the given order.

    A run is a sample or a bin, tens to thousands of tokens, and a month has a million of
    them: a slice copy per run in Python cost seconds. Runs go in chunks of about
    ``_GATHER_CHUNK`` tokens instead, each one index (repeat + arange) and one take, so the
    index never holds more than a chunk (not as much memory again as the data).

    With ``out`` (one array per column) and ``at`` (where each run starts in it), each run is
    written there instead and ``out`` is returned: runs read from several sources (a memory
    map each) go into one output a source at a time, with nothing concatenated first.
    """
    if (out is None) != (at is None):
        raise ValueError("give both out and at, or neither")
    if out is None:
        out = tuple(np.empty(total, dtype=column.dtype) for column in columns)
    starts = np.asarray(starts, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    places_at = None if at is None else np.asarray(at, dtype=np.int64)
    ends = np.cumsum(lengths)
    run, done = 0, 0
    while run < len(lengths):
        # At least one run per chunk, whatever its length.
        stop = max(run + 1, int(np.searchsorted(ends, done + _GATHER_CHUNK, side="right")))
        chunk_lengths = lengths[run:stop]
        size = int(ends[stop - 1]) - done
        within = np.cumsum(chunk_lengths) - chunk_lengths
        step = np.arange(size)
        index = np.repeat(starts[run:stop] - within, chunk_lengths) + step
        if places_at is None:
            for source, target in zip(columns, out, strict=True):
                target[done : done + size] = source[index]
        else:
            places = np.repeat(places_at[run:stop] - within, chunk_lengths) + step
            for source, target in zip(columns, out, strict=True):
                target[places] = source[index]
        run, done = stop, done + size
    return out


def _check_rows(lengths: np.ndarray, label_lengths: np.ndarray) -> None:
    mismatched = np.flatnonzero(lengths != label_lengths)
    if mismatched.size:
        i = int(mismatched[0])
        raise ValueError(
            f"sample {i} has {lengths[i]} input ids but {label_lengths[i]} labels "
            f"({mismatched.size} such samples); labels must align token for token"
        )
    empty = np.flatnonzero(lengths == 0)
    if empty.size:
        raise ValueError(
            f"sample {int(empty[0])} has no tokens ({empty.size} such samples); "
            "filter empty samples out before packing"
        )


def _cut_overlong(
    lengths: np.ndarray, seq_len: int, overlong: Overlong
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """What gets packed: ``(source sample, start in it, length)`` of each piece, and how many
    samples were over ``seq_len``."""
    too_long = lengths > seq_len
    n_overlong = int(too_long.sum())
    if overlong == "truncate" or not n_overlong:
        chunks = np.ones_like(lengths)
    elif overlong == "drop":
        chunks = (~too_long).astype(np.int64)
    else:
        chunks = -(-lengths // seq_len)
    sources = np.repeat(np.arange(len(lengths), dtype=np.int64), chunks)
    first_piece = np.cumsum(chunks) - chunks
    starts = (np.arange(len(sources), dtype=np.int64) - first_piece[sources]) * seq_len
    return sources, starts, np.minimum(lengths[sources] - starts, seq_len), n_overlong


def _best_fit_decreasing(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Piece indices per bin. Open bins are kept by remaining room: a sorted list of the distinct
    room values and, per value, the bins that have it, so the best fit is one C-level bisect."""
    order = np.lexsort((np.arange(len(lengths)), -lengths)).tolist()
    ordered_lengths = lengths[order].tolist()
    bins: list[list[int]] = []
    rooms: list[int] = []
    bins_with_room: dict[int, list[int]] = {}
    for piece, length in zip(order, ordered_lengths, strict=True):
        j = bisect_left(rooms, length)
        if j == len(rooms):
            b = len(bins)
            bins.append([piece])
            left = capacity - length
        else:
            room = rooms[j]
            # Bins with equal room fit equally well; taking the last one is the cheapest fixed rule.
            candidates = bins_with_room[room]
            b = candidates.pop()
            if not candidates:
                del rooms[j]
                del bins_with_room[room]
            bins[b].append(piece)
            left = room - length
        if left:
            same_room = bins_with_room.get(left)
            if same_room is None:
                bins_with_room[left] = [b]
                insort(rooms, left)
            else:
                same_room.append(b)
    return bins
