"""Packed shard file names: one file per training rank, shared by the writer and readers."""

from __future__ import annotations

VAL_SHARD = "val.parquet"


def shard_name(rank: int) -> str:
    return f"rank-{rank:05d}.parquet"
