"""Stage ``init``: resolve what training starts from (``train.init_from``).

Reads:  the registry's ``champion`` alias of ``tracking.registered_model`` (when
        ``train.init_from`` is ``champion``).
Writes: ``paths.init``: ``init.json`` (base or champion, version, why, the pool batches it
        trained on) and, for a champion, its merged folder under ``model/``;
        ``metrics/init.json`` (the same, and the serving champion with its pool batches
        whatever ``train.init_from`` says: the ``fixed_badcases`` stage reads it).
Params: ``train.init_from``, ``tracking.registered_model``, ``paths.init``.

The alias can move without any file of the project changing: stage ``champions`` reads it on
every ``dvc repro`` into ``metrics/champions/<task>.json``, this stage's dep, so DVC reruns
it when its task's champion moved. It first reads the alias again cheaply
(``tuneloop.tracking.aliases``; run by hand, nothing read it before): when ``paths.init``
and the metrics already say what it would write, it ends there, with no MLflow run.
Otherwise it resolves the start through the registry inside its MLflow run.
"""

from __future__ import annotations

import logging

from tuneloop.io import read_model
from tuneloop.params import Params
from tuneloop.stage import metrics_path, setup_logging, stage_params, write_metrics
from tuneloop.tracking import aliases, init_from

STAGE = "init"
log = logging.getLogger(__name__)


def unchanged(params: Params) -> bool:
    """What training starts from is what ``paths.init`` and the metrics already record."""
    try:
        serving = aliases.champion(params.tracking.registered_model)
    except aliases.CannotTell as why:
        log.info("init: reading the registry through MLflow (%s)", why)
        return False
    path = metrics_path(params, STAGE)
    recorded = read_model(path, init_from.InitMetrics) if path.exists() else None
    return init_from.already_recorded(params, serving, recorded)


def main() -> None:
    setup_logging()
    params = stage_params()
    if unchanged(params):
        log.info("init: %s, as %s records it", init_from.recorded(params).describe(), STAGE)
        return
    from mlflow import MlflowClient

    from tuneloop.tracking import registry
    from tuneloop.tracking.runs import stage_run

    with stage_run(STAGE, params) as run:
        start = registry.resolve_start(params, params.paths.init)
        champion = registry.serving_champion(params.tracking.registered_model)
        MlflowClient().set_tag(run.info.run_id, init_from.TAG, start.describe())
        write_metrics(params, STAGE, init_from.stage_metrics(start, champion).model_dump())


if __name__ == "__main__":
    main()
