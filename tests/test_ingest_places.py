"""Ingest decides a line by what it means, never by where it stands.

The same records laid out at random over several tasks' folders (any line, any file, any
order, some misfiled, some behind a byte-order mark), ingested by one process or two, whole
or cut after some files and resumed: every record lands once per task it belongs to, every
line is accounted for in its folder, and a quarantined record refiled where its reason says
reaches the pool.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tuneloop.data import ingest
from tuneloop.data.records import content_hash, parse_record, plain, pool_records

# The fast tier: no pipeline, server or rank.
pytestmark = pytest.mark.fast

TASKS = ("support", "orders")
PLACES = (*TASKS, "")  # a task's folder, or the incoming folder itself
BOM = b"\xef\xbb\xbf"
PROMPTS = ("Can I return the Aurora kettle?", "Where is my order 42?", "Warranty on the fan?")
# What a record may say of its task: nothing, one of the tasks, or a task nobody lists.
NAMED = (None, "support", "orders", "marketing")


def record(prompt: int, named: str | None) -> dict[str, Any]:
    data: dict[str, Any] = {"prompt": PROMPTS[prompt], "response": f"[answer] {prompt}."}
    if named is not None:
        data["task"] = named
    return data


def expected_task(data: dict[str, Any], place: str) -> str | None:
    """The task a record belongs to where it lies, by the rule as documented; None: none."""
    named = data.get("task")
    if named is not None and named not in TASKS:
        return None
    if named is not None and place and named != place:
        return None
    return named or place or None


def digest(data: dict[str, Any], task: str) -> str:
    parsed = plain(parse_record({**data, "task": task}))
    return content_hash(parsed)


# A line: (record's prompt, what it says of its task, its folder, its file, a BOM before it,
# or a blank line / a line that is no record at all).
placed = st.tuples(
    st.integers(0, len(PROMPTS) - 1),
    st.sampled_from(NAMED),
    st.sampled_from(PLACES),
    st.integers(0, 1),
    st.sampled_from(["record", "record", "record", "bom", "blank", "bad"]),
)


def lay_out(incoming: Path, layout: list[tuple[int, str | None, str, int, str]]) -> list[Path]:
    files: dict[Path, list[bytes]] = {}
    for prompt, named, place, file, kind in layout:
        path = incoming / place / f"export-{file}.jsonl"
        text = json.dumps(record(prompt, named), ensure_ascii=False).encode()
        line = {"record": text, "bom": BOM + text, "blank": b"", "bad": b'{"prompt": "cut'}[kind]
        files.setdefault(path, []).append(line + b"\n")
    for path, lines in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"".join(lines))
    return sorted(files)


def run(incoming: Path, pool: Path, only: set[Path] | None, workers: int) -> ingest.IngestResult:
    """One ingest of ``incoming`` (or of the files ``only``) into ``pool``, as the stage does."""
    known, _ = ingest.known_hashes(pool, TASKS)
    lines = ingest.read_lines(incoming)
    if only is not None:
        names = {str(path.relative_to(incoming)) for path in only}
        lines = (line for line in lines if line.file in names)
    result = ingest.ingest(lines, known, 10_000, "t", workers=workers, tasks=TASKS)
    ingest.add_batch(pool, dt.datetime.now(dt.UTC), result, TASKS)
    return result


def assert_conserved(result: ingest.IngestResult, incoming: Path, only: set[Path] | None) -> None:
    placed_lines: Counter[str | None] = Counter()
    for path in incoming.rglob("*.jsonl"):
        if only is None or path in only:
            folder = ingest.folder_task(str(path.relative_to(incoming)), TASKS)
            placed_lines[folder] += len(path.read_bytes().splitlines())
    by_folder = {folder: sum(counts.values()) for folder, counts in result.by_folder.items()}
    assert by_folder == {folder: n for folder, n in placed_lines.items() if n}
    total = len(result.accepted) + len(result.quarantined) + result.duplicates + result.blank
    assert total == sum(placed_lines.values())


@settings(max_examples=60, deadline=None)
@given(
    layout=st.lists(placed, min_size=1, max_size=24),
    workers=st.sampled_from([1, 2]),
    cut=st.integers(0, 6),
)
def test_every_record_lands_once_per_task_wherever_it_stands(
    layout: list[tuple[int, str | None, str, int, str]], workers: int, cut: int
) -> None:
    expected: dict[str, set[str]] = {task: set() for task in TASKS}
    for prompt, named, place, _, kind in layout:
        data = record(prompt, named)
        task = expected_task(data, place)
        if kind in ("record", "bom") and task is not None:
            expected[task].add(digest(data, task))
    previous = ingest.WINDOW_LINES
    ingest.WINDOW_LINES = 5  # several windows even for a few lines
    try:
        with tempfile.TemporaryDirectory() as tmp:
            incoming, pool = Path(tmp, "incoming"), Path(tmp, "pool")
            files = lay_out(incoming, layout)
            if cut and cut < len(files):  # a run over the first files, then all of them
                first = set(files[:cut])
                assert_conserved(run(incoming, pool, first, workers), incoming, first)
            assert_conserved(run(incoming, pool, None, workers), incoming, None)
            landed: dict[str, list[str]] = {task: [] for task in TASKS}
            for stored in pool_records(pool):
                landed[stored.meta["task"]].append(stored.id)
            again = run(incoming, pool, None, workers)
    finally:
        ingest.WINDOW_LINES = previous
    for task in TASKS:
        assert sorted(landed[task]) == sorted(expected[task]), task
    # A third run over the same files adds nothing: every line is seen before.
    assert not again.accepted and not again.quarantined


def quarantine(pool: Path) -> list[dict[str, Any]]:
    return [
        json.loads(line)
        for path in sorted((pool / "quarantine").glob("*.jsonl"))
        for line in path.read_text().splitlines()
    ]


def test_a_misfiled_record_refiled_where_its_reason_says_reaches_the_pool(tmp_path: Path) -> None:
    incoming, pool = tmp_path / "incoming", tmp_path / "pool"
    misfiled = json.dumps(record(0, "orders")).encode() + b"\n"
    (incoming / "support").mkdir(parents=True)
    (incoming / "support/export.jsonl").write_bytes(b"\n" + misfiled)  # not on line 1
    first = run(incoming, pool, None, 1)
    [entry] = quarantine(pool)
    assert entry["kind"] == "task_mismatch" and entry["folder_task"] == "support"
    assert "move the line to orders/" in entry["reason"]
    assert entry["sha256"] == "raw:" + hashlib.sha256(misfiled.rstrip()).hexdigest()
    assert not first.accepted
    # The same mistake again, in another file of the same folder: a duplicate.
    (incoming / "support/export-2.jsonl").write_bytes(misfiled)
    again = run(incoming, pool, None, 1)
    assert (len(again.accepted), len(again.quarantined), again.duplicates) == (0, 0, 2)
    # Refiled where the reason says: a new line of orders, which takes it.
    (incoming / "orders").mkdir()
    (incoming / "orders/refiled.jsonl").write_bytes(misfiled)
    refiled = run(incoming, pool, None, 1)
    assert len(refiled.accepted) == 1 and not refiled.quarantined
    assert [r.meta["task"] for r in pool_records(pool)] == ["orders"]


def test_quarantine_written_before_entries_named_their_folder_still_marks_its_lines(
    tmp_path: Path,
) -> None:
    """An entry of an earlier version (no ``folder_task``) keys on its file's place."""
    incoming, pool = tmp_path / "incoming", tmp_path / "pool"
    misfiled = json.dumps(record(1, "orders")).encode() + b"\n"
    (incoming / "support").mkdir(parents=True)
    (incoming / "support/export.jsonl").write_bytes(misfiled)
    run(incoming, pool, None, 1)
    [path] = (pool / "quarantine").glob("*.jsonl")
    entries = [json.loads(line) for line in path.read_text().splitlines()]
    old = [{k: v for k, v in e.items() if k != "folder_task"} for e in entries]
    path.write_text("".join(json.dumps(e) + "\n" for e in old))
    again = run(incoming, pool, None, 1)
    assert (len(again.quarantined), again.duplicates) == (0, 1)


def test_a_linked_folder_is_refused_by_name_not_passed_over(tmp_path: Path) -> None:
    incoming, elsewhere = tmp_path / "incoming", tmp_path / "exports"
    elsewhere.mkdir()
    (elsewhere / "month.jsonl").write_text(json.dumps(record(0, None)) + "\n")
    (incoming / "support").mkdir(parents=True)
    (incoming / "support/feedback.jsonl").write_text(json.dumps(record(1, None)) + "\n")
    (incoming / "orders").symlink_to(elsewhere)
    try:
        list(ingest.read_lines(incoming))
    except ingest.LinkedFolder as error:
        assert f"{incoming / 'orders'} is a link to a folder" in str(error)
    else:
        raise AssertionError("a linked folder's lines were passed over without a word")
    # A linked file is read like any other.
    (incoming / "orders").unlink()
    (incoming / "orders").mkdir()
    (incoming / "orders/month.jsonl").symlink_to(elsewhere / "month.jsonl")
    assert [line.file for line in ingest.read_lines(incoming)] == [
        "orders/month.jsonl",
        "support/feedback.jsonl",
    ]
