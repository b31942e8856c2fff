"""Writing to the append-only pool: one writer at a time, each batch whole or not at all.

An ingest run adds a batch of files to the pool (accepted records and
quarantined lines) that must appear together: the next run dedupes lines
against both, so records without their quarantine file would get their bad
lines quarantined a second time, and a quarantine without its records would
lose the good ones. A rename is atomic for one file only, so a batch is
committed with a small manifest written ahead of the renames:

1. each file is written and fsynced into a staging folder beside the pool
   (``.<pool>.staging/<batch>/``), where no reader looks;
2. ``COMMIT`` (each file's place in the pool and its sha256) is written into
   that folder atomically and durably: this is the commit point;
3. each file is renamed into the pool, then the staging folder is removed.

``recover()``, run under the lock before the pool is read, finishes what a
crash interrupted: a staging folder with ``COMMIT`` is rolled forward (the
renames not yet done are done), one without is deleted (the batch never
happened). The staging folder and the lock live beside the pool, not in it,
because the pool folder is a DVC output hashed whole.

The lock is an ``flock`` (the ``filelock`` package, which DVC already needs)
on ``.<pool>.lock``: a second writer refuses at once, naming the lock, rather
than queueing behind a run that may take minutes; two ingests at once means
two people or schedules doing the same job, and one of them should hear of it.
The kernel drops an ``flock`` when its process dies, so a killed run never
leaves the pool locked.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from filelock import FileLock, Timeout

from tuneloop.io import PRIVATE, fsync_dir, read_json, write_bytes, write_json

log = logging.getLogger(__name__)

COMMIT = "COMMIT"
FOLDER_MODE = 0o750


class PoolBusy(RuntimeError):
    """Another process holds the pool's lock."""


class PoolCorrupt(RuntimeError):
    """A committed batch whose files are neither staged nor in the pool (or differ)."""


def lock_path(pool: Path) -> Path:
    return pool.parent / f".{pool.name}.lock"


def staging_root(pool: Path) -> Path:
    return pool.parent / f".{pool.name}.staging"


@contextlib.contextmanager
def locked(pool: Path) -> Iterator[None]:
    """Hold the pool's exclusive lock for the block, or raise PoolBusy at once."""
    path = lock_path(pool)
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(path, timeout=0)
    try:
        lock.acquire()
    except Timeout:
        raise PoolBusy(
            f"another process is writing to the pool {pool} (it holds {path}); "
            "nothing was read or written. Let that run finish, then run this one again "
            "(it adds only what is not in the pool yet)."
        ) from None
    try:
        yield
    finally:
        lock.release()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as data:
        for chunk in iter(lambda: data.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _move(staged: Path, target: Path) -> None:
    """One rename of the roll-forward, made durable before the next."""
    os.rename(staged, target)
    fsync_dir(target.parent)


def _finish(pool: Path, staging: Path) -> None:
    """Do the renames a committed batch still needs, then drop its staging folder."""
    manifest = read_json(staging / COMMIT)
    for entry in manifest["files"]:
        staged, target = staging / entry["staged"], pool / entry["path"]
        if staged.exists():
            if target.exists():
                raise PoolCorrupt(
                    f"{target} exists, but batch {staging.name} was to add it; "
                    f"compare it with {staged} and remove one, then run again"
                )
            target.parent.mkdir(mode=FOLDER_MODE, parents=True, exist_ok=True)
            _move(staged, target)
        elif not target.exists() or _sha256(target) != entry["sha256"]:
            raise PoolCorrupt(
                f"batch {staging.name} is committed, but {target} is missing or changed "
                "since; restore the pool (dvc checkout / dvc pull) before ingesting again"
            )
    _drop(staging)


def _drop(staging: Path) -> None:
    shutil.rmtree(staging)
    fsync_dir(staging.parent)


def commit(
    pool: Path, batch: str, files: Mapping[str, bytes | Sequence[bytes]], mode: int = PRIVATE
) -> None:
    """Add ``files`` (path inside the pool -> content) to the pool, all of them or none.

    A content is bytes or a sequence of byte strings written one after the other (a month's
    records, without joining them into one copy first). Call it holding ``locked(pool)``,
    after ``recover(pool)``.
    """
    staging = staging_root(pool) / batch
    if staging.exists():
        raise FileExistsError(f"batch {batch} is already being committed ({staging})")
    entries = []
    for number, (name, data) in enumerate(files.items()):
        target = pool / name
        if target.exists():
            raise FileExistsError(f"{target} exists; the pool is append-only")
        digest = hashlib.sha256()
        for part in [data] if isinstance(data, bytes) else data:
            digest.update(part)
        entries.append({"path": name, "staged": str(number), "sha256": digest.hexdigest()})
    staging.mkdir(mode=0o700, parents=True)
    try:
        for entry, data in zip(entries, files.values(), strict=True):
            write_bytes(staging / entry["staged"], data, mode)
        write_json(staging / COMMIT, {"batch": batch, "files": entries})
    except Exception:
        # Before the commit point: the batch never happened (recover() would say the same).
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _finish(pool, staging)


def recover(pool: Path) -> list[str]:
    """Finish or drop the batches a crash interrupted; say what was done, one line each."""
    root = staging_root(pool)
    if not root.is_dir():
        return []
    done = []
    for staging in sorted(p for p in root.iterdir() if p.is_dir()):
        if (staging / COMMIT).exists():
            _finish(pool, staging)
            done.append(f"batch {staging.name}: committed before a crash; its files are in place")
        else:
            _drop(staging)
            done.append(f"batch {staging.name}: interrupted before its commit; dropped")
    for line in done:
        log.warning("pool %s: %s", pool, line)
    return done
