"""Sequence packing for padding-free training, and an even split of the packed bins across ranks.

``pack_samples`` puts tokenized samples into bins of ``seq_len`` tokens with best-fit decreasing
(BFD), over the whole dataset at once. Each bin is a row in TRL's packed format (``input_ids``,
``labels``, ``seq_lengths``), so ``DataCollatorForLanguageModeling(padding_free=True)`` restarts
position ids at every sample and no sample attends to its neighbour.

``balance_ranks`` hands the bins to data-parallel ranks so that every rank runs the same number
of micro-batches and optimizer steps (an uneven count hangs DDP at the end of an epoch), with
real tokens spread as evenly as the bins allow.

Both are pure: same input, same output, no I/O, no randomness. Shuffling is the caller's job.
"""

from __future__ import annotations

import gc
from bisect import bisect_left, insort
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from math import inf
from typing import Literal

import numpy as np

IGNORE_INDEX = -100
"""Label of a token that carries no loss (prompt, padding); the value PyTorch and TRL use."""

Overlong = Literal["truncate", "drop", "split"]
_OVERLONG: tuple[Overlong, ...] = ("truncate", "drop", "split")


@dataclass(frozen=True, slots=True)
class Bin:
    """One packed row of at most ``seq_len`` tokens.

    Fields are Python lists, not numpy arrays: tokenizers return lists, and TRL's collator and
    ``datasets`` take them. Concatenating lists copies references, where converting Python ints
    to numpy costs 15-25 ns a token: on 100k samples the numpy variant took 2-3 times as long.
    The price is paid later: the garbage collector walks every token reference of live bins in
    a full collection (1.7 s for the 87M of a 100k-sample set), so turn bins into arrays or a
    dataset rather than keeping them for a whole training run.
    """

    input_ids: list[int]
    labels: list[int]
    seq_lengths: list[int]
    """Length of each packed sequence, in order; they sum to ``len(input_ids)``."""
    sample_indices: list[int]
    """Index into the input of each packed sequence (a split sample appears once per chunk)."""


@dataclass(frozen=True, slots=True)
class PackResult:
    bins: list[Bin]
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


