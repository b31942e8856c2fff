"""Stage ``champions``: each task's serving champion, as the registry has it now.

Reads:  the registry's ``champion`` alias of every task's ``tracking.registered_model``.
Writes: ``metrics/champions/<task>.json`` (``TaskChampion``): the version, its run and the
        pool batches it trained on, or none yet.
Params: ``tasks``, ``tracking.registered_model``.

DVC cannot see an alias move, so this is the pipeline's one ``always_changed`` stage. Each
task's ``init`` depends on its own file instead: ``dvc repro`` with nothing changed runs
this lookup alone (no MLflow run, no MLflow import: ``tuneloop.tracking.aliases`` reads the
alias), and a champion that moved reruns its own task's ``init`` and no other's. A store
the standard library cannot read (a database server) is asked through MLflow.
"""

from __future__ import annotations

import logging

from tuneloop.io import write_model
from tuneloop.params import load_params
from tuneloop.stage import setup_logging
from tuneloop.tracking import aliases
from tuneloop.tracking.init_from import CHAMPIONS_DIR, Champion, TaskChampion

STAGE = "champions"
log = logging.getLogger(__name__)


def serving(model: str) -> Champion | None:
    """The champion of registered model ``model`` (None: none yet)."""
    try:
        return aliases.champion(model)
    except aliases.NoStore:
        return None  # nothing is registered yet
    except aliases.CannotTell as why:
        log.info("%s: reading the registry through MLflow (%s)", STAGE, why)
    from tuneloop.tracking import registry

    return registry.serving_champion(model)


def main() -> None:
    setup_logging()
    params = load_params()
    folder = params.paths.metrics / CHAMPIONS_DIR
    for task in params.task_names():
        model = params.for_task(task).tracking.registered_model
        champion = TaskChampion.of(model, serving(model))
        write_model(folder / f"{task}.json", champion)
        log.info("%s: %s: %s", STAGE, task, f"v{champion.version}" if champion.version else "none")


if __name__ == "__main__":
    main()
