"""Stage ``clean``: pooled records into training chats, a validation split and DPO pairs.

Reads:  ``paths.pool`` records; eval suite items under ``paths.eval_suites`` (all but the
        fixed-badcase suite, see ``tuneloop.judge.suites.held_out_questions``); the base model's
        tokenizer (for the token limit); ``paths.clean_cache``; ``paths.init``/init.json
        (the pool batches the start already trained on).
Writes: ``paths.clean``/train.jsonl, val.jsonl (``{"id", "messages"}``), dpo.jsonl
        (``{"id", "prompt", "chosen", "rejected"}``), train.turns.npz (the key of each user
        turn of train.jsonl, for preflight: ``tuneloop.data.turn_keys``), train.parts.json and
        val.parts.json (where each pool segment's lines lie, for pack:
        ``tuneloop.data.clean_parts``), manifest.json;
        ``paths.clean_cache`` (each record's work, and the decisions in pool order);
        ``metrics/clean.json``.
Params: ``clean``, ``model.base``, ``paths``.

Month over month: batches the start (last month's champion) trained on are replayed at
``clean.replay_fraction``; every other batch is trained on in full. ``metrics/clean.json``
names the batches and counts the replayed chats; the registry tags the version with them.

Every pooled record is accounted for: kept, or removed with a counted reason (reply too
short, degenerate repetition, over the token limit, an eval item's near-duplicate, an
exact or near duplicate, outside the pilot sample). The rules are ``tuneloop.data.clean``'s,
the cache ``tuneloop.data.clean_cache``'s; the output is the same bytes with the cache or without.
"""

from __future__ import annotations

import logging

from tuneloop.data.chat import load_chat_tokenizer
from tuneloop.data.clean_cache import clean_pool
from tuneloop.data.records import task_records
from tuneloop.io import atomic_dir, write_json
from tuneloop.judge import suites
from tuneloop.models import base_model_ref
from tuneloop.stage import logged_after, setup_logging, stage_params, write_metrics
from tuneloop.tracking import init_from, lineage

STAGE = "clean"
log = logging.getLogger(__name__)


def main() -> None:
    setup_logging()
    params = stage_params()
    with logged_after(STAGE, params):
        eval_questions = [
            q
            for _, q in suites.held_out_questions(
                params.paths.eval_suites, params.paths.fixed_badcases
            )
        ]
        # Which pool batches the start already trained on: those are replayed at a share.
        start = init_from.recorded(params)
        tokenizer = load_chat_tokenizer(base_model_ref(params))
        with atomic_dir(params.paths.clean) as out:
            report = clean_pool(
                params.paths.pool,
                params.paths.clean_cache,
                out,
                eval_questions,
                params.clean,
                tokenizer,
                seen_batches=start.batches,
                task=params.task,
            )
            if not report.train:
                raise SystemExit(
                    f"clean: no training sample left from {report.records_in} pooled records "
                    f"(removed: {dict(report.removed)}); ingest more data or relax params 'clean'"
                )
            write_json(
                out / "manifest.json",
                # The task's records, its dep in dvc.yaml (ingest.add_batch's folder).
                lineage.manifest(
                    STAGE,
                    params,
                    inputs={"pool": task_records(params.paths.pool, str(params.task))},
                ),
            )
        metrics = report.metrics(params.clean.replay_fraction)
        write_metrics(params, STAGE, metrics.model_dump())
        log.info("clean: %s; cache: %s", metrics.model_dump_json(), dict(report.cache))


if __name__ == "__main__":
    main()
