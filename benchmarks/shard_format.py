"""Time writing and reading a packed shard's token columns: int64 against int32, and
Parquet's default encoding against the plain + LZ4 that ``tuneloop.data.shards`` writes.

pack writes one Parquet shard per rank (``tuneloop.data.shards``); preflight and training read
them. Two list columns (``input_ids``, ``labels``) of ``--tokens`` values in bins of
``--seq-len``: ids uniform below 32,000, 40 % of labels masked (-100). Each layout is written
once and read ``--repeats`` times (best), in this process, one after the other: int64 and
int32 with pyarrow's default writer options (dictionary encoding, snappy), then int32 plain
(no dictionary) with LZ4, as pack writes it. The load average is printed.

    python benchmarks/shard_format.py
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


def table(ids: np.ndarray, labels: np.ndarray, seq_len: int, dtype: type) -> pa.Table:
    offsets = pa.array(np.r_[np.arange(0, len(ids), seq_len), len(ids)], pa.int32())
    return pa.table(
        {
            "input_ids": pa.ListArray.from_arrays(offsets, pa.array(ids.astype(dtype))),
            "labels": pa.ListArray.from_arrays(offsets, pa.array(labels.astype(dtype))),
        }
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=20_000_000)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 32_000, args.tokens)
    labels = np.where(rng.random(args.tokens) < 0.4, -100, ids)
    print(f"load average (1 min) before: {os.getloadavg()[0]:.2f}; {os.cpu_count()} cores")
    print("layout           write (s)  read best (s)  size (MB)")
    with tempfile.TemporaryDirectory() as tmp:
        layouts: tuple[tuple[str, type, dict[str, Any]], ...] = (
            ("int64", np.int64, {}),
            ("int32", np.int32, {}),
            ("int32 plain lz4", np.int32, {"use_dictionary": False, "compression": "lz4"}),
        )
        for name, dtype, options in layouts:
            path = Path(tmp) / f"{name.replace(' ', '-')}.parquet"
            built = table(ids, labels, args.seq_len, dtype)
            start = time.perf_counter()
            pq.write_table(built, path, **options)
            wrote = time.perf_counter() - start
            best = float("inf")
            for _ in range(args.repeats):
                start = time.perf_counter()
                pq.read_table(path).column("input_ids").combine_chunks().values.to_numpy()
                best = min(best, time.perf_counter() - start)
            size = path.stat().st_size / 1e6
            print(f"{name:15}  {wrote:9.2f}  {best:13.2f}  {size:9.0f}")
    print(f"load average (1 min) after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
