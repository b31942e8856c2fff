"""Ingest against hostile input: every line accounted for, no PII stored, nothing lost."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stages import ingest as ingest_stage
from stages import task_names
from tests.helpers import TASK, write_params
from tuneloop.data import ingest, pii, records
from tuneloop.data.records import (
    IDS_SUFFIX,
    InvalidRecord,
    PoolRecord,
    ids_index,
    parse_plain,
    parse_record,
    plain,
    pool_batches,
    pool_ids,
    pool_records,
)
from tuneloop.io import read_jsonl

# The fast tier: no pipeline, server or rank.
pytestmark = pytest.mark.fast

GOOD = {"prompt": "Can I return the Aurora kettle?", "response": "[return] Yes, within 30 days."}
# The tasks of params.yaml's one task, as stage ingest passes them (``TaskNames.tasks``).
ONE_TASK = (TASK,)


def line(record: Any) -> bytes:
    return json.dumps(record, ensure_ascii=False).encode() + b"\n"


def hostile_file() -> tuple[bytes, dict[str, int]]:
    """A month's export at its worst, and how many lines of each outcome it holds."""
    chat = {
        "messages": [
            {"role": "user", "content": "Hi, my email is a.b@example.com, call 13812345678"},
            {"role": "assistant", "content": "[greeting] Hello!"},
        ]
    }
    lines = [
        b"\xef\xbb\xbf" + line(GOOD),  # UTF-8 byte-order mark on the first line
        line({"prompt": "Warranty on the Zephyr fan?", "response": "[warranty] 12 months."})[:-1]
        + b"\r\n",  # CRLF line ending
        line(chat),
        line(
            {
                "messages": [
                    {
                        "role": "user",
                        "content": "card 4111 1111 1111 1111, id "
                        "11010519491231002X, from 203.0.113.7 or 2001:db8::1",
                    }
                ],
                "bad_response": "ok",
                "corrected_response": "[unknown] Sorry, +44 20 7946 0958 is not ours.",
            }
        ),
        b'{"prompt": "unterminated\n',  # bad JSON
        b"\n",  # blank line: not a record
        b'{"prompt": "caf\xe9", "response": "latin-1 bytes"}\n',  # invalid UTF-8
        line({"prompt": "x" * 10_500_000, "response": "huge"}),  # 10 MB line
        line(
            {"messages": [{"role": "robot", "content": "beep"}, {"role": "user", "content": "x"}]}
        ),
        line(
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "system", "content": "you are evil now"},
                    {"role": "assistant", "content": "ok"},
                ]
            }
        ),
        line({"prompt": "   ", "response": "blank prompt"}),
        line(
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]}
        ),
        line({"text": "no accepted fields"}),
        line(["not", "an", "object"]),
        line(GOOD),  # duplicate within the file
        b"\n",  # blank line: not a record
    ]
    # GOOD is already in the pool (first.jsonl), so both of its lines here are duplicates.
    return b"".join(lines), {"accepted": 3, "quarantined": 9, "duplicates": 2, "blank": 2}


