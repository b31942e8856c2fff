"""Stage ``preflight``: refuse, in about a second, a run that would hang or waste GPU hours.

Reads:  ``paths.packed`` shards and manifest; ``paths.clean``/train.jsonl (the packed samples'
        sources); the eval suites under ``paths.eval_suites``; the base model's config,
        tokenizer and weight files; the machine (NVML, disks, ``NCCL_*``).
Writes: ``reports/preflight.json`` and ``reports/preflight.md`` (every check with its status,
        detail and duration); ``metrics/preflight.json``; the same to the MLflow run.
Params: ``preflight``, ``pack``, ``batch``, ``train``, ``model.base``, ``paths``. It reads
        ``cluster`` too, to check the launch when ``train.launcher`` is not local, but not as
        a DVC param: an edit there would rerun train through ``reports/preflight.json``, and
        train checks the launch again when it submits.

The checks live in ``tuneloop/preflight/``. The stage exits non-zero when any check fails, so
``train`` never starts after it, under ``dvc repro`` or the retrain flow.
"""

from __future__ import annotations

import logging

from tuneloop.io import write_json, write_text
from tuneloop.preflight.run import report_markdown, run_preflight
from tuneloop.stage import logged_after, setup_logging, stage_params, write_metrics

STAGE = "preflight"
log = logging.getLogger(__name__)


def main() -> None:
    setup_logging()
    params = stage_params()
    with logged_after(STAGE, params) as run:
        report = run_preflight(params)
        data = report.as_dict()
        table = report_markdown(report)
        write_json(params.paths.reports / "preflight.json", data)
        write_text(params.paths.reports / "preflight.md", table)
        write_metrics(params, STAGE, report.metrics().model_dump())
        run.log_dict(data, "preflight/preflight.json")
        run.log_text(table, "preflight/preflight.md")
        run.set_tags({f"preflight.{c.name}": c.status for c in report.checks})
        print(table)
        for c in report.checks:
            if c.status == "warn":
                log.warning("%s: %s", c.name, c.detail)
        if report.failed:
            raise SystemExit(
                "preflight refused the run:\n"
                + "\n".join(f"  {c.name}: {c.detail}" for c in report.failed)
            )
        log.info("preflight passed in %.2f s", report.seconds)


if __name__ == "__main__":
    main()
