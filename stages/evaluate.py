"""Stage ``evaluate``: the business eval suites, every model side by side, and the gate.

Reads:  the base model; the registry's ``champion`` (``tracking.registered_model``),
        when there is one; ``paths.merged`` (the candidate); ``paths.fp8`` (its
        export); the suites named in ``evaluate.suites`` under ``paths.eval_suites``.
Writes: ``metrics/evaluate.json`` (model -> suite -> metric), ``metrics/decision.json``
        (the verdict, every check with its numbers, and a reason for each, pass
        or fail), ``reports/eval.md`` and ``reports/eval.png``.
Params: ``evaluate``, ``gate``, ``model.base``, ``tracking.registered_model``, ``paths``.

Scoring runs through lm-eval (``tuneloop/scoring.py``); the rules that judge the scores
are ``tuneloop/gate.py``.

The champion is scored here, on today's suites, from its registered merged
folder: numbers stored when it was registered may come from an older suite.
Registering a candidate that passed is the retrain flow's job (see
``tuneloop/registry.py`` for why it is not done in this stage).
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import mlflow
from lm_eval.tasks import TaskManager

from tuneloop import registry
from tuneloop.gate import BASE, CANDIDATE, CHAMPION, FP8, Directions, Scores, decide, plot, report
from tuneloop.io import write_json, write_text
from tuneloop.models import base_model_ref
from tuneloop.params import load_params
from tuneloop.scoring import backend, score
from tuneloop.stage import setup_logging, write_metrics
from tuneloop.tracking import stage_run

STAGE = "evaluate"
log = logging.getLogger(__name__)


def main() -> None:
    setup_logging()
    params = load_params()
    with stage_run(STAGE, params):
        tasks = TaskManager(include_path=str(params.paths.eval_suites))
        kind = backend(params)
        champion = registry.find_alias(params.tracking.registered_model, registry.CHAMPION)
        scores: Scores = {}
        directions: Directions = {}
        # The champion's folder is fetched for this evaluation only, not kept as an output.
        with tempfile.TemporaryDirectory(prefix="tuneloop-champion-") as tmp:
            models: dict[str, str | Path] = {BASE: base_model_ref(params)}
            if champion is not None:
                models[CHAMPION] = registry.download_folder(champion, registry.MERGED, Path(tmp))
            models |= {CANDIDATE: params.paths.merged, FP8: params.paths.fp8}
            for name, ref in models.items():
                log.info("evaluate: scoring %s (%s) with %s", name, ref, kind)
                scores[name], found = score(ref, params, tasks, kind)
                directions |= found
        decision = decide(scores, directions, params.gate)
        decision["champion"] = registry.describe(champion)
        # Which merged folder was judged: registration refuses any other.
        decision["candidate_key"] = registry.candidate_key(params.paths.merged)
        decision["backend"] = kind
        write_json(params.paths.metrics / "decision.json", decision)
        write_metrics(params, STAGE, scores)
        text = report(scores, decision)
        write_text(params.paths.reports / "eval.md", text)
        plot(scores, directions, params.paths.reports / "eval.png")
        for path in (
            params.paths.reports / "eval.md",
            params.paths.reports / "eval.png",
            params.paths.metrics / "decision.json",
        ):
            mlflow.log_artifact(str(path))
        mlflow.set_tag("gate.passed", str(decision["passed"]).lower())
        if champion is not None:
            mlflow.set_tag("gate.champion_version", str(champion.version))
        log.info("evaluate:\n%s", text)


if __name__ == "__main__":
    main()