def pack_samples(
    input_ids: Sequence[Sequence[int]],
    labels: Sequence[Sequence[int]],
    seq_len: int,
    overlong: Overlong,
) -> PackResult:
    """Pack samples into bins of ``seq_len`` tokens with best-fit decreasing.

    Samples go in longest first (ties by input index), each into the open bin with the least room
    that still fits it, else into a new bin. One pass over the whole dataset packs tighter than
    TRL's ``pack_dataset``, which packs each ``map`` batch of 1000 samples on its own.

    Samples may be lists, tuples or 1-D numpy arrays (converted with ``tolist()``). An empty
    sample, or one whose labels differ in length from its input ids, raises ``ValueError``.
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
    ids_rows, label_rows = _as_lists(input_ids), _as_lists(labels)
    n = len(ids_rows)
    lengths = np.fromiter(map(len, ids_rows), dtype=np.int64, count=n)
    _check_rows(lengths, np.fromiter(map(len, label_rows), dtype=np.int64, count=n))

    with _collector_paused():
        pieces = _cut_overlong(ids_rows, label_rows, lengths, seq_len, overlong)
        bins_of_pieces = _best_fit_decreasing(pieces.lengths, seq_len)
        bins = _build_bins(bins_of_pieces, pieces)
        n_no_label = sum(1 for row in pieces.labels if not _has_label(row))

    real_tokens = int(pieces.lengths.sum())
    return PackResult(
        bins=bins,
        n_samples_in=n,
        n_truncated=pieces.n_overlong if overlong == "truncate" else 0,
        n_dropped=pieces.n_overlong if overlong == "drop" else 0,
        n_split=pieces.n_overlong if overlong == "split" else 0,
        n_no_label=n_no_label,
        tokens_cut=int(lengths.sum()) - real_tokens,
        real_tokens=real_tokens,
        efficiency=real_tokens / (len(bins) * seq_len) if bins else 0.0,
    )


def balance_ranks(
    bins: Sequence[Bin],
    world_size: int,
    micro_batch_size: int,
    gradient_accumulation_steps: int,
) -> RankPlan:
    """Give every rank the same number of bins, a whole number of optimizer steps, even tokens.

    Keeps the largest ``steps * world_size * micro_batch_size * gradient_accumulation_steps``
    bins and drops the rest (the smallest, so the fewest tokens are lost). The kept bins, largest
    first, are dealt in rounds of ``world_size``: in each round the largest bin goes to the rank
    with the fewest tokens so far (longest-processing-time, one bin per rank per round). Ranks
    consume rounds in lockstep, so the ranks' i-th micro-batches hold bins of near-equal size and
    every step is balanced, not only the epoch. Rounds are ordered by their lowest bin index, which
    keeps the caller's bin order as far as balance allows.
    """
    for name, value in (
        ("world_size", world_size),
        ("micro_batch_size", micro_batch_size),
        ("gradient_accumulation_steps", gradient_accumulation_steps),
    ):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    bins_per_step = world_size * micro_batch_size * gradient_accumulation_steps
    optimizer_steps = len(bins) // bins_per_step
    if optimizer_steps == 0:
        raise ValueError(
            f"{len(bins)} bins cannot fill one optimizer step, which takes world_size "
            f"{world_size} x micro_batch_size {micro_batch_size} x gradient_accumulation_steps "
            f"{gradient_accumulation_steps} = {bins_per_step} bins; lower one of those or add data"
        )

    tokens = np.fromiter((len(b.input_ids) for b in bins), dtype=np.int64, count=len(bins))
    largest_first = np.lexsort((np.arange(len(bins)), -tokens))
    n_kept = optimizer_steps * bins_per_step
    rounds = largest_first[:n_kept].reshape(-1, world_size)
    dropped = largest_first[n_kept:]

    loads = np.zeros(world_size, dtype=np.int64)
    rank_bins = np.empty_like(rounds)
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


@dataclass(frozen=True, slots=True)
class _Pieces:
    """What gets packed: whole samples, or the kept part or chunks of overlong ones."""

    ids: list[Sequence[int]]
    labels: list[Sequence[int]]
    lengths: np.ndarray
    sources: list[int]
    n_overlong: int


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while bins are built.

    Every new bin list holds thousands of token references, and each collection of the young
    generation walks all of them again (a cache miss per token): on 100k samples that is 4.4 s
    of collection against 0.6 s of building. Nothing built here can form a reference cycle, so
    there is nothing for the collector to find. (The switch is process-wide: other threads'
    cycles wait for the next collection after this returns.)
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _as_lists(rows: Sequence[Sequence[int]]) -> list[Sequence[int]]:
    # Numpy rows would fill the bins with numpy scalars; make them lists of Python ints.
    return [row.tolist() if isinstance(row, np.ndarray) else row for row in rows]


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
    ids_rows: list[Sequence[int]],
    label_rows: list[Sequence[int]],
    lengths: np.ndarray,
    seq_len: int,
    overlong: Overlong,
) -> _Pieces:
    too_long = lengths > seq_len
    n_overlong = int(too_long.sum())
    if not n_overlong:
        return _Pieces(ids_rows, label_rows, lengths, list(range(len(ids_rows))), 0)

    if overlong == "truncate":
        chunks = np.ones_like(lengths)
    elif overlong == "drop":
        chunks = (~too_long).astype(np.int64)
    else:
        chunks = -(-lengths // seq_len)
    sources = np.repeat(np.arange(len(lengths)), chunks)
    first_piece = np.cumsum(chunks) - chunks
    starts = (np.arange(len(sources)) - first_piece[sources]) * seq_len
    piece_lengths = np.minimum(lengths[sources] - starts, seq_len)

    source_list = sources.tolist()
    ids = [ids_rows[s] for s in source_list]
    labels = [label_rows[s] for s in source_list]
    for p in np.flatnonzero(piece_lengths != lengths[sources]).tolist():
        s, start = source_list[p], int(starts[p])
        ids[p] = ids_rows[s][start : start + seq_len]
        labels[p] = label_rows[s][start : start + seq_len]
    return _Pieces(ids, labels, piece_lengths, source_list, n_overlong)


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


def _build_bins(bins_of_pieces: list[list[int]], pieces: _Pieces) -> list[Bin]:
    lengths, sources = pieces.lengths.tolist(), pieces.sources
    return [
        Bin(
            input_ids=ids,
            labels=labels,
            seq_lengths=[lengths[p] for p in members],
            sample_indices=[sources[p] for p in members],
        )
        for members, ids, labels in zip(
            bins_of_pieces,
            _concatenate(pieces.ids, bins_of_pieces),
            _concatenate(pieces.labels, bins_of_pieces),
            strict=True,
        )
    ]


def _concatenate(rows: list[Sequence[int]], bins_of_pieces: list[list[int]]) -> list[list[int]]:
    # list += list copies references in C; one column at a time keeps the cache warmer.
    concatenated = []
    for members in bins_of_pieces:
        row: list[int] = []
        for p in members:
            row += rows[p]
        concatenated.append(row)
    return concatenated


_IS_LABEL = IGNORE_INDEX.__ne__


def _has_label(row: Sequence[int]) -> bool:
    # Scan from the end, where the (labelled) response usually is; stops at the first label.
    return any(map(_IS_LABEL, reversed(row)))
