"""pack part by part: the same bins with the cache or without it, and only new parts packed.

Files are written as clean writes them (chats, and the parts they came in,
``tuneloop.data.clean_parts``); parts close at a few dozen lines here instead of
``PART_MIN_LINES``, so a file has several.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests import helpers
from tuneloop.data import clean_parts, pack_cache, token_cache
from tuneloop.data.chat import ChatTokenizer
from tuneloop.data.pack import Overlong, pack_samples
from tuneloop.data.pack_cache import Packed, pack_file, part_ranges
from tuneloop.data.shards import IGNORE_INDEX

# The fast tier: no pipeline, server or rank.
pytestmark = pytest.mark.fast

SEQ_LEN = 96


@pytest.fixture(autouse=True)
def small_parts(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(pack_cache, "PART_MIN_LINES", 40)
    yield


def chat_lines(seed: int, n: int) -> list[bytes]:
    return [line.encode() + b"\n" for line in helpers.chat_lines(seed, n)]


def write(path: Path, segments: list[list[bytes]]) -> Path:
    """A file as clean writes it: the lines of each segment, and the parts file."""
    path.write_bytes(b"".join(line for segment in segments for line in segment))
    clean_parts.write(
        path,
        [
            clean_parts.Part(f"segment-{i}", len(s), sum(map(len, s)))
            for i, s in enumerate(segments)
        ],
    )
    return path


def pack(
    path: Path, cache: Path | None, tokenizer: ChatTokenizer, seq_len: int = SEQ_LEN
) -> Packed:
    """As the stage packs a file: then the cache keeps this run's parts only."""
    packed = pack_file(path, cache, "train", tokenizer, seq_len, "truncate")
    if cache is not None:
        pack_cache.prune(cache, packed.keys)
    return packed


def assert_same(a: Packed, b: Packed) -> None:
    assert a.result.bins == b.result.bins
    for name in ("n_samples_in", "n_truncated", "real_tokens", "label_tokens", "efficiency"):
        assert getattr(a.result, name) == getattr(b.result, name)


def assert_bins_hold_their_lines(packed: Packed, path: Path, tokenizer: ChatTokenizer) -> None:
    """Every packed sequence is the tokens of the line its sample index names."""
    tokens = helpers.tokens_of(path, None, tokenizer)
    bins = packed.result.bins
    starts = np.concatenate([[0], np.cumsum(bins.seq_lengths)])
    assert sorted(bins.sample_indices.tolist()) == list(range(len(tokens.offsets) - 1))
    for seq, sample in enumerate(bins.sample_indices.tolist()):
        line = tokens.ids[tokens.offsets[sample] : tokens.offsets[sample + 1]][:SEQ_LEN]
        assert np.array_equal(bins.input_ids[starts[seq] : starts[seq + 1]], line)


def test_a_growing_file_packs_only_its_new_parts(tmp_path: Path, tokenizer: ChatTokenizer) -> None:
    """Months trained from the base: last month's file and a new batch at its end."""
    months = [chat_lines(seed, n) for seed, n in ((1, 120), (2, 50), (3, 70))]
    segments: list[list[bytes]] = []
    path, cache = tmp_path / "train.jsonl", tmp_path / "cache"
    reused = []
    for month in months:
        segments += [month[i : i + 25] for i in range(0, len(month), 25)]
        write(path, segments)
        cached = pack(path, cache, tokenizer)
        assert_same(cached, pack(path, None, tokenizer))
        assert_bins_hold_their_lines(cached, path, tokenizer)
        reused.append((cached.parts_reused, cached.parts))
        # The cache holds this file's parts only.
        assert sorted(p.stem for p in (cache / "parts").glob("*.json")) == sorted(cached.keys)
    # 120 lines: parts of 50, 50 and 20 lines; + 50: the open part closes at 45 (packed
    # again), then 25; + 70: that part closes at 50 (again), then 20.
    assert reused == [(0, 3), (2, 4), (3, 5)]


