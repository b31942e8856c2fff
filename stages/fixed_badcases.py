"""Stage ``fixed_badcases``: the regression suite of corrections the champion trained on.

Reads:  ``paths.pool`` records; ``metrics/init.json`` (the champion and the pool batches it
        trained on, which the ``init`` stage reads from the registry).
Writes: ``paths.fixed_badcases``/test.jsonl (one item per question: ``id``, ``question``,
        ``answer`` = the newest correction, ``batch``, ``source``, ``arm``,
        ``model_version``); ``metrics/fixed_badcases.json``.
Params: ``paths.pool``, ``paths.fixed_badcases``, ``paths.metrics``.

Where it sits in the graph, and why: after ``ingest`` (it reads the pool) and ``init`` (the
champion), before ``evaluate``, which scores the champion and the candidate on it; the gate
then counts the fixes the candidate broke (``tuneloop.judge.fixed_badcases``,
``tuneloop.judge.gate``). It is a stage, not part of ``evaluate``, so that the suite is a DVC out
of its own: versioned month
by month, runnable on its own with ``lm_eval --include_path eval/``, and redone only when the
pool or the champion changed. It is not part of ``clean`` either: clean's output is what is
trained on, and this suite is what the trained model is tested on. Clean does not
decontaminate against it (``tuneloop.judge.suites.held_out_questions``): its items are
training data in the month they arrive.
"""

from __future__ import annotations

import logging

from tuneloop.io import read_model, write_jsonl
from tuneloop.judge import fixed_badcases
from tuneloop.stage import logged_after, setup_logging, stage_params, write_metrics
from tuneloop.tracking.init_from import InitMetrics

STAGE = "fixed_badcases"
log = logging.getLogger(__name__)


def main() -> None:
    setup_logging()
    params = stage_params()
    with logged_after(STAGE, params):
        init = params.paths.metrics / "init.json"
        champion = read_model(init, InitMetrics).champion if init.exists() else None
        batches = champion.batches if champion else ()
        suite = fixed_badcases.build(params.paths.pool, batches, params.task)
        write_jsonl(params.paths.fixed_badcases / "test.jsonl", suite.items)
        metrics = suite.metrics(champion)
        write_metrics(params, STAGE, metrics.model_dump())
        log.info("fixed_badcases: %s", metrics.model_dump_json())


if __name__ == "__main__":
    main()
