"""The pipeline's stages in the order they run, read from dvc.yaml.

dvc.yaml is the one list of stages: the flows run them in the order written there, and
the tests read the same order, instead of each keeping a copy. The order is checked
against DVC's own stage graph (built from the deps and outs), so a stage can never be
listed before one whose output it reads.

Not imported by any stage: it needs DVC's graph, which only the flows and tests use.
"""

from __future__ import annotations

import os
from pathlib import Path

from tuneloop.io import read_yaml


class StageOrderError(ValueError):
    """dvc.yaml lists a stage before a stage whose output it reads."""


# The stages the project runs once, before each task's (``task_stages``).
SHARED_STAGES = ("base", "task_names", "ingest", "champions")


def stage_order(root: Path = Path()) -> tuple[str, ...]:
    """The stages of ``root``'s dvc.yaml as written (each task's, a ``foreach`` group, by
    the group's name), checked to be a valid run order: the shared stages, then a task's."""
    spec = read_yaml(root / "dvc.yaml")
    order = tuple(spec["stages"])
    # Imported here: dvc takes about a second to import.
    from dvc.repo import Repo

    position = {name: number for number, name in enumerate(order)}
    with Repo(os.fspath(root)) as repo:
        # An edge runs from a stage to a stage whose out it depends on.
        for stage, upstream in repo.index.graph.edges:
            name = getattr(stage, "name", "").partition("@")[0]
            before = getattr(upstream, "name", "").partition("@")[0]
            if name in position and before in position and position[before] > position[name]:
                raise StageOrderError(
                    f"{root / 'dvc.yaml'}: stage {name!r} is listed before {before!r}, whose "
                    f"outs it depends on; move {before!r} above {name!r}"
                )
    return order


def task_stages(task: str, root: Path = Path()) -> tuple[str, ...]:
    """Task ``task``'s stages, as DVC names them (``clean@orders``), in dvc.yaml's order:
    each ``foreach`` group generates one per task of params.yaml's ``tasks:``."""
    spec = read_yaml(root / "dvc.yaml")
    return tuple(f"{name}@{task}" for name, stage in spec["stages"].items() if "foreach" in stage)


def always_changed(root: Path = Path()) -> frozenset[str]:
    """The stages DVC runs on every ``dvc repro`` (``always_changed``: they read what DVC
    cannot see, the registry), by their names in dvc.yaml."""
    spec = read_yaml(root / "dvc.yaml")
    return frozenset(name for name, stage in spec["stages"].items() if stage.get("always_changed"))
