"""The packed-shard schema: file names, columns, the ignore label, the writer and the reader.

One file per training rank (``rank-NNNNN.parquet``) and one for validation; each row is
one packed bin of at most ``pack.seq_len`` tokens:

- ``input_ids``: the bin's tokens, sequence after sequence;
- ``labels``: the token id where the token is learned (assistant replies), else
  ``IGNORE_INDEX``;
- ``seq_lengths``: the length of each packed sequence, so TRL's padding-free collator
  restarts position ids at every sequence and attention never crosses two;
- ``sample_indices``: the row of the source file (clean's train.jsonl) each sequence
  came from, so preflight can trace a bin back to its chat (the collator ignores it).

Pack writes, preflight and training read; all of them take the names from here.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

IGNORE_INDEX = -100
"""Label of a token that carries no loss (prompt, padding); the value PyTorch and TRL use."""

VAL_SHARD = "val.parquet"
SHARD_GLOB = "rank-*.parquet"

INPUT_IDS = "input_ids"
LABELS = "labels"
SEQ_LENGTHS = "seq_lengths"
SAMPLE_INDICES = "sample_indices"
REQUIRED_COLUMNS = (INPUT_IDS, LABELS, SEQ_LENGTHS)
"""What the trainer needs."""
SOURCE_COLUMN = SAMPLE_INDICES
"""Written by pack for preflight; a shard without it still trains."""
_VALUES = np.int32
VALUE_TYPE = pa.from_numpy_dtype(_VALUES)
"""Token ids, labels, sequence lengths and row numbers all fit in 32 bits. Parquet writes an
int32 column in about half the time of an int64 one of the same values and reads it in about
60 %, at the same file size (``benchmarks/shard_format.py``, RESULTS.md); the trainer's collator
makes int64 tensors of them. Readers take int64 shards too (hand-made, or from an older pack)."""
SCHEMA = pa.schema([(name, pa.list_(VALUE_TYPE)) for name in (*REQUIRED_COLUMNS, SOURCE_COLUMN)])
_LIMITS = np.iinfo(_VALUES)


def shard_name(rank: int) -> str:
    return f"rank-{rank:05d}.parquet"


def _list_array(offsets: np.ndarray, values: np.ndarray) -> pa.ListArray:
    if values.size and (values.min() < _LIMITS.min or values.max() > _LIMITS.max):
        raise ValueError(
            f"shard values must fit in int32, got [{values.min()}, {values.max()}]; "
            "a token id that large is not from a real vocabulary"
        )
    return pa.ListArray.from_arrays(
        pa.array(offsets, pa.int32()), pa.array(values.astype(_VALUES, copy=False))
    )


def bins_table(
    input_ids: np.ndarray,
    labels: np.ndarray,
    bin_offsets: np.ndarray,
    seq_lengths: np.ndarray,
    sample_indices: np.ndarray,
    seq_offsets: np.ndarray,
) -> pa.Table:
    """A shard table from flat arrays: bin ``b`` holds tokens ``bin_offsets[b]:[b + 1]`` and
    sequences ``seq_offsets[b]:[b + 1]``. No Python object per token or sequence."""
    return pa.Table.from_arrays(
        [
            _list_array(bin_offsets, input_ids),
            _list_array(bin_offsets, labels),
            _list_array(seq_offsets, seq_lengths),
            _list_array(seq_offsets, sample_indices),
        ],
        schema=SCHEMA,
    )


def write_shard(table: pa.Table, path: Path) -> None:
    """Plain-encoded, LZ4. Parquet's default dictionary-encodes every column: on pack's shard
    of a million demo chats (33M tokens) that took 1.44 s to write and 0.97 s to read, against
    0.81 s and 0.31 s plain with LZ4, for a file of 18 MB instead of 25. On uniform ids of a
    32k vocabulary (``benchmarks/shard_format.py``) the dictionary halves the file, for the
    same write time and a slower read. Shards are rewritten every month and read by every
    preflight and training rank; disk is the cheaper of the two."""
    if table.schema != SCHEMA:
        raise ValueError(f"a shard table must have the schema {SCHEMA}, got {table.schema}")
    pq.write_table(table, path, use_dictionary=False, compression="lz4")


def list_column(table: pa.Table, name: str) -> tuple[np.ndarray, np.ndarray]:
    """A list column as (row lengths, flattened values), both numpy, without Python objects."""
    column = table.column(name)
    lengths = pc.list_value_length(column).to_numpy().astype(np.int64, copy=False)
    values = pc.list_flatten(column).to_numpy()
    return lengths, values


def read_shard(path: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Every column of a shard as (row lengths, flattened values)."""
    table = pq.read_table(path)
    return {name: list_column(table, name) for name in table.column_names}
