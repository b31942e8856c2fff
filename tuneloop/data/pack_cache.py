"""pack part by part, with each part's packed bins kept from one pack to the next.

Trained from the base, a month's training set is the whole pool: everything last month
packed, and the new batch. Packed as one set, every line is looked up in the token cache and
every bin packed and gathered again each month, work that follows the pool. So a file is
packed in parts, the runs of lines clean wrote segment by segment (``tuneloop.data.clean_parts``),
grouped until a part holds ``PART_MIN_LINES`` lines: each part is packed on its own, and its
bins (a shard file, ``tuneloop.data.shards``) and counts are kept in ``paths.pack_cache``/parts
under a key of the part's bytes, the tokenizer and code (``tokencache.fingerprint``), this
module and ``tuneloop.data.pack``, and ``pack.seq_len`` and ``pack.overlong``. A month then
reads the parts it packed before and packs the lines of the new ones; their tokens come
from the token cache (``tuneloop.data.token_cache``) for the lines it holds.

The parts are the same with the cache or without it (they follow clean's files, never
the cache), so the shards are too (``tests/test_pack_cache.py``). Packing parts alone costs
a few bins per part against one pass over everything (the last bins of a part have fewer
small samples left to fill them): on a million demo records, 24 parts, 132,797 bins against
132,691 (0.08 % more, the same 97.0 % efficiency). Only the last part grows
month to month: an earlier one is closed once it holds enough lines. From last month's
champion, the older parts are a new replay share each month (``clean.replay_fraction``) and
are packed again, from cached tokens.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import xxhash

from tuneloop.data import clean_parts, shards, token_cache
from tuneloop.data.chat import ChatTokenizer
from tuneloop.data.pack import Overlong, PackedBins, PackResult, join_packed, pack_samples
from tuneloop.io import read_json, remove_all_but, write_json

log = logging.getLogger(__name__)

PARTS = "parts"
# A part closes once it holds this many lines (about 3,000 bins of the demo's 256 tokens).
PART_MIN_LINES = 20_000
# PackResult's counts kept beside a part's bins (the bins themselves are the shard file).
_COUNTS = (
    "n_samples_in",
    "n_truncated",
    "n_dropped",
    "n_split",
    "n_no_label",
    "tokens_cut",
    "real_tokens",
    "label_tokens",
)


@dataclass(frozen=True)
class Packed:
    result: PackResult
    parts: int
    parts_reused: int
    lines_tokenized: int
    keys: list[str]
    """The cache entries of this file's parts (``prune`` keeps them)."""


def part_ranges(parts: list[clean_parts.Part], min_lines: int) -> list[range]:
    """Byte ranges of clean's parts grouped in file order, each closed at ``min_lines`` lines.

    The grouping of the earlier parts does not depend on the later ones: a file that grows
    at its end keeps every closed range, and only its last one changes.
    """
    ranges, start, end, lines = [], 0, 0, 0
    for part in parts:
        end, lines = end + part.size, lines + part.lines
        if lines >= min_lines:
            ranges.append(range(start, end))
            start, lines = end, 0
    if end > start:
        ranges.append(range(start, end))
    return ranges


def fingerprint(tokenizer: ChatTokenizer, seq_len: int, overlong: Overlong) -> str:
    """What a part's bins depend on besides its bytes."""
    code = Path(__file__).parent
    digest = hashlib.sha256(f"{token_cache.fingerprint(tokenizer)}\0{seq_len}\0{overlong}".encode())
    for name in ("pack.py", "pack_cache.py"):
        digest.update((code / name).read_bytes())
    return digest.hexdigest()


def pack_file(
    path: Path,
    cache: Path | None,
    split: str,
    tokenizer: ChatTokenizer,
    seq_len: int,
    overlong: Overlong,
) -> Packed:
    """Pack clean's ``path`` part by part, reusing the parts ``cache`` holds.

    ``cache`` is ``paths.pack_cache`` (the parts go in its ``parts`` folder, the token cache
    in its ``split`` folder); None packs everything and keeps nothing.
    """
    data = path.read_bytes()
    ranges = part_ranges(clean_parts.read(path, data), PART_MIN_LINES)
    config = fingerprint(tokenizer, seq_len, overlong)
    keys = [
        hashlib.sha256(
            f"{config}\0{xxhash.xxh3_128_hexdigest(data[r.start : r.stop])}".encode()
        ).hexdigest()[:40]
        for r in ranges
    ]
    folder = cache / PARTS if cache is not None else None
    results = [_load(folder, key, seq_len) if folder is not None else None for key in keys]
    missing = [i for i, result in enumerate(results) if result is None]
    lines = [token_cache.split_lines(data[ranges[i].start : ranges[i].stop]) for i in missing]
    del data
    tokenized = 0
    if missing:
        tokens_dir = cache / split if cache is not None else None
        fresh, tokenized = _pack_parts(lines, tokens_dir, tokenizer, seq_len, overlong)
        for i, packed in zip(missing, fresh, strict=True):
            if folder is not None:
                _save(folder, keys[i], packed)
            results[i] = packed
    return Packed(
        result=join_packed([r for r in results if r is not None], seq_len),
        parts=len(ranges),
        parts_reused=len(ranges) - len(missing),
        lines_tokenized=tokenized,
        keys=keys,
    )


