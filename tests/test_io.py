"""Atomic writes are durable (data fsynced before the rename, the folder after) and private;
a record written from its model reads back through it, and a file that is not one is refused
naming the file."""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

import pytest

from tuneloop import io
from tuneloop.data.metrics import CleanMetrics
from tuneloop.models import BaseMetrics

# The fast tier: no pipeline, server or rank.
pytestmark = pytest.mark.fast


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """What reached the kernel, in order: fsync of a path, rename onto a path.

    fsync's effect only shows after a power cut, so the calls themselves are
    what can be checked here.
    """
    seen: list[tuple[str, str]] = []
    real_fsync, real_replace, real_rename = os.fsync, os.replace, Path.rename

    def fsync(fd: int) -> None:
        seen.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src: str, dst: str) -> None:
        seen.append(("rename", str(dst)))
        real_replace(src, dst)

    def rename(self: Path, target: Path) -> Path:
        seen.append(("rename", str(target)))
        return real_rename(self, target)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(Path, "rename", rename)
    return seen


def test_write_text_fsyncs_the_file_then_renames_then_fsyncs_the_folder(
    tmp_path: Path, events: list[tuple[str, str]]
) -> None:
    target = tmp_path / "sub" / "out.json"
    io.write_json(target, {"a": 1})
    assert [kind for kind, _ in events] == ["fsync", "rename", "fsync"]
    temp = Path(events[0][1])
    assert temp.parent == target.parent and temp.name.startswith(".out.json.")
    assert events[1] == ("rename", str(target))
    assert events[2] == ("fsync", str(target.parent))
    assert io.read_json(target) == {"a": 1}


def test_atomic_dir_fsyncs_everything_inside_before_the_rename(
    tmp_path: Path, events: list[tuple[str, str]]
) -> None:
    target = tmp_path / "model"
    with io.atomic_dir(target) as out:
        (out / "nested").mkdir()
        (out / "nested" / "weights.bin").write_bytes(b"\0" * 10)  # as a library would: no fsync
    renamed = events.index(("rename", str(target)))
    synced = {Path(path).name for kind, path in events[:renamed] if kind == "fsync"}
    assert {"weights.bin", "nested"} <= synced
    assert events[renamed + 1] == ("fsync", str(tmp_path))


def test_not_durable_skips_the_fsyncs(tmp_path: Path, events: list[tuple[str, str]]) -> None:
    io.write_text(tmp_path / "beat.json", "{}", durable=False)
    assert [kind for kind, _ in events] == ["rename"]


def test_files_are_private_whatever_the_umask(tmp_path: Path) -> None:
    previous = os.umask(0)
    try:
        io.write_jsonl(tmp_path / "records.jsonl", [{"a": 1}])
        io.write_text(tmp_path / "shared.txt", "x", mode=0o640)
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "records.jsonl").stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "shared.txt").stat().st_mode) == 0o640


def test_a_failed_write_leaves_neither_file_nor_temp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(fd: int) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="disk full"):
        io.write_text(tmp_path / "out.txt", "x")
    assert not list(tmp_path.iterdir())


def test_a_metrics_file_reads_back_through_its_model(tmp_path: Path) -> None:
    path = tmp_path / "metrics/base.json"
    written = BaseMetrics(base="org/model")  # a hub base: no numbers of a built one
    io.write_model(path, written)
    # What a kind of base has no number for is left out, not null (dvc metrics show reads it).
    assert json.loads(path.read_text()) == {"base": "org/model"}
    assert io.read_model(path, BaseMetrics) == written


def test_a_metrics_file_that_is_not_its_model_is_refused_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "metrics/clean.json"
    io.write_json(path, {"train": 7, "removed": {}})  # an older clean's, or edited by hand
    named = re.escape(f"{path} is not a CleanMetrics")
    with pytest.raises(io.ModelFileError, match=rf"{named} \(records_in: Field required;"):
        io.read_model(path, CleanMetrics)
    path.write_text('{"train": 7,')  # cut short
    with pytest.raises(io.ModelFileError, match=rf"{named} \(the file: Invalid JSON"):
        io.read_model(path, CleanMetrics)
    path.write_text(json.dumps({"base": "x", "parameters": "many"}))
    with pytest.raises(io.ModelFileError, match=r"parameters: Input should be a valid integer"):
        io.read_model(path, BaseMetrics)
