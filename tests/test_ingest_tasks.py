"""Ingest routes each record to its task, by folder or by field; a record for no task is
quarantined with the reason, and nothing is dropped."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from stages import ingest as ingest_stage
from stages import task_names
from tests.helpers import task_entry, write_params
from tuneloop.data.records import pool_records
from tuneloop.io import read_jsonl

# The whole suite (`make test`): the ingest stage on files for several tasks
pytestmark = pytest.mark.slow

KETTLE = {"prompt": "Can I return the Aurora kettle?", "response": "[return] Yes, within 30 days."}
LISTING = {"prompt": "Write the Aurora kettle's listing.", "response": "Aurora kettle: 1.7 l."}
TASKS = {task: task_entry(task) for task in ("support", "copy")}


def lines(*records: dict[str, Any]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)


def project(folder: Path, tasks: dict[str, Any]) -> Path:
    path = write_params(folder, {"ingest": {"max_reject_rate": 0.9, "max_line_bytes": 100_000}})
    params = yaml.safe_load(path.read_text())
    params["tasks"] = tasks
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    task_names.main()
    incoming = folder / "data/badcases/incoming"
    incoming.mkdir(parents=True)
    return incoming


def pooled(folder: Path) -> list[tuple[str | None, str]]:
    return sorted(
        (r.meta.get("task"), r.messages[0].content) for r in pool_records(folder / "data/pool")
    )


def quarantined(folder: Path) -> list[tuple[str, str, str]]:
    found = []
    for path in sorted((folder / "data/pool/quarantine").glob("*.jsonl")):
        found += [(e["file"], e["kind"], e["reason"]) for e in read_jsonl(path)]
    return sorted(found)


def test_records_go_to_their_tasks_and_the_rest_to_quarantine(in_folder: Path) -> None:
    incoming = project(in_folder, TASKS)
    (incoming / "support").mkdir()
    (incoming / "copy").mkdir()
    (incoming / "support/router-feedback.jsonl").write_text(lines(KETTLE))
    (incoming / "copy/export.jsonl").write_text(
        lines(LISTING, KETTLE, {**KETTLE, "prompt": "Lid cracked?", "task": "support"})
    )
    (incoming / "export.jsonl").write_text(
        lines(
            {**LISTING, "prompt": "A listing for the blender.", "task": "copy"},
            {**KETTLE, "task": "marketing"},
            {**KETTLE, "prompt": "Where is my order?"},
        )
    )
    ingest_stage.main()
    # The same conversation for two tasks is two records, one each.
    assert pooled(in_folder) == [
        ("copy", "A listing for the blender."),
        ("copy", "Can I return the Aurora kettle?"),
        ("copy", "Write the Aurora kettle's listing."),
        ("support", "Can I return the Aurora kettle?"),
    ]
    assert [(file, kind) for file, kind, _ in quarantined(in_folder)] == [
        ("copy/export.jsonl", "task_mismatch"),
        ("export.jsonl", "no_task"),
        ("export.jsonl", "unknown_task"),
    ]
    reasons = " | ".join(reason for *_, reason in quarantined(in_folder))
    assert "task 'marketing' is none of params.yaml's tasks ['support', 'copy']" in reasons
    assert "lies in copy/, task 'copy''s folder" in reasons
    assert "no task's folder (support/, copy/)" in reasons
    metrics = json.loads((in_folder / "metrics/ingest.json").read_text())
    assert (metrics["accepted"], metrics["quarantined"]) == (4, 3)
    assert metrics["accepted_by_task"] == {"copy": 3, "support": 1}
    # Each task's records in its own folder of the pool, the folder its stages depend on.
    records = in_folder / "data/pool/records"
    assert sorted(p.relative_to(records).parent.as_posix() for p in records.rglob("*.jsonl")) == [
        "copy",
        "support",
    ]
    assert [r.meta["task"] for r in pool_records(in_folder / "data/pool", "support")] == ["support"]


def test_one_listed_task_takes_every_record_without_one(in_folder: Path) -> None:
    incoming = project(in_folder, {"support": TASKS["support"]})
    (incoming / "export.jsonl").write_text(lines(KETTLE, {**LISTING, "task": "copy"}))
    ingest_stage.main()
    assert pooled(in_folder) == [("support", "Can I return the Aurora kettle?")]
    assert [kind for _, kind, _ in quarantined(in_folder)] == ["unknown_task"]


def test_a_task_on_every_tasks_records_gets_a_copy_of_each(in_folder: Path) -> None:
    everyone = {"folder": "tasks/all", "registered_model": "tuneloop-all", "records": "all"}
    incoming = project(in_folder, {**TASKS, "all": everyone})
    (incoming / "support").mkdir()
    (incoming / "copy").mkdir()
    (incoming / "support/feedback.jsonl").write_text(lines(KETTLE))
    (incoming / "copy/export.jsonl").write_text(lines(LISTING))
    ingest_stage.main()
    pool = in_folder / "data/pool"
    mine = [(r.meta["task"], r.messages[0].content) for r in pool_records(pool, "all")]
    assert sorted(mine) == [
        ("copy", "Write the Aurora kettle's listing."),
        ("support", "Can I return the Aurora kettle?"),
    ]
    # A copy: each task still has its own, and ingest counts each record once.
    assert [r.meta["task"] for r in pool_records(pool, "support")] == ["support"]
    metrics = json.loads((in_folder / "metrics/ingest.json").read_text())
    assert metrics["accepted_by_task"] == {"copy": 1, "support": 1}
    # Ingested again, nothing is new: the copies are no records of their own.
    (incoming / "copy/export-2.jsonl").write_text(lines(LISTING))
    ingest_stage.main()
    assert len(list(pool_records(pool, "all"))) == 2


def test_a_pool_from_before_tasks_were_listed_is_refused_with_the_move(in_folder: Path) -> None:
    incoming = project(in_folder, {"support": {"folder": "."}})
    old = in_folder / "data/pool/records/20260101T000000000000Z.jsonl"
    old.parent.mkdir(parents=True)
    old.write_text("{}\n")
    (incoming / "export.jsonl").write_text(lines(KETTLE))
    with pytest.raises(SystemExit, match=r"holds 1 batch\(es\) from before tasks were listed"):
        ingest_stage.main()
    # Nothing moved, nothing added.
    assert [p.name for p in (in_folder / "data/pool/records").iterdir()] == [old.name]