def _pack_parts(
    parts: list[list[bytes]],
    tokens_dir: Path | None,
    tokenizer: ChatTokenizer,
    seq_len: int,
    overlong: Overlong,
) -> tuple[list[PackResult], int]:
    """Each part's lines packed on its own, tokenized in one call (one look-up in the token
    cache), and how many lines were not in the token cache."""
    tokens = token_cache.tokens_of_lines(
        [line for part in parts for line in part], tokens_dir, tokenizer
    )
    packed, first = [], 0
    for part in parts:
        offsets = tokens.offsets[first : first + len(part) + 1]
        first += len(part)
        rows = pa.array(offsets - offsets[0], pa.int32())
        ids, labels = tokens.ids[offsets[0] : offsets[-1]], tokens.labels[offsets[0] : offsets[-1]]
        packed.append(
            pack_samples(
                pa.ListArray.from_arrays(rows, pa.array(ids)),
                pa.ListArray.from_arrays(rows, pa.array(labels)),
                seq_len,
                overlong,
            )
        )
    return packed, tokens.lines_tokenized


def prune(cache: Path, keep: Iterable[str]) -> None:
    """Leave in ``cache``/parts only the parts of this run (and nothing half written)."""
    folder = cache / PARTS
    if not folder.is_dir():
        return
    remove_all_but(folder, [f"{key}{suffix}" for key in keep for suffix in (".parquet", ".json")])


def _save(folder: Path, key: str, packed: PackResult) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{key}.parquet.tmp"
    shards.write_shard(packed.bins.table(), tmp)
    os.replace(tmp, folder / f"{key}.parquet")
    # The counts go last: a part is in the cache once they are.
    counts = {name: getattr(packed, name) for name in _COUNTS}
    write_json(folder / f"{key}.json", {"bins": len(packed.bins), **counts})


def _load(folder: Path, key: str, seq_len: int) -> PackResult | None:
    """A cached part, or None when it is not there, or does not add up."""
    counts_path, bins_path = folder / f"{key}.json", folder / f"{key}.parquet"
    if not counts_path.exists():
        return None
    try:
        counts = {name: int(value) for name, value in read_json(counts_path).items()}
        table = pq.read_table(bins_path)
        if table.schema != shards.SCHEMA:
            raise ValueError(f"its schema is {table.schema}")
        tokens_per_bin, input_ids = shards.list_column(table, shards.INPUT_IDS)
        label_lengths, labels = shards.list_column(table, shards.LABELS)
        seqs_per_bin, seq_lengths = shards.list_column(table, shards.SEQ_LENGTHS)
        source_lengths, sample_indices = shards.list_column(table, shards.SAMPLE_INDICES)
        seq_lengths, sample_indices = seq_lengths.astype(np.int64), sample_indices.astype(np.int64)
        seq_offsets = np.concatenate([[0], np.cumsum(seqs_per_bin)]).astype(np.int64)
        if not (
            len(table) == counts["bins"]
            and np.array_equal(tokens_per_bin, label_lengths)
            and np.array_equal(seqs_per_bin, source_lengths)
            and (seqs_per_bin > 0).all()
            and (seq_lengths > 0).all()
            and np.array_equal(_sums(seq_lengths, seq_offsets), tokens_per_bin)
            and len(input_ids) == counts["real_tokens"]
            and ((sample_indices >= 0) & (sample_indices < counts["n_samples_in"])).all()
        ):
            raise ValueError("its bins do not add up")
    except (OSError, ValueError, KeyError, TypeError, pa.ArrowException) as error:
        log.warning(
            "pack: cached part %s in %s is unreadable (%s): packed again", key, folder, error
        )
        return None
    return PackResult(
        bins=PackedBins(
            input_ids=input_ids.astype(np.int32, copy=False),
            labels=labels.astype(np.int32, copy=False),
            bin_offsets=np.concatenate([[0], np.cumsum(tokens_per_bin)]).astype(np.int64),
            seq_lengths=seq_lengths,
            sample_indices=sample_indices,
            seq_offsets=seq_offsets,
        ),
        efficiency=counts["real_tokens"] / (counts["bins"] * seq_len) if counts["bins"] else 0.0,
        **{name: counts[name] for name in _COUNTS},
    )


def _sums(values: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """The sum of each run ``values[offsets[i]:offsets[i + 1]]`` (runs not empty)."""
    if len(offsets) < 2:
        return np.zeros(0, dtype=values.dtype)
    return np.add.reduceat(values, offsets[:-1])
