"""Stage ``task_names``: the names of params.yaml's tasks, alone, for ingest.

Reads:  params ``tasks``.
Writes: ``metrics/task_names.json`` (``TaskNames``): the names, in the file's order.

Ingest routes each record to one of the tasks by name and needs nothing else of the group.
It depends on this file instead of on ``tasks``: a change to one task's own settings (its
LoRA, its gate, its suites) reruns this stage, a second's work that writes the same file,
and DVC then finds ingest's deps unchanged and leaves it, and the pool, as they were.
"""

from __future__ import annotations

from tuneloop.data.metrics import TaskNames
from tuneloop.params import load_params
from tuneloop.stage import logged_after, setup_logging, write_metrics

STAGE = "task_names"


def main() -> None:
    setup_logging()
    params = load_params()
    with logged_after(STAGE, params):
        names = TaskNames(
            tasks=tuple(params.tasks),
            count=len(params.tasks),
            all_records=tuple(n for n, t in params.tasks.items() if t.records == "all"),
        )
        write_metrics(params, STAGE, names.model_dump())


if __name__ == "__main__":
    main()
