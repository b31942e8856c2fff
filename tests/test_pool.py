"""The pool's writes: a batch whole or not at all across a SIGKILL, and one ingest at a time.

The crashes are real: ingest runs in a child process that kills itself with
SIGKILL at a chosen point of the commit (no ``finally``, no ``except`` runs),
then the next ingest, in this process, must find the pool consistent, repair
it, and have every line in it exactly once.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stages import ingest, task_names
from tests.helpers import ROOT, write_params
from tuneloop.data import pool
from tuneloop.data.records import pool_records

# The whole suite (`make test`): ingest in child processes killed mid-commit
pytestmark = pytest.mark.slow

# Run as `python -c CHILD <point>` in the project folder: ingest, stopped at <point>.
CHILD = """
import os, signal, sys
from stages import ingest
from tuneloop.data import pool

def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)

point = sys.argv[1]
if point == "before_commit":  # every file staged, COMMIT not yet written
    pool.write_json = die
elif point == "between_renames":  # committed, one file renamed into the pool
    real_move, moved = pool._move, []
    def move(staged, target):
        if moved:
            die()
        moved.append(target)
        real_move(staged, target)
    pool._move = move
elif point == "after_renames":  # both files in the pool, staging folder still there
    pool._drop = die
elif point == "hold":  # an ingest that waits, holding the lock, until told to go on
    real_commit = pool.commit
    def commit(*args, **kwargs):
        print("committing", flush=True)
        sys.stdin.readline()
        real_commit(*args, **kwargs)
    pool.commit = commit
ingest.main()
"""

FIRST = [
    {"prompt": f"Question {n} about the Aurora kettle?", "response": "[return] Yes."}
    for n in range(2)
]
NEW = [
    {"prompt": f"Is the Zephyr fan model {n} in stock?", "response": "[shipping] Yes."}
    for n in range(3)
]
BAD = [b'{"prompt": "unterminated\n', b"[1, 2, 3]\n"]


def lines(records: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in records)


@pytest.fixture
def project(in_folder: Path) -> Iterator[Path]:
    """A pool holding FIRST, and a new file (NEW and BAD) waiting in incoming."""
    write_params(in_folder, {"ingest": {"max_reject_rate": 0.9}})
    task_names.main()
    incoming = in_folder / "data/badcases/incoming"
    incoming.mkdir(parents=True)
    (incoming / "first.jsonl").write_bytes(lines(FIRST))
    ingest.main()
    (incoming / "second.jsonl").write_bytes(lines(NEW) + b"".join(BAD))
    yield in_folder


def child(point: str, project: Path, **kwargs: Any) -> subprocess.Popen[str]:
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, point], cwd=project, env=env, text=True, **kwargs
    )


def files(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}


def quarantined(project: Path) -> list[str]:
    folder = project / "data/pool/quarantine"
    return [json.loads(x)["sha256"] for p in sorted(folder.glob("*.jsonl")) for x in p.open()]


def metrics(project: Path) -> dict[str, Any]:
    return json.loads((project / "metrics/ingest.json").read_text())


def assert_every_line_once(project: Path) -> None:
    ids = [r.id for r in pool_records(project / "data/pool")]
    assert len(ids) == len(set(ids)) == len(FIRST) + len(NEW)
    sha = quarantined(project)
    assert Counter(sha) == Counter(
        "raw:" + hashlib.sha256(raw.rstrip(b"\n")).hexdigest() for raw in BAD
    )
    assert not list(pool.staging_root(project / "data/pool").iterdir())


@pytest.mark.parametrize(
    ("point", "appears"),
    [
        ("before_commit", set()),  # rolled back: the rerun ingests the file
        ("between_renames", {"records"}),  # rolled forward: the rerun finds it all done
        ("after_renames", {"records", "quarantine"}),
    ],
)
def test_a_kill_mid_commit_is_repaired_and_the_rerun_ingests_once(
    project: Path, point: str, appears: set[str]
) -> None:
    data = project / "data/pool"
    before = files(data)
    killed = child(point, project)
    assert killed.wait(timeout=300) == -signal.SIGKILL
    added = {Path(name).parts[0] for name in files(data) - before}
    assert added == appears
    staged = list(pool.staging_root(data).iterdir())
    assert len(staged) == 1 and (staged[0] / pool.COMMIT).exists() == (point != "before_commit")

    ingest.main()
    assert_every_line_once(project)
    m = metrics(project)
    assert m["lines"] == m["accepted"] + m["quarantined"] + m["duplicates"]
    rerun_adds = point == "before_commit"
    assert m["accepted"] == (len(NEW) if rerun_adds else 0)
    assert m["quarantined"] == (len(BAD) if rerun_adds else 0)
    # And once more: nothing left to add.
    ingest.main()
    assert metrics(project)["duplicates"] == metrics(project)["lines"]
    assert_every_line_once(project)


def test_a_second_ingest_refuses_while_one_is_writing(project: Path) -> None:
    data = project / "data/pool"
    first = child("hold", project, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert first.stdout is not None and first.stdin is not None
        while (said := first.stdout.readline()) != "committing\n":
            assert said, "the first ingest ended before committing"
        before = files(data)
        with pytest.raises(pool.PoolBusy, match="another process is writing to the pool"):
            ingest.main()
        assert files(data) == before  # the refused run wrote nothing
        first.stdin.write("go on\n")
        first.stdin.flush()
        assert first.wait(timeout=300) == 0
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert metrics(project)["accepted"] == len(NEW)
    ingest.main()  # now it may: and finds nothing new
    assert metrics(project)["duplicates"] == metrics(project)["lines"]
    assert_every_line_once(project)


def test_a_commit_never_overwrites_a_pool_file(project: Path) -> None:
    data = project / "data/pool"
    existing = next((data / "records" / "support").glob("*.jsonl"))
    name = f"records/support/{existing.name}"
    with pytest.raises(FileExistsError, match="append-only"):
        pool.commit(data, "batch", {name: b"{}\n"})
    assert not (pool.staging_root(data) / "batch").exists()


def test_a_committed_batch_whose_file_vanished_is_reported_not_guessed(project: Path) -> None:
    data = project / "data/pool"
    staging = pool.staging_root(data) / "lost"
    staging.mkdir(parents=True)
    entry = {"path": "records/lost.jsonl", "staged": "0", "sha256": "0" * 64}
    (staging / pool.COMMIT).write_text(json.dumps({"batch": "lost", "files": [entry]}))
    with pytest.raises(pool.PoolCorrupt, match=r"records/lost\.jsonl is missing"):
        pool.recover(data)
