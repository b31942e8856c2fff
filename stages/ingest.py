"""Stage ``ingest``: production badcases and exports into the append-only pool.

Reads:  every ``*.jsonl`` under ``paths.incoming``; the pool so far; the tasks' names
        (``metrics/task_names.json``, stage ``task_names``). Each record is routed to its task
        by its folder (``<incoming>/<task>/``), its ``task`` field or, in a project of one
        task, by being there; one for no listed task is quarantined with the reason.
Writes: one new batch file per task under ``paths.pool``/records/<task> (accepted records,
        each with its provenance; a task of ``records: all`` gets every task's too) and one
        under ``paths.pool``/quarantine (rejected
        lines with file, line, byte offset, reason and a scrubbed excerpt);
        ``metrics/ingest.json``; ``paths.reports``/ingest-rejected.jsonl when
        too many lines are rejected.
Params: ``ingest``, ``paths``; the tasks' names through ``metrics/task_names.json`` alone, so
        a change to a task's own settings does not rerun ingest.

Every non-blank line ends in exactly one of: accepted, quarantined, or counted as a
duplicate of a record already in the pool, with PII replaced by typed placeholders before
anything is hashed or stored (``tuneloop.data.ingest``). Files are written ``0600``.
Nothing in the pool is ever rewritten: a run adds its records and quarantine files
together or nothing (``tuneloop.data.pool``), holding the pool's lock, so a second ingest
at the same time refuses instead of adding the same lines twice.
"""

from __future__ import annotations

import datetime as dt
import logging
from pathlib import Path

from tuneloop.data import ingest
from tuneloop.data import pool as pool_writes
from tuneloop.data.metrics import TaskNames
from tuneloop.data.records import RECORDS, task_records
from tuneloop.io import read_model, write_jsonl
from tuneloop.params import Params, load_params
from tuneloop.stage import logged_after, metrics_path, setup_logging, write_metrics

STAGE = "ingest"
log = logging.getLogger(__name__)


def task_names(params: Params) -> TaskNames:
    """The tasks records are routed to, as stage ``task_names`` wrote them."""
    path = metrics_path(params, "task_names")
    if not path.exists():
        raise SystemExit(
            f"ingest: {path} is missing: it holds the tasks' names that records are routed "
            "to; `dvc repro ingest` writes it first (stage task_names), or run "
            "`python -m stages.task_names`"
        )
    return read_model(path, TaskNames)


def refuse_unsorted(pool: Path, tasks: tuple[str, ...]) -> None:
    """Stop on a pool written before every project listed its tasks: its batches lie in
    ``records/`` itself, where no task's stages read them."""
    records = pool / RECORDS
    loose = sorted(p.name for p in records.glob("*.jsonl"))
    if loose:
        folder = task_records(pool, tasks[0])
        raise SystemExit(
            f"ingest: {records} holds {len(loose)} batch(es) from before tasks were "
            f"listed ({loose[0]}, ...), which no task's stages read. They are the records of "
            f"the one task then: move them, with their .ids files, into {folder}/ "
            f"(mkdir -p {folder} && mv {records}/*.jsonl {records}/*.ids "
            f"{folder}/), then run ingest again; the pool is unchanged"
        )


def main() -> None:
    setup_logging()
    params = load_params()
    pool = params.paths.pool
    with pool_writes.locked(pool), logged_after(STAGE, params):
        pool_writes.recover(pool)
        listed = task_names(params)
        tasks = listed.tasks
        refuse_unsorted(pool, tasks)
        known, pooled = ingest.known_hashes(pool, tasks)
        now = dt.datetime.now(dt.UTC)
        try:
            result = ingest.ingest_folder(
                params.paths.incoming,
                known,
                params.ingest.max_line_bytes,
                now.isoformat(timespec="seconds"),
                tasks=tasks,
            )
        except ingest.LinkedFolder as error:
            raise SystemExit(f"ingest: {error}; the pool is unchanged") from None
        metrics = ingest.metrics(result, pooled)
        log.info(
            "ingest: %d lines -> %d accepted, %d quarantined, %d duplicates",
            result.lines,
            len(result.accepted),
            len(result.quarantined),
            result.duplicates,
        )
        limit = params.ingest.max_reject_rate
        if result.reject_rate > limit:
            # Nothing enters the pool from a batch this bad: fix the export, then ingest again.
            rejected = params.paths.reports / "ingest-rejected.jsonl"
            write_jsonl(rejected, result.quarantined)
            refused = metrics.model_copy(update={"pool_records": pooled})
            write_metrics(params, STAGE, refused.model_dump())
            raise SystemExit(
                f"ingest: {result.reject_rate:.1%} of lines were rejected, over "
                f"ingest.max_reject_rate={limit:.1%}; the pool is unchanged. Each rejected "
                f"line and its reason: {rejected}"
            )
        ingest.add_batch(pool, now, result, tasks, everyone=listed.all_records)
        write_metrics(params, STAGE, metrics.model_dump())


if __name__ == "__main__":
    main()