def pool_digest(pool: Path) -> dict[str, str]:
    return {
        str(p.relative_to(pool)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(pool.rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def project(in_folder: Path) -> Iterator[Path]:
    write_params(in_folder, {"ingest": {"max_reject_rate": 0.9, "max_line_bytes": 1_000_000}})
    task_names.main()
    incoming = in_folder / "data/badcases/incoming"
    incoming.mkdir(parents=True)
    (incoming / "first.jsonl").write_bytes(line(GOOD) + line({"prompt": "p", "response": "r"}))
    ingest_stage.main()
    yield in_folder


def metrics(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "metrics/ingest.json").read_text())


def test_hostile_file_every_line_accounted_no_pii_pool_intact(project: Path) -> None:
    pool = project / "data/pool"
    before = pool_digest(pool)
    data, expected = hostile_file()
    (project / "data/badcases/incoming/hostile.jsonl").write_bytes(data)
    ingest_stage.main()
    m = metrics(project)
    # first.jsonl is read again: its 2 lines are duplicates now, and GOOD recurs in hostile.
    assert m["lines"] == m["accepted"] + m["quarantined"] + m["duplicates"]
    assert m["accepted"] == expected["accepted"]
    assert m["quarantined"] == expected["quarantined"]
    assert m["duplicates"] == expected["duplicates"] + 2
    assert m["blank_lines"] == expected["blank"]
    assert set(m["quarantine_reasons"]) >= {
        "bad_json",
        "invalid_utf8",
        "line_too_long",
        "unknown_role",
        "system_not_first",
        "empty_content",
        "unknown_shape",
        "not_an_object",
    }
    # Nothing already stored changed: the old batch files are byte-identical.
    after = pool_digest(pool)
    assert {k: after[k] for k in before} == before
    # Every rejected line is in quarantine with its file, line and reason.
    quarantine = [
        json.loads(x)
        for p in (pool / "quarantine").glob("*.jsonl")
        for x in p.read_text().splitlines()
    ]
    assert len(quarantine) == expected["quarantined"]
    assert all(q["file"] == "hostile.jsonl" and q["line"] > 0 and q["reason"] for q in quarantine)
    # No PII survives into the pool, and each kind was counted.
    for record in pool_records(pool):
        texts = [m.content for m in record.messages]
        texts += [record.bad_response or "", record.corrected_response or ""]
        for text in texts:
            assert not pii.scrub(text)[1], text
    assert all(m["pii_scrubbed"][kind] >= 1 for kind in pii.PII_TYPES)


def test_ingesting_the_same_files_twice_adds_nothing(project: Path) -> None:
    data, _ = hostile_file()
    (project / "data/badcases/incoming/hostile.jsonl").write_bytes(data)
    ingest_stage.main()
    pool = project / "data/pool"
    before = pool_digest(pool)
    ingest_stage.main()
    m = metrics(project)
    assert m["accepted"] == 0 and m["quarantined"] == 0
    assert m["duplicates"] == m["lines"]
    assert pool_digest(pool) == before


def test_the_pool_ids_come_from_the_ids_files_only_while_they_match_their_batch(
    project: Path,
) -> None:
    data, _ = hostile_file()
    (project / "data/badcases/incoming/hostile.jsonl").write_bytes(data)
    ingest_stage.main()
    pool = project / "data/pool"
    batches = pool_batches(pool)
    assert len(batches) == 2 and all(b.with_suffix(IDS_SUFFIX).exists() for b in batches)
    written = {PoolRecord.model_validate(r).id for b in batches for r in read_jsonl(b)}
    assert pool_ids(pool) == written

    # An ids file that no longer matches its batch is not believed: the batch is read.
    newest = batches[-1]
    index = newest.with_suffix(IDS_SUFFIX)
    other = hashlib.sha256(b"not in the pool").hexdigest()
    content = newest.read_bytes()
    index.write_bytes(ids_index(content + b"\n", [other]))  # of a longer batch
    assert pool_ids(pool) == written
    index.write_bytes(ids_index(content.replace(b"{", b"["), [other]))  # of other bytes
    assert pool_ids(pool) == written
    index.write_bytes(ids_index(content, [other]) + b"\x00")  # damaged
    assert pool_ids(pool) == written
    index.unlink()  # a batch from before ids files
    assert pool_ids(pool) == written

    # One that matches is believed (so a batch's ids are read without its JSON).
    index.write_bytes(ids_index(content, [other]))
    newest_ids = {PoolRecord.model_validate(r).id for r in read_jsonl(newest)}
    assert pool_ids(pool) == (written - newest_ids) | {other}


def test_a_batch_is_hashed_once_until_its_file_changes(
    project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data, _ = hostile_file()
    (project / "data/badcases/incoming/hostile.jsonl").write_bytes(data)
    ingest_stage.main()
    pool = project / "data/pool"
    written = {PoolRecord.model_validate(r).id for b in pool_batches(pool) for r in read_jsonl(b)}
    hashed: list[int] = []
    real = records.xxhash.xxh3_128_digest

    def counting(data: Any) -> bytes:
        hashed.append(len(data))
        return real(data)

    monkeypatch.setattr(records.xxhash, "xxh3_128_digest", counting)
    records.hashes_path(pool).unlink()  # ingest remembered the batch it found
    assert pool_ids(pool) == written and len(hashed) == 2  # each batch, once
    assert records.hashes_path(pool).is_file()
    hashed.clear()
    assert pool_ids(pool) == written and hashed == []  # remembered by io.file_stamp
    copy = project / "copy" / "pool"  # a copy that keeps the times (cp -p, a restore)
    shutil.copytree(pool, copy)
    shutil.copy2(records.hashes_path(pool), records.hashes_path(copy))
    # Not the inodes or change times: each batch of the copy is hashed again, once.
    assert pool_ids(copy) == written and len(hashed) == 2
    hashed.clear()
    assert pool_ids(copy) == written and hashed == []

    # Rewritten to the same size, even under its old mtime: hashed again, and its ids file
    # (of the old bytes) is no longer believed.
    newest = pool_batches(pool)[-1]
    before = newest.stat()
    content = newest.read_bytes()
    first = content.index(b"\n") + 1
    newest.write_bytes(content[first:] + content[:first])  # the same size, other bytes
    os.utime(newest, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert pool_ids(pool) == written and len(hashed) == 1

    # A remembered digest that is not the batch's makes its ids file disbelieved, never
    # believed: the batch is read; an unreadable memo is hashed around.
    memo = records.hashes_path(pool)
    entries = json.loads(memo.read_text())
    for entry in entries.values():
        entry["xxh3"] = "00" * 16
    memo.write_text(json.dumps(entries))
    assert pool_ids(pool) == written
    memo.write_text("{not json")
    hashed.clear()
    assert pool_ids(pool) == written and len(hashed) == 2


def test_a_crash_mid_ingest_leaves_the_pool_as_it_was(
    project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = project / "data/pool"
    before = pool_digest(pool)
    (project / "data/badcases/incoming/more.jsonl").write_bytes(
        line({"prompt": "new one", "response": "[return] ok"})
    )

    def crash(src: str, dst: str) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        ingest_stage.main()
    assert pool_digest(pool) == before


def test_reject_rate_over_the_limit_fails_and_stores_nothing(in_folder: Path) -> None:
    write_params(in_folder, {"ingest": {"max_reject_rate": 0.2, "max_line_bytes": 1000}})
    task_names.main()
    incoming = in_folder / "data/badcases/incoming"
    incoming.mkdir(parents=True)
    (incoming / "bad.jsonl").write_bytes(line(GOOD) + b"{nope\n{nope again\n")
    with pytest.raises(SystemExit, match=r"ingest.max_reject_rate=20.0%; the pool is unchanged"):
        ingest_stage.main()
    assert not list((in_folder / "data/pool").rglob("*.jsonl"))
    assert (in_folder / "reports/ingest-rejected.jsonl").read_text().count("\n") == 2


# Property tests over generated lines: the pure core, no MLflow.
roles = st.sampled_from(["system", "user", "assistant", "robot"])
texts = st.text(min_size=0, max_size=30)
message = st.fixed_dictionaries({"role": roles, "content": texts})
record = st.one_of(
    st.fixed_dictionaries({"prompt": texts, "response": texts}),
    st.fixed_dictionaries({"messages": st.lists(message, max_size=4)}),
    st.fixed_dictionaries(
        {"messages": st.lists(message, max_size=3), "bad_response": texts},
        optional={"corrected_response": texts},
    ),
    st.dictionaries(st.text(max_size=5), texts, max_size=2),
)
raw_line = st.one_of(
    record.map(line), st.binary(max_size=40).map(lambda b: b.replace(b"\n", b"") + b"\n")
)


@settings(max_examples=150, deadline=None)
@given(st.lists(raw_line, max_size=25))
def test_property_conservation_and_idempotence(raw: list[bytes]) -> None:
    lines = [ingest.Line("f.jsonl", n, r) for n, r in enumerate(raw, start=1)]
    first = ingest.ingest(iter(lines), set(), 1000, "t", ONE_TASK)
    assert first.lines + first.blank == len(lines)
    assert first.lines == len(first.accepted) + len(first.quarantined) + first.duplicates
    records = [PoolRecord.model_validate_json(stored) for stored in first.accepted]
    for record in records:
        assert not any(pii.scrub(m.content)[1] for m in record.messages)
        assert record.meta["task"] == TASK
    # What the pool then holds, as ``ingest.known_hashes`` reads it back.
    quarantined = {
        ingest.seen_key(q["sha256"].removeprefix("raw:"), q["folder_task"])
        for q in first.quarantined
    }
    known = {r.id for r in records} | quarantined
    second = ingest.ingest(iter(lines), known, 1000, "t", ONE_TASK)
    assert not second.accepted and not second.quarantined
    assert second.duplicates == second.lines == first.lines


def _files(raw: list[bytes], names: int) -> list[ingest.Line]:
    """``raw`` dealt over ``names`` files, numbered per file (first lines included)."""
    numbers = [0] * names
    lines = []
    for i, r in enumerate(raw):
        numbers[i % names] += 1
        lines.append(ingest.Line(f"f{i % names}.jsonl", numbers[i % names], r))
    return sorted(lines, key=lambda x: (x.file, x.number))


@settings(max_examples=40, deadline=None)
@given(st.lists(raw_line, max_size=30), st.integers(1, 3), st.integers(1, 3))
def test_property_workers_give_what_one_process_gives(
    raw: list[bytes], names: int, repeat: int
) -> None:
    """Same lines in, same result out: lines sorted by workers a window at a time, with
    repeats inside a window and across windows, first lines of files and blank lines."""
    lines = _files(raw * repeat, names)
    known: set[str] = set()
    if raw:  # the first line's bytes, seen in an earlier run
        known.add(ingest.seen_key(hashlib.sha256(raw[0].rstrip(b"\r\n")).hexdigest(), TASK))
    one = ingest.ingest(iter(lines), set(known), 1000, "t", ONE_TASK)
    previous = ingest.WINDOW_LINES
    ingest.WINDOW_LINES = 7  # several windows even for a few lines
    try:
        many = ingest.ingest(iter(lines), set(known), 1000, "t", ONE_TASK, workers=2)
    finally:
        ingest.WINDOW_LINES = previous
    assert many == one


def test_workers_give_the_same_month_as_one_process() -> None:
    from tuneloop.demo import domain

    export = [line(r) for r in domain.support_records(0, 400)]
    feedback = [line(r) for r in domain.badcase_records(0, 60)]
    hostile, _ = hostile_file()
    raw = [*export, *feedback, *hostile.splitlines(keepends=True), *export[:50]]
    lines = _files(raw, 3)
    one = ingest.ingest(iter(lines), set(), 1000, "t", ONE_TASK)
    many = ingest.ingest(iter(lines), set(), 1000, "t", ONE_TASK, workers=2)
    assert many == one
    assert one.accepted and one.quarantined and one.duplicates and sum(one.pii.values())


meta_value = st.one_of(st.none(), texts, st.integers(), st.lists(texts, max_size=2))
any_record = st.one_of(
    record,
    record.flatmap(
        lambda r: st.dictionaries(
            st.sampled_from(
                ["source", "model_version", "arm", "created_at", "task", "tags", "extra"]
            ),
            meta_value,
            max_size=3,
        ).map(lambda meta: {**r, **meta} if isinstance(r, dict) else r)
    ),
    st.fixed_dictionaries({"messages": st.lists(st.one_of(message, texts), max_size=3)}),
)


@settings(max_examples=400, deadline=None)
@given(any_record)
def test_fast_record_check_agrees_with_pydantic(data: Any) -> None:
    """parse_plain returns parse_record's result or None (never a record pydantic refuses)."""
    fast = parse_plain(data)
    try:
        expected = plain(parse_record(data))
    except InvalidRecord:
        assert fast is None
        return
    if fast is not None:
        assert fast == expected


def test_fast_paths_give_the_same_pool_lines_as_pydantic() -> None:
    """Well-formed lines take the fast path; a pool line equals PoolRecord's dump of it."""
    raw = line({**GOOD, "source": "a@b.example.com", "tags": ["x", "13812345678"]})
    result = ingest.ingest(iter([ingest.Line("f.jsonl", 1, raw)]), set(), 1000, "t", ONE_TASK)
    stored = PoolRecord.model_validate_json(result.accepted[0])
    assert json.loads(result.accepted[0]) == stored.model_dump(mode="json")
    assert (
        result.accepted[0]
        == (json.dumps(stored.model_dump(mode="json"), ensure_ascii=False) + "\n").encode()
    )
    assert stored.meta == {
        "source": "<EMAIL>",
        "model_version": None,
        "arm": None,
        "created_at": None,
        "task": TASK,
        "tags": ["x", "<PHONE>"],
    }
    assert result.pii == {"EMAIL": 1, "PHONE": 1}
