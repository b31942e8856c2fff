"""clean's cache: the same bytes out with or without it, and never a stale entry reused.

Pools are built from the demo domain (chats and badcases, with planted exact and near
duplicates and eval items), split into batch files as ingest writes them. Every run is
compared with an uncached run of the same pool and params.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import tempfile
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tokenizers
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.clean_helpers import PARAMS, pool_line, write_pool
from tuneloop.data import chat, clean_cache, clean_parts, neardup, text, turn_keys
from tuneloop.data import clean as clean_module
from tuneloop.data.chat import ChatTokenizer
from tuneloop.data.clean import hash_fractions
from tuneloop.data.clean_cache import CleanReport, clean_pool
from tuneloop.demo import domain, tiny
from tuneloop.io import write_jsonl
from tuneloop.params import CleanParams

# The fast tier: no pipeline, server or rank.
pytestmark = pytest.mark.fast

EVAL = [item.question for item in domain.eval_items(0, 40)]


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tokenizer")
    tiny.build_tokenizer(domain.tokenizer_corpus(0), 512).save_pretrained(folder)
    return folder


def demo_lines(seed: int, n: int) -> list[dict[str, Any]]:
    """Demo chats and badcases with what clean must catch: repeats, edits, eval items, junk."""
    rng = random.Random(seed)
    raw: list[dict[str, Any]] = [*domain.support_records(seed, n)]
    raw += domain.badcase_records(seed, n // 8)
    english = [r for r in raw if "prompt" in r and str(r["prompt"]).isascii()]
    for _ in range(max(3, n // 10)):
        record = dict(rng.choice(english))
        record["prompt"] = str(record["prompt"]).upper()  # equal once normalised
        raw.append(record)
        record = dict(rng.choice(english))
        record["prompt"] = str(record["prompt"]) + "!!"  # equal but for punctuation: near
        raw.append(record)
    for question in rng.sample(EVAL, 3):
        raw.append({"prompt": question, "response": "[unknown] an eval item, planted"})
    raw.append({"prompt": "hi", "response": "ok ok ok ok ok ok ok ok ok ok ok ok ok ok ok ok"})
    raw.append({"prompt": "hi", "response": "k"})
    raw.append({"prompt": "long " * 200, "response": "[unknown] too long to train on"})
    raw.append({"messages": [{"role": "user", "content": "no fix"}], "bad_response": "x"})
    rng.shuffle(raw)
    seen: set[str] = set()
    lines = []
    for data in raw:
        line = pool_line(data)
        if line["id"] not in seen:  # ingest keeps one copy of a record
            seen.add(line["id"])
            lines.append(line)
    return lines


@dataclass
class Run:
    report: CleanReport
    files: dict[str, bytes]


def run(
    root: Path,
    cache: Path,
    tokenizer: ChatTokenizer,
    params: CleanParams = PARAMS,
    evals: list[str] = EVAL,
    seen: tuple[str, ...] = (),
) -> Run:
    out = Path(tempfile.mkdtemp(dir=root))
    report = clean_pool(root / "pool", cache, out, evals, params, tokenizer, seen)
    files = {name: (out / name).read_bytes() for name in ("train.jsonl", "val.jsonl", "dpo.jsonl")}
    assert_turn_keys_describe(out)
    assert_parts_describe(out)
    return Run(report, files)


def assert_parts_describe(out: Path) -> None:
    """The parts clean writes for pack are its segments' lines, in file order."""
    for split in ("train", "val"):
        data = (out / f"{split}.jsonl").read_bytes()
        parts = clean_parts.read(out / f"{split}.jsonl", data)
        assert all(p.name != "whole" for p in parts)
        start = 0
        for part in parts:
            assert data[start : start + part.size].count(b"\n") == part.lines
            start += part.size
        assert start == len(data)


def assert_turn_keys_describe(out: Path) -> None:
    """The keys clean writes for preflight are those of every user turn of train.jsonl."""
    data = (out / "train.jsonl").read_bytes()
    keys = turn_keys.read(out / turn_keys.NAME, data)
    assert keys is not None
    expected = [
        (row, text.key(m["content"]))
        for row, line in enumerate(data.splitlines())
        for m in json.loads(line)["messages"]
        if m["role"] == "user"
    ]
    assert [(int(r), k.tobytes()) for r, k in zip(keys.rows, keys.keys, strict=True)] == expected