def test_parts_pack_nearly_as_tight_as_one_pass(tmp_path: Path, tokenizer: ChatTokenizer) -> None:
    lines = chat_lines(4, 300)
    path = write(tmp_path / "train.jsonl", [lines[i : i + 20] for i in range(0, 300, 20)])
    parts = pack(path, None, tokenizer)
    assert parts.parts == 8  # 7 parts of 40 lines, then 20
    tokens = helpers.tokens_of(path, None, tokenizer)
    offsets = tokens.offsets
    rows = [tokens.ids[offsets[i] : offsets[i + 1]] for i in range(len(offsets) - 1)]
    labels = [tokens.labels[offsets[i] : offsets[i + 1]] for i in range(len(offsets) - 1)]
    whole = pack_samples(rows, labels, SEQ_LEN, "truncate")
    assert len(whole.bins) <= len(parts.result.bins) <= len(whole.bins) + parts.parts
    assert parts.result.real_tokens == whole.real_tokens
    assert (
        parts.result.label_tokens
        == whole.label_tokens
        == int(np.count_nonzero(parts.result.bins.labels != IGNORE_INDEX))
    )


def test_a_replay_share_is_packed_again_from_cached_tokens(
    tmp_path: Path, tokenizer: ChatTokenizer
) -> None:
    """From the champion: old parts are a new draw each month, their lines tokenized before."""
    old, new = chat_lines(5, 200), chat_lines(6, 30)
    path, cache = tmp_path / "train.jsonl", tmp_path / "cache"
    write(path, [old[:100], old[100:]])
    pack(path, cache, tokenizer)
    rng = np.random.default_rng(0)
    replayed = [old[i] for i in sorted(rng.choice(len(old), 60, replace=False))]
    write(path, [replayed[:30], replayed[30:], new])
    cached = pack(path, cache, tokenizer)
    assert cached.parts_reused == 0 and cached.lines_tokenized == len(new)
    assert_same(cached, pack(path, None, tokenizer))
    assert_bins_hold_their_lines(cached, path, tokenizer)


def test_other_params_or_a_broken_part_are_never_reused(
    tmp_path: Path, tokenizer: ChatTokenizer, caplog: pytest.LogCaptureFixture
) -> None:
    lines = chat_lines(7, 160)
    path, cache = tmp_path / "train.jsonl", tmp_path / "cache"
    write(path, [lines[:80], lines[80:]])
    pack(path, cache, tokenizer)
    shorter = pack(path, cache, tokenizer, seq_len=64)
    assert shorter.parts_reused == 0
    assert_same(shorter, pack(path, None, tokenizer, seq_len=64))
    assert pack(path, cache, tokenizer, seq_len=64).parts_reused == 2

    first, second = sorted((cache / "parts").glob("*.parquet"))
    first.write_bytes(b"PAR1 not a parquet file")
    second.with_suffix(".json").write_text(
        json.dumps({**json.loads(second.with_suffix(".json").read_text()), "real_tokens": 1})
    )
    with caplog.at_level(logging.WARNING, logger="tuneloop.data.pack_cache"):
        again = pack(path, cache, tokenizer, seq_len=64)
    assert again.parts_reused == 0 and caplog.text.count("packed again") == 2
    assert_same(again, pack(path, None, tokenizer, seq_len=64))
    # Bins without their counts (a run killed between the two writes) are not a part.
    next((cache / "parts").glob("*.json")).unlink()
    assert pack(path, cache, tokenizer, seq_len=64).parts_reused == 1


@pytest.mark.parametrize(
    "parts",
    [
        [{"name": "a", "lines": 10, "bytes": 5}],  # ends inside a line
        [{"name": "a", "lines": 10, "bytes": 10**9}],  # past the end
        [{"name": "a", "lines": -1, "bytes": -3}],
        [{"name": "a"}],
        "not a list",
    ],
)
def test_a_parts_file_that_does_not_add_up_reads_the_file_as_one_part(
    tmp_path: Path, tokenizer: ChatTokenizer, parts: object
) -> None:
    lines = chat_lines(8, 50)
    path = write(tmp_path / "train.jsonl", [lines])
    expected = pack(path, None, tokenizer)
    clean_parts.path_for(path).write_text(json.dumps({"parts": parts}))
    assert clean_parts.read(path, path.read_bytes()) == [
        clean_parts.Part("whole", 50, path.stat().st_size)
    ]
    assert_same(pack(path, tmp_path / "cache", tokenizer), expected)
    clean_parts.path_for(path).unlink()
    assert_same(pack(path, tmp_path / "cache", tokenizer), expected)


