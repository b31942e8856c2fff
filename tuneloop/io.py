"""Atomic, durable writes and JSON lines.

Every write goes to a temporary sibling first and is renamed into place, so a
crash never leaves a half-written file or folder where a reader (or DVC)
would take it for a finished one. The data is fsynced before the rename and
the folder after it: without both, a power cut shortly after a "finished"
write can leave an empty file or the old one (the rename reaches the disk
before the data, or not at all). Files are created ``0600`` unless a caller
asks otherwise, so records holding users' (scrubbed) text are never
world-readable whatever the umask.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel

PRIVATE = 0o600
M = TypeVar("M", bound=BaseModel)


class ModelFileError(ValueError):
    """A file another step wrote does not hold what its model says (a key missing or misspelt)."""


def fsync_dir(folder: Path) -> None:
    """Make the entries of ``folder`` (a rename into it, a new file) survive a power cut."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and folder under ``root`` (files first, then their folders)."""
    for folder, _, files in os.walk(root):
        for name in files:
            path = Path(folder, name)
            if path.is_symlink():
                continue
            with path.open("rb") as handle:
                os.fsync(handle.fileno())
        fsync_dir(Path(folder))


@contextlib.contextmanager
def atomic_dir(target: Path) -> Iterator[Path]:
    """Yield an empty temporary folder that replaces ``target`` when the block succeeds."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    # Whatever wrote into the folder (a library's save_pretrained) did not fsync.
    fsync_tree(tmp)
    old = target.with_name(f".{target.name}.old")
    if old.exists():
        shutil.rmtree(old)
    if target.exists():
        target.rename(old)
    tmp.rename(target)
    fsync_dir(target.parent)
    shutil.rmtree(old, ignore_errors=True)


def write_bytes(
    path: Path, data: bytes | Sequence[bytes], mode: int = PRIVATE, durable: bool = True
) -> None:
    """Write ``data`` (bytes, or byte strings one after the other) to ``path`` atomically,
    with permissions ``mode``.

    ``durable=False`` skips the fsyncs, for a file rewritten every few seconds
    whose loss in a crash does not matter (a heartbeat).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            os.fchmod(out.fileno(), mode)
            if isinstance(data, bytes):
                out.write(data)
            else:
                out.writelines(data)
            if durable:
                out.flush()
                os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)


def write_text(path: Path, text: str, mode: int = PRIVATE, durable: bool = True) -> None:
    write_bytes(path, text.encode("utf-8"), mode, durable)


def write_json(path: Path, data: Any, mode: int = PRIVATE) -> None:
    write_text(path, json.dumps(data, indent=2, ensure_ascii=False, sort_keys=True) + "\n", mode)


def read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def write_model(path: Path, model: BaseModel, mode: int = PRIVATE) -> None:
    """``model`` as JSON, the way ``write_json`` writes a dict."""
    write_json(path, model.model_dump(mode="json"), mode)


def read_model(path: Path, model: type[M]) -> M:
    """``path`` as a ``model``; ``ModelFileError`` naming the file when it does not fit."""
    try:
        return model.model_validate_json(path.read_bytes())
    except ValueError as error:  # pydantic's ValidationError, for bad JSON too
        raise ModelFileError(
            f"{path} is not a valid {model.__name__} ({error}); rerun the stage that writes it"
        ) from None


def read_yaml(path: Path) -> Any:
    """A YAML file through libyaml's C loader where PyYAML was built with it.

    The pure-Python loader takes 0.3 s for this project's dvc.lock on 2 cores, and a stage
    reads dvc.lock and dvc.yaml a dozen times over (lineage, cards); the C loader is about
    ten times faster and accepts the same documents (``yaml.safe_load`` semantics).
    """
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return yaml.load(path.read_text(encoding="utf-8"), Loader=loader)


def jsonl_text(records: Iterable[Any]) -> str:
    """Records as JSON lines, one object a line."""
    return "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records)


def write_jsonl(path: Path, records: Iterable[Any], mode: int = PRIVATE) -> int:
    """Write records one JSON object a line (atomically); returns how many."""
    text = jsonl_text(records)
    write_text(path, text, mode)
    return text.count("\n")


def read_jsonl(path: Path) -> Iterator[Any]:
    """Read a file this project wrote (trusted JSON lines; untrusted input goes through ingest)."""
    with path.open(encoding="utf-8") as lines:
        for line in lines:
            if line.strip():
                yield json.loads(line)


def remove_all_but(folder: Path, keep: Iterable[str]) -> None:
    """Delete every entry of ``folder`` (files and folders) whose name is not in ``keep``."""
    names = set(keep)
    for entry in folder.iterdir():
        if entry.name in names:
            continue
        if entry.is_dir():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def file_stamp(stat: os.stat_result) -> list[int]:
    """What says a file is unchanged without reading it: a digest remembered under its stamp
    is believed (the pool's in ``records.pool_ids``, clean's in ``clean_cache``).

    The inode and the change time too, which no call can set and any write moves: by size and
    mtime alone, bytes rewritten to the same size with the mtime kept (``cp -p`` or
    ``rsync -t`` over it, a restored backup, ``os.utime``) passed for the old. A copy of the
    project therefore hashes each batch once again, as ``dvc status`` does after one.
    """
    return [stat.st_size, stat.st_mtime_ns, stat.st_ino, stat.st_ctime_ns]


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, e.g. a container's cpuset)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