def uncached(root: Path, tokenizer: ChatTokenizer, **kwargs: Any) -> Run:
    return run(root, Path(tempfile.mkdtemp(dir=root)), tokenizer, **kwargs)


@pytest.fixture
def small_segments(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # Several segments per batch file, so segment boundaries and chains are exercised.
    monkeypatch.setattr(clean_cache, "SEGMENT_LINES", 37)
    yield


EVERY_RULE = (7, [120, 80, 60])


@settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    seed=st.integers(0, 10_000),
    sizes=st.lists(st.integers(20, 120), min_size=1, max_size=3),
)
@example(seed=EVERY_RULE[0], sizes=EVERY_RULE[1])
def test_cached_runs_write_the_bytes_an_uncached_run_writes(
    tokenizer_folder: Path, small_segments: None, seed: int, sizes: list[int]
) -> None:
    tokenizer = ChatTokenizer.from_folder(tokenizer_folder)
    lines = demo_lines(seed, sum(sizes))
    cuts = np.cumsum([0, *sizes[:-1]]).tolist()
    batches = [lines[a:b] for a, b in zip(cuts, [*cuts[1:], len(lines)], strict=True)]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        cache = root / "cache"
        # Month by month, each month on top of the cache the months before left.
        for month in range(1, len(batches) + 1):
            shutil.rmtree(root / "pool", ignore_errors=True)
            write_pool(root / "pool", batches[:month])
            incremental = run(root, cache, tokenizer)
            assert incremental.report.cache["records_computed"] == len(batches[month - 1])
        fresh = uncached(root, tokenizer)
        again = run(root, cache, tokenizer)
        assert incremental.files == fresh.files == again.files
        assert again.report.cache["records_computed"] == 0
        assert again.report.cache["segments_decided"] == 0
        for report in (incremental.report, fresh.report, again.report):
            assert report.records_in == len(lines)
            assert report.records_in == report.train + report.val + sum(report.removed.values())
        if (seed, sizes) == EVERY_RULE:
            # A random sample as small as 20 lines may hold no duplicate; this one has a
            # record for every rule, so the cache is shown to keep each decision.
            assert {"eval_contamination", "exact_duplicate", "near_duplicate"} <= set(
                fresh.report.removed
            )


@pytest.fixture
def filled(tmp_path: Path, tokenizer_folder: Path, small_segments: None) -> tuple[Path, Run]:
    write_pool(tmp_path / "pool", [demo_lines(1, 90), demo_lines(2, 60)])
    first = run(tmp_path, tmp_path / "cache", ChatTokenizer.from_folder(tokenizer_folder))
    assert first.report.cache["records_reused"] == 0
    return tmp_path, first


@pytest.mark.parametrize(
    ("change", "features_recomputed"),
    [
        ({"near_dup_threshold": 0.8}, False),
        ({"decontam_threshold": 0.7}, False),
        ({"val_fraction": 0.3}, False),
        ({"pilot_fraction": 0.5}, False),
        ({"max_tokens": 40}, True),
        ({"min_response_chars": 30}, True),
        ({"min_distinct_ngrams": 0.9}, True),
    ],
)
def test_changed_params_recompute_what_they_touch(
    filled: tuple[Path, Run],
    tokenizer_folder: Path,
    change: dict[str, Any],
    features_recomputed: bool,
) -> None:
    root, first = filled
    tokenizer = ChatTokenizer.from_folder(tokenizer_folder)
    params = PARAMS.model_copy(update=change)
    rerun = run(root, root / "cache", tokenizer, params=params)
    assert rerun.files == uncached(root, tokenizer, params=params).files
    assert rerun.files != first.files
    computed = rerun.report.cache["records_computed"]
    assert computed == (first.report.records_in if features_recomputed else 0)
    assert rerun.report.cache["segments_reused"] == 0  # every decision made again


def test_changed_eval_set_redecides_without_recomputing_features(
    filled: tuple[Path, Run], tokenizer_folder: Path
) -> None:
    root, first = filled
    tokenizer = ChatTokenizer.from_folder(tokenizer_folder)
    evals = EVAL[:5]
    rerun = run(root, root / "cache", tokenizer, evals=evals)
    assert rerun.files == uncached(root, tokenizer, evals=evals).files != first.files
    assert rerun.report.cache["records_computed"] == 0
    assert rerun.report.cache["segments_reused"] == 0


