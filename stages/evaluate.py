"""Stage ``evaluate``: every model on the eval suites, item by item, the gate, and the cards.

Reads:  the base model; the registry's ``champion`` (``tracking.registered_model``),
        when there is one; ``paths.merged`` (the candidate); ``paths.fp8``,
        ``paths.nvfp4``, ``paths.nvfp4a16`` (its exports, those of ``export.formats``); the
        business suites (``evaluate.suites``) and the general-capability suites
        (``evaluate.general_suites``) under ``paths.eval_suites`` or lm-eval's own;
        the fixed-badcase suite (``paths.fixed_badcases``, champion and candidate only, and
        ``metrics/fixed_badcases.json``: which champion it was built for);
        for the cards, ``metrics/{ingest,clean,train}.json``, ``paths.pool``, ``dvc.lock``
        and the newest watchdog summary under ``checkpoints/`` (reported, never judged).
Writes: ``metrics/evaluate.json`` (model -> suite -> metric), ``metrics/eval-items/<model>.jsonl``
        (every item's metric values and slice labels), ``metrics/decision.json`` (the
        verdict, pass, fail or inconclusive, every check with its interval, and a reason
        for each), ``reports/eval.md``, ``reports/eval.png``, ``reports/model-card.md`` and
        ``reports/dataset-card.md``, ``metrics/review-items.jsonl`` (each business item's
        question with the champion's and the candidate's answers, for the blind review).
Params: ``evaluate``, ``gate``, ``model.base``, ``tracking.registered_model``, ``paths``;
        for the cards ``train``, ``batch``, ``pack.seq_len``, ``export`` and two of ``clean``.

Scoring runs through lm-eval (``tuneloop/judge/scoring.py``); the rules that judge the scores
are ``tuneloop/judge/gate.py``; the cards are ``tuneloop/judge/cards.py``. With
``evaluate.backend`` vllm, the candidate and its exports are scored through the engine that
serves them: a vLLM server from ``serve.venv`` on each folder (its log in
``reports/vllm-<folder>.log``), so the FP8 decision is about the model vLLM runs; the base and
the champion stay on the hf backend. An export whose format vLLM cannot run here (FP4 on
vLLM's CPU build) is scored on transformers' decompressed path (bf16) instead. Which engine
answered for each model is in the decision (``engines``), the report, the model card and the
run's tags (``evaluate.engine.<model>``).

The champion is scored here, on today's suites, from its registered merged
folder: numbers stored when it was registered may come from an older suite. The first
champion, the base itself (``tuneloop register-base``), is scored once, as the base
(``tuneloop/judge/evaluation.py``); the run's tag ``evaluate.champion_is_base`` says so.
General suites are scored for the base, the champion and the candidate (not the
exports: the forgetting budget judges what training did). A general suite that cannot
run here (its data or package is missing) is named in the decision, not dropped.
Registering a candidate that passed is the retrain flow's job (see
``tuneloop/tracking/registry.py`` for why it is not done in this stage).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import mlflow

from tuneloop.io import atomic_dir, write_jsonl, write_text
from tuneloop.judge import cards, scoring
from tuneloop.judge.evaluation import fixed_suite, score_models
from tuneloop.judge.fixed_badcases import ITEMS_FOLDER_ENV
from tuneloop.judge.gate import (
    BASE,
    CANDIDATE,
    CHAMPION,
    Directions,
    Items,
    Scores,
    decide,
)
from tuneloop.judge.gate_report import plot, report
from tuneloop.stage import setup_logging, stage_params, write_metrics
from tuneloop.tracking import registry
from tuneloop.tracking.runs import stage_run

STAGE = "evaluate"
log = logging.getLogger(__name__)


def main() -> None:
    setup_logging()
    params = stage_params()
    with stage_run(STAGE, params):
        kind = scoring.backend(params)
        champion = registry.find_alias(params.tracking.registered_model, registry.CHAMPION)
        fixed = fixed_suite(params, registry.describe(champion))
        # The suite's items: a task's lie in its own folder, read by the suite's loader.
        os.environ[ITEMS_FOLDER_ENV] = str(params.paths.fixed_badcases.resolve())
        wanted = [*params.evaluate.suites, *params.evaluate.general_suites, *filter(None, [fixed])]
        tasks = scoring.task_index(params.paths.eval_suites, wanted)
        could_not_run = scoring.unavailable(params.evaluate.general_suites, tasks)
        general = [s for s in params.evaluate.general_suites if s not in could_not_run]
        scored_by = score_models(params, kind, tasks, general, fixed, champion)
        scores: Scores = {name: scored.scores for name, scored in scored_by.items()}
        items: Items = {name: scored.items for name, scored in scored_by.items()}
        # model -> what answered, with its version
        engines = {name: scored.engine for name, scored in scored_by.items()}
        directions: Directions = {}
        for scored in scored_by.values():
            directions |= scored.directions
            could_not_run |= scored.not_judged
        # One folder for the run: no model's file is left over from an earlier evaluation.
        with atomic_dir(params.paths.metrics / "eval-items") as folder:
            for name, found in items.items():
                scoring.write_items(folder / f"{name}.jsonl", found)
        # What people review blind, champion beside candidate (none before a champion exists).
        business = params.evaluate.suites
        review = (
            scoring.review_records(scored_by[CHAMPION], scored_by[CANDIDATE], business)
            if CHAMPION in scored_by
            else iter(())
        )
        write_jsonl(params.paths.metrics / "review-items.jsonl", review)
        decision = decide(
            items,
            directions,
            params.gate,
            params.evaluate.suites,
            general,
            could_not_run,
            fixed,
            params.export.formats,
        ).judged(
            champion=registry.describe(champion),
            # Which merged folder was judged: registration refuses any other.
            candidate_key=registry.candidate_key(params.paths.merged),
            backend=kind,
            engines=engines,
        )
        decision.write(params.paths.metrics / "decision.json")
        write_metrics(params, STAGE, scores)
        text = report(scores, decision, directions)
        reports = params.paths.reports
        write_text(reports / "eval.md", text)
        plot(scores, directions, reports / "eval.png")
        facts = cards.gather(params, Path(), watch_root=params.paths.watch)
        write_text(reports / "model-card.md", cards.model_card(params, facts, decision))
        write_text(reports / "dataset-card.md", cards.dataset_card(params, facts))
        for path in (
            reports / "eval.md",
            reports / "eval.png",
            reports / "model-card.md",
            reports / "dataset-card.md",
            params.paths.metrics / "decision.json",
        ):
            mlflow.log_artifact(str(path))
        mlflow.log_artifacts(str(params.paths.metrics / "eval-items"), "eval-items")
        mlflow.set_tags({"gate.passed": str(decision.passed).lower()})
        mlflow.set_tag("gate.verdict", decision.verdict)
        mlflow.set_tags({f"evaluate.engine.{name}": engine for name, engine in engines.items()})
        if champion is not None:
            mlflow.set_tag("gate.champion_version", str(champion.version))
            mlflow.set_tag(
                "evaluate.champion_is_base", str(scored_by[CHAMPION] is scored_by[BASE]).lower()
            )
        log.info("evaluate:\n%s", text)


if __name__ == "__main__":
    main()
