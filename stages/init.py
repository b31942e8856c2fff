"""Stage ``init``: resolve what training starts from (``train.init_from``).

Reads:  the registry's ``champion`` alias of ``tracking.registered_model`` (when
        ``train.init_from`` is ``champion``).
Writes: ``paths.init``: ``init.json`` (base or champion, version, why, the pool batches it
        trained on) and, for a champion, its merged folder under ``model/``;
        ``metrics/init.json`` (the same, and the serving champion with its pool batches
        whatever ``train.init_from`` says: the ``fixed_badcases`` stage reads it).
Params: ``train.init_from``, ``tracking.registered_model``, ``paths.init``.

``always_changed`` in dvc.yaml: the alias can move without any file changing.
"""

from __future__ import annotations

from dataclasses import asdict

from tuneloop.params import load_params
from tuneloop.stage import setup_logging, write_metrics
from tuneloop.tracking import init_from, registry
from tuneloop.tracking.runs import stage_run

STAGE = "init"


def main() -> None:
    setup_logging()
    params = load_params()
    with stage_run(STAGE, params) as run:
        start = registry.resolve_start(params, params.paths.init)
        # The model that serves, whatever training starts from: the fixed-badcase suite is
        # built from the pool batches it trained on (stage fixed_badcases).
        serving = registry.find_alias(params.tracking.registered_model, registry.CHAMPION)
        champion = None
        if serving is not None:
            champion = {
                "version": str(serving.version),
                "batches": list(registry.champion_batches(serving)),
            }
        from mlflow import MlflowClient

        MlflowClient().set_tag(run.info.run_id, init_from.TAG, start.describe())
        write_metrics(
            params,
            STAGE,
            asdict(start)
            | {
                "from_champion": int(start.source == "champion"),
                "champion_version": int(start.version or 0),
                "champion": champion,
            },
        )


if __name__ == "__main__":
    main()
