"""Stage ``merge``: fold the LoRA adapter into the base weights, and prove nothing changed.

Reads:  ``paths.adapter``; the model training started from (``paths.init``: the champion or
        the base); eval suite questions (the probe set).
Writes: ``paths.merged`` (a standard Hugging Face folder with tokenizer and chat
        template, plus manifest.json); ``metrics/merge.json``.
Params: ``merge``, ``model.base``, ``paths``.

Equivalence gate: on ``merge.probes`` prompts spread over every eval suite, the merged model's
logits must match the adapter model's within ``merge.max_abs_logit_diff`` and it must choose
the same token at every step of the adapter model's greedy answers; past that the stage fails
and says by how much. The measured differences are in ``metrics/merge.json`` (and MLflow)
either way. Merge and check run in float32 (host memory: 4 bytes a parameter); the result is
saved in ``merge.dtype``. The merge and its check are ``tuneloop.training.merge``'s.

A full fine-tune leaves a whole model in ``paths.adapter`` (config and weights,
no ``adapter_config.json``): there is nothing to merge, so it is copied through
and the metrics say ``skipped: full fine-tune``.
"""

from __future__ import annotations

import logging

from tuneloop.io import atomic_dir, write_json
from tuneloop.stage import setup_logging, stage_params, write_metrics
from tuneloop.tracking import lineage
from tuneloop.tracking.runs import stage_run
from tuneloop.training.merge import check, is_full_model, merge, pass_through

STAGE = "merge"
log = logging.getLogger(__name__)


def main() -> None:
    setup_logging()
    params = stage_params()
    adapter = params.paths.adapter
    with stage_run(STAGE, params):
        if is_full_model(adapter):
            log.info("merge: %s holds a full model; copying it through", adapter)
            with atomic_dir(params.paths.merged) as out:
                copied = pass_through(adapter, out)
                write_json(
                    out / "manifest.json",
                    lineage.manifest(
                        STAGE, params, inputs={"adapter": adapter}, **copied.model_dump()
                    ),
                )
            write_metrics(params, STAGE, copied.model_dump())
            return
        merged, tokenizer, metrics = merge(params)
        # Written before the check, so a failed merge leaves its numbers behind too.
        write_metrics(params, STAGE, metrics.model_dump())
        check(metrics, params.merge.max_abs_logit_diff)
        with atomic_dir(params.paths.merged) as out:
            merged.save_pretrained(out)
            tokenizer.save_pretrained(out)
            write_json(
                out / "manifest.json",
                lineage.manifest(
                    STAGE, params, inputs={"adapter": adapter}, **metrics.model_dump()
                ),
            )
        log.info("merge: %s", metrics.model_dump_json())


if __name__ == "__main__":
    main()