def test_changed_tokenizer_recomputes_features(filled: tuple[Path, Run], tmp_path: Path) -> None:
    root, first = filled
    folder = tmp_path / "tokenizer"
    tokenizer = tiny.build_tokenizer(domain.tokenizer_corpus(0), 512)
    tokenizer.chat_template = tiny.CHAT_TEMPLATE.replace("'\\n'", "'\\n\\n'")
    tokenizer.save_pretrained(folder)
    other = ChatTokenizer.from_folder(folder)
    rerun = run(root, root / "cache", other, params=PARAMS.model_copy(update={"max_tokens": 40}))
    assert rerun.report.cache["records_computed"] == first.report.records_in
    fresh = uncached(root, other, params=PARAMS.model_copy(update={"max_tokens": 40}))
    assert rerun.files == fresh.files


def test_missing_or_broken_entries_are_recomputed(
    filled: tuple[Path, Run], tokenizer_folder: Path
) -> None:
    root, first = filled
    cache = root / "cache"
    tokenizer = ChatTokenizer.from_folder(tokenizer_folder)
    segments = sorted(p for p in cache.iterdir() if p.name != "batches")
    assert len(segments) > 3
    shutil.rmtree(segments[1] / "features")
    (segments[2] / "features" / "sketch.npy").write_bytes(b"not an array")
    shutil.rmtree(segments[3] / "decisions")
    rerun = run(root, cache, tokenizer)
    assert rerun.files == first.files
    assert 0 < rerun.report.cache["records_computed"] <= 2 * 37
    # Recomputed features are the same features, so only the lost decisions are made again.
    assert rerun.report.cache["segments_decided"] == 1


def test_a_rewritten_pool_file_is_never_served_from_the_cache(
    filled: tuple[Path, Run], tokenizer_folder: Path
) -> None:
    root, _ = filled
    tokenizer = ChatTokenizer.from_folder(tokenizer_folder)
    batch = sorted((root / "pool" / "records" / "support").glob("*.jsonl"))[0]
    write_jsonl(batch, demo_lines(7, 50))
    rerun = run(root, root / "cache", tokenizer)
    assert rerun.files == uncached(root, tokenizer).files
    assert rerun.report.cache["records_computed"] == len(batch.read_text().splitlines())


def test_removed_batches_leave_the_cache(filled: tuple[Path, Run], tokenizer_folder: Path) -> None:
    root, _ = filled
    last = sorted((root / "pool" / "records" / "support").glob("*.jsonl"))[-1]
    last.unlink()
    run(root, root / "cache", ChatTokenizer.from_folder(tokenizer_folder))
    assert not [p for p in (root / "cache").rglob("*") if last.stem in p.name]