def test_closed_parts_do_not_depend_on_what_follows() -> None:
    sizes = [(30, 300), (15, 150), (40, 400), (5, 50), (1, 10)]
    parts = [clean_parts.Part(str(i), n, size) for i, (n, size) in enumerate(sizes)]
    full = part_ranges(parts, 40)
    assert full == [range(0, 450), range(450, 850), range(850, 910)]
    for end in range(1, len(parts)):
        head = part_ranges(parts[:end], 40)
        assert head[:-1] == full[: len(head) - 1]
    assert part_ranges([], 40) == []


def test_an_empty_file_packs_to_no_bins(tmp_path: Path, tokenizer: ChatTokenizer) -> None:
    path = write(tmp_path / "val.jsonl", [])
    packed = pack(path, tmp_path / "cache", tokenizer)
    assert len(packed.result.bins) == 0 and packed.result.n_samples_in == 0


# --- what a part is keyed on: change one thing its bins depend on, and it misses -------------

# (change, parts packed again, lines tokenized again): the parts' key holds the tokens' key.
PACK_CHANGES = [
    ("nothing", False, False),
    ("pack.seq_len", True, False),
    ("pack.overlong", True, False),
    ("tokenizer.json", True, True),
    ("chat template", True, True),
    ("tokenizers version", True, True),
    ("jinja2 version", True, True),
    *((f"code {name}", True, False) for name in ("pack.py", "pack_cache.py")),
    *((f"code {name}", True, True) for name in ("chat.py", "shards.py", "token_cache.py")),
    ("the file copied elsewhere", False, False),  # keyed by bytes, not by where they lie
]


@pytest.mark.parametrize(
    ("change", "parts_miss", "tokens_miss"), PACK_CHANGES, ids=[c for c, *_ in PACK_CHANGES]
)
def test_a_change_to_what_a_part_depends_on_misses_it(
    tmp_path: Path,
    tokenizer: ChatTokenizer,
    monkeypatch: pytest.MonkeyPatch,
    change: str,
    parts_miss: bool,
    tokens_miss: bool,
) -> None:
    lines = chat_lines(8, 120)
    path, cache = tmp_path / "train.jsonl", tmp_path / "cache"
    write(path, [lines[:60], lines[60:]])
    first = pack(path, cache, tokenizer)
    seq_len = SEQ_LEN
    overlong: Overlong = "truncate"
    if change == "pack.seq_len":
        seq_len = 64
    elif change == "pack.overlong":
        overlong = "drop"
    elif (
        changed := helpers.changed_tokenizer(change, tokenizer, tmp_path, monkeypatch)
    ) is not None:
        tokenizer = changed
    elif change.startswith("code "):
        names = ("pack.py", "pack_cache.py", "chat.py", "shards.py", "token_cache.py")
        source = Path(pack_cache.__file__).parent
        code = helpers.edited_code(tmp_path / "code", source, names, change.removeprefix("code "))
        monkeypatch.setattr(pack_cache, "__file__", str(code / "pack_cache.py"))
        monkeypatch.setattr(token_cache, "__file__", str(code / "token_cache.py"))
    elif change == "the file copied elsewhere":
        (tmp_path / "elsewhere").mkdir()
        for name in (path.name, f"{path.stem}.parts.json"):
            shutil.copy2(tmp_path / name, tmp_path / "elsewhere" / name)
        path = tmp_path / "elsewhere" / path.name
    else:
        assert change == "nothing", change
    again = pack_file(path, cache, "train", tokenizer, seq_len, overlong)
    assert again.parts_reused == (0 if parts_miss else first.parts)
    assert again.lines_tokenized == (len(lines) if tokens_miss else 0)
    assert_same(again, pack_file(path, None, "train", tokenizer, seq_len, overlong))