def test_features_on_worker_processes_equal_inline(
    tmp_path: Path,
    tokenizer_folder: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    write_pool(tmp_path / "pool", [demo_lines(3, 300)])
    tokenizer = ChatTokenizer.from_folder(tokenizer_folder)
    caplog.set_level(logging.INFO, logger=clean_cache.log.name)
    monkeypatch.setattr(clean_cache, "usable_cores", lambda: 2)
    # Segments of 37 lines: nine chunks, as many as 36,000 lines would make, but too few
    # lines to start a worker for.
    monkeypatch.setattr(clean_cache, "SEGMENT_LINES", 37)
    inline = uncached(tmp_path, tokenizer)
    assert "processes" not in caplog.text
    monkeypatch.setattr(clean_cache, "CHUNK_LINES", 50)
    monkeypatch.setattr(clean_cache, "PARALLEL_MIN_RECORDS", 100)
    parallel = uncached(tmp_path, tokenizer)
    assert "on 2 processes" in caplog.text
    assert parallel.files == inline.files
    assert parallel.report.records_in == inline.report.records_in > 300


def test_a_new_segment_size_recuts_the_cache(
    filled: tuple[Path, Run], tokenizer_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, first = filled
    monkeypatch.setattr(clean_cache, "SEGMENT_LINES", 23)
    rerun = run(root, root / "cache", ChatTokenizer.from_folder(tokenizer_folder))
    assert rerun.files == first.files
    assert rerun.report.cache["records_computed"] == first.report.records_in
    assert rerun.report.cache["segments_reused"] == 0


# --- replay: batches the start already trained on come back at a share -----------------------


def _lines(blob: bytes) -> set[bytes]:
    return set(blob.splitlines())


def test_seen_batches_are_replayed_at_the_share_and_new_ones_in_full(
    filled: tuple[Path, Run], tokenizer_folder: Path
) -> None:
    root, full = filled  # seen nothing: every batch in full
    tokenizer = ChatTokenizer.from_folder(tokenizer_folder)
    pooled = sorted((root / "pool" / "records" / "support").glob("*.jsonl"))
    month1, month2 = (p.stem for p in pooled)
    # Month 1's training chats are what it gives alone (it is cleaned first either way).
    write_pool(root / "m1" / "pool", [demo_lines(1, 90)])
    month1_train = _lines(run(root / "m1", root / "m1" / "cache", tokenizer).files["train.jsonl"])
    month2_train = _lines(full.files["train.jsonl"]) - month1_train

    replay = run(root, root / "cache", tokenizer, seen=(month1,))
    train = _lines(replay.files["train.jsonl"])
    replayed = train & month1_train
    report = replay.report
    assert month2_train <= train  # the new month in full
    assert train <= month1_train | month2_train
    assert report.replayed == len(replayed)
    assert 0.1 * len(month1_train) <= len(replayed) <= 0.45 * len(month1_train)
    assert report.removed["not_replayed"] == len(month1_train) - len(replayed)
    assert replay.files["val.jsonl"] == full.files["val.jsonl"]  # validation keeps every month
    assert _lines(replay.files["dpo.jsonl"]) < _lines(full.files["dpo.jsonl"])
    assert report.dpo_removed["not_replayed"] > 0
    assert report.records_in == report.train + report.val + sum(report.removed.values())
    counts = report.metrics(PARAMS.replay_fraction).replay
    assert counts.seen_batches == (month1,) and counts.new_batches == (month2,)
    assert counts.replayed_train + counts.new_train == report.train

    # Reproducible, and the same bytes from the cache as without it.
    assert run(root, root / "cache", tokenizer, seen=(month1,)).files == replay.files
    assert uncached(root, tokenizer, seen=(month1,)).files == replay.files
    # The extremes: everything again, or nothing of what the start knew.
    everything = PARAMS.model_copy(update={"replay_fraction": 1.0})
    assert run(root, root / "cache", tokenizer, everything, seen=(month1,)).files == full.files
    nothing = PARAMS.model_copy(update={"replay_fraction": 0.0})
    none_again = run(root, root / "cache", tokenizer, nothing, seen=(month1,))
    assert _lines(none_again.files["train.jsonl"]) == month2_train
    # A batch id the pool does not hold (the champion saw data since dropped) changes nothing.
    assert run(root, root / "cache", tokenizer, seen=("19990101T000000000000Z",)).files == (
        full.files
    )


def test_corrected_badcases_of_seen_batches_are_all_trained_on_again(
    filled: tuple[Path, Run], tokenizer_folder: Path
) -> None:
    root, _ = filled
    tokenizer = ChatTokenizer.from_folder(tokenizer_folder)
    month1 = sorted((root / "pool" / "records" / "support").glob("*.jsonl"))[0].stem
    write_pool(root / "m1" / "pool", [demo_lines(1, 90)])
    alone = run(root / "m1", root / "m1" / "cache", tokenizer)
    month1_train = _lines(alone.files["train.jsonl"])
    month1_pairs = _lines(alone.files["dpo.jsonl"])
    # A corrected badcase's chat: its prompt with the correction as the reply.
    corrected = [json.loads(line) for line in month1_pairs]
    chats = {str([*p["prompt"], {"role": "assistant", "content": p["chosen"]}]) for p in corrected}
    assert chats  # the demo month has corrected badcases that clean keeps

    keep = PARAMS.model_copy(update={"replay_corrections": True})
    replay = run(root, root / "cache", tokenizer, keep, seen=(month1,))
    train = _lines(replay.files["train.jsonl"])
    again = {line for line in month1_train if str(json.loads(line)["messages"]) in chats}
    assert again and again <= train  # every correction, as a chat...
    assert month1_pairs <= _lines(replay.files["dpo.jsonl"])  # ...and as a preference pair
    assert replay.report.dpo_removed["not_replayed"] == 0
    # The other chats of the month stay at the share: corrections are not a way round it.
    others = (train & month1_train) - again
    assert 0 < len(others) <= 0.45 * len(month1_train - again)
    shared = run(root, root / "cache", tokenizer, seen=(month1,))
    assert (_lines(shared.files["train.jsonl"]) & month1_train) - again == others
    assert uncached(root, tokenizer, params=keep, seen=(month1,)).files == replay.files


def test_a_new_month_draws_a_new_replay_sample(tmp_path: Path, tokenizer_folder: Path) -> None:
    tokenizer = ChatTokenizer.from_folder(tokenizer_folder)
    batches = [demo_lines(1, 90), demo_lines(2, 60), demo_lines(3, 60)]
    write_pool(tmp_path / "pool", batches[:2])
    month1 = sorted((tmp_path / "pool" / "records" / "support").glob("*.jsonl"))[0].stem
    cache = tmp_path / "cache"
    before = _lines(run(tmp_path, cache, tokenizer, seen=(month1,)).files["train.jsonl"])
    write_pool(tmp_path / "pool", batches)
    after = run(tmp_path, cache, tokenizer, seen=(month1,))
    assert after.report.cache["records_computed"] == len(batches[2])
    write_pool(tmp_path / "m1" / "pool", batches[:1])
    month1_train = _lines(
        run(tmp_path / "m1", tmp_path / "m1" / "cache", tokenizer).files["train.jsonl"]
    )
    # Another month, another share of month 1: over the months replay covers more of it.
    assert before & month1_train != _lines(after.files["train.jsonl"]) & month1_train


def test_the_replay_draw_is_even_reproducible_and_new_each_month() -> None:
    keys = np.random.default_rng(0).integers(0, 256, (100_000, 32), dtype=np.uint8)
    draw = hash_fractions(keys, "replay:month-2")
    assert ((draw >= 0) & (draw < 1)).all()
    assert np.array_equal(draw, hash_fractions(keys, "replay:month-2"))
    for share in (0.1, 0.25, 0.5):
        assert abs((draw < share).mean() - share) < 0.01
    # Another month's draw is independent of this one's: a quarter of a quarter overlaps.
    other = hash_fractions(keys, "replay:month-3") < 0.25
    assert abs(((draw < 0.25) & other).mean() - 0.0625) < 0.005


# --- what an entry is keyed on: change one thing its value depends on, and it misses ----------

# Each clean param by the entries its value changes: "features" (the filters: every record's
# work is redone, and so every decision), "decisions" (dedup, the split, the pilot, eval
# matches: the features are reused), "neither" (the replay share, drawn after the cached
# decisions from the start's batches). A new param fails here until it is placed.
PARAM_ENTRIES: dict[str, tuple[str, Any]] = {
    "min_response_chars": ("features", 30),
    "max_tokens": ("features", 40),
    "min_distinct_ngrams": ("features", 0.9),
    "near_dup_threshold": ("decisions", 0.8),
    "decontam_threshold": ("decisions", 0.7),
    "val_fraction": ("decisions", 0.3),
    "pilot_fraction": ("decisions", 0.5),
    "replay_fraction": ("neither", 0.5),
    "replay_corrections": ("neither", True),
}


def _retemplated(folder: Path) -> Path:
    tokenizer = tiny.build_tokenizer(domain.tokenizer_corpus(0), 512)
    tokenizer.chat_template = tiny.CHAT_TEMPLATE.replace("'\\n'", "'\\n\\n'")
    tokenizer.save_pretrained(folder)
    return folder


def _revocabulary(folder: Path) -> Path:
    # The same template over another vocabulary: tokenizer.json alone differs.
    tiny.build_tokenizer(domain.tokenizer_corpus(0), 400).save_pretrained(folder)
    return folder


def _edited_code(folder: Path, name: str) -> Path:
    """A copy of the modules the features key on, ``name`` one comment longer; its clean.py."""
    code = Path(clean_module.__file__).parent
    folder.mkdir()
    for module in clean_module._CODE_FILES:
        shutil.copy(code / module, folder / module)
    with (folder / name).open("a") as edited:
        edited.write("# edited\n")
    return folder / "clean.py"


def _change(
    what: str, root: Path, tokenizer_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[ChatTokenizer, dict[str, Any]]:
    """Make one change: the tokenizer, and the ``run`` arguments, that see it."""
    kwargs: dict[str, Any] = {}
    folder = tokenizer_folder
    if what.startswith("param "):
        name = what.removeprefix("param ")
        kwargs["params"] = PARAMS.model_copy(update={name: PARAM_ENTRIES[name][1]})
    elif what == "eval questions":
        kwargs["evals"] = EVAL[:5]
    elif what == "tokenizer.json":
        folder = _revocabulary(root / "vocabulary")
    elif what == "chat template":
        folder = _retemplated(root / "template")
    elif what == "tokenizers version":
        monkeypatch.setattr(tokenizers, "__version__", "0.0.0")
    elif what == "jinja2 version":
        monkeypatch.setattr(chat, "version", lambda name: "0.0.0")
    elif what == "unicode tables":
        monkeypatch.setattr(unicodedata, "unidata_version", "0.0.0")
    elif what == "rensa version":
        monkeypatch.setattr(clean_module, "version", lambda name: "0.0.0")
    elif what == "sketch algorithm":
        monkeypatch.setattr(neardup, "SKETCH_VERSION", "another")
    elif what.startswith("code "):
        edited = _edited_code(root / "code", what.removeprefix("code "))
        monkeypatch.setattr(clean_module, "__file__", str(edited))
    else:
        assert what == "nothing", what
    return ChatTokenizer.from_folder(folder), kwargs


# (what changes, which entries miss): every dependency, through the two keys.
DEPENDENCIES = [
    ("nothing", "neither"),
    *((f"param {name}", entries) for name, (entries, _) in PARAM_ENTRIES.items()),
    ("eval questions", "decisions"),
    ("tokenizer.json", "features"),
    ("chat template", "features"),
    ("tokenizers version", "features"),
    ("jinja2 version", "features"),
    ("unicode tables", "features"),
    ("rensa version", "features"),
    ("sketch algorithm", "features"),
    *((f"code {name}", "features") for name in clean_module._CODE_FILES),
]


def test_every_clean_param_is_placed_in_the_cache_keys() -> None:
    assert set(PARAM_ENTRIES) == set(CleanParams.model_fields)


@pytest.mark.parametrize(("what", "misses"), DEPENDENCIES, ids=[d for d, _ in DEPENDENCIES])
def test_each_dependency_is_in_its_key(
    tmp_path: Path,
    tokenizer_folder: Path,
    monkeypatch: pytest.MonkeyPatch,
    what: str,
    misses: str,
) -> None:
    """The features' key (``features_fingerprint``) and the head of the decisions' chain
    (``decisions_fingerprint``, which every segment's link extends with the features' key)."""

    def keys(tokenizer: ChatTokenizer, params: CleanParams = PARAMS, evals: list[str] = EVAL):
        features = clean_module.features_fingerprint(params, tokenizer)
        decisions = clean_module.decisions_fingerprint(
            params, clean_module.EvalSet(evals, params.decontam_threshold)
        )
        return features, decisions

    before = keys(ChatTokenizer.from_folder(tokenizer_folder))
    tokenizer, kwargs = _change(what, tmp_path, tokenizer_folder, monkeypatch)
    after = keys(tokenizer, **kwargs)
    assert (after[0] != before[0]) == (misses == "features")
    assert (after[1] != before[1]) == (misses == "decisions")


@pytest.fixture(scope="module")
def filled_once(
    tmp_path_factory: pytest.TempPathFactory, tokenizer_folder: Path
) -> tuple[Path, Run]:
    """A pool and the cache a run left, made once; each test works on a copy."""
    root = tmp_path_factory.mktemp("filled")
    write_pool(root / "pool", [demo_lines(1, 90), demo_lines(2, 60)])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(clean_cache, "SEGMENT_LINES", 37)
        first = run(root, root / "cache", ChatTokenizer.from_folder(tokenizer_folder))
    return root, first


@pytest.mark.parametrize(
    ("what", "misses"),
    [
        ("nothing", "neither"),
        ("param replay_fraction", "neither"),
        ("code text.py", "features"),
    ],  # params and the tokenizer end to end: test_changed_params_..., test_changed_tokenizer_...
)
def test_a_run_misses_exactly_what_a_change_touches(
    filled_once: tuple[Path, Run],
    tmp_path: Path,
    tokenizer_folder: Path,
    small_segments: None,
    monkeypatch: pytest.MonkeyPatch,
    what: str,
    misses: str,
) -> None:
    """End to end, on a copy of a filled cache: reused entries give the uncached bytes."""
    shutil.copytree(filled_once[0], tmp_path / "root")
    root, first = tmp_path / "root", filled_once[1]
    tokenizer, kwargs = _change(what, root, tokenizer_folder, monkeypatch)
    rerun = run(root, root / "cache", tokenizer, **kwargs)
    report = rerun.report.cache
    computed = first.report.records_in if misses == "features" else 0
    assert report["records_computed"] == computed
    if misses == "neither":
        assert report["segments_decided"] == 0
    else:
        assert report["segments_reused"] == 0
    if misses != "features":  # something was reused: it must be what a run without makes
        assert rerun.files == uncached(root, tokenizer, **kwargs).files


def test_same_size_bytes_under_the_old_mtime_miss(
    filled_once: tuple[Path, Run], tmp_path: Path, tokenizer_folder: Path, small_segments: None
) -> None:
    """A batch copied over with its times kept (cp -p, rsync -t, a restore): its md5 was
    remembered by size and mtime, and the old bytes' features served for the new ones."""
    shutil.copytree(filled_once[0], tmp_path / "root")
    root, first = tmp_path / "root", filled_once[1]
    tokenizer = ChatTokenizer.from_folder(tokenizer_folder)
    batch = sorted((root / "pool" / "records" / "support").glob("*.jsonl"))[0]
    before = batch.stat()
    lines = batch.read_bytes().splitlines(keepends=True)
    batch.write_bytes(b"".join(reversed(lines)))  # the same size, other bytes
    os.utime(batch, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (batch.stat().st_size, batch.stat().st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    rerun = run(root, root / "cache", tokenizer)
    assert rerun.report.cache["records_computed"] == len(lines)
    assert rerun.files == uncached(root, tokenizer).files != first.files


def test_a_copied_pool_is_hashed_again_and_reused_by_its_bytes(
    filled_once: tuple[Path, Run], tmp_path: Path, tokenizer_folder: Path, small_segments: None
) -> None:
    """The entries are keyed on a batch's name and bytes, not on where the pool lies: a copy of
    the project (new inodes, times kept) reads each batch once and reuses every entry."""
    root, first = filled_once
    tokenizer = ChatTokenizer.from_folder(tokenizer_folder)
    shutil.copytree(root / "pool", tmp_path / "pool")
    shutil.copytree(root / "cache", tmp_path / "cache")
    rerun = run(tmp_path, tmp_path / "cache", tokenizer)
    assert rerun.report.cache["records_computed"] == 0
    assert rerun.report.cache["segments_decided"] == 0
    assert rerun.files == first.files


def test_another_task_is_another_pool(tmp_path: Path, tokenizer_folder: Path) -> None:
    """A task's records lie in ``records/<task>/`` as ``<batch>_<task>``: the same bytes under
    another task are other segments, never the first task's entries."""
    tokenizer = ChatTokenizer.from_folder(tokenizer_folder)
    lines = demo_lines(4, 80)
    records = tmp_path / "pool" / "records"
    for task in ("support", "copy"):
        write_jsonl(records / task / f"20260101T000000000000Z_{task}.jsonl", lines)

    def clean(task: str) -> CleanReport:
        out = Path(tempfile.mkdtemp(dir=tmp_path))
        return clean_pool(
            tmp_path / "pool", tmp_path / "cache", out, EVAL, PARAMS, tokenizer, (), task
        )

    for task in ("support", "copy", "support"):
        report = clean(task)
        assert report.batches == [f"20260101T000000000000Z_{task}"]
        assert report.cache["records_computed"] == report.records_in
    again = clean("support")
    assert again.cache["records_computed"] == 0 and again.cache["segments_decided"] == 0
