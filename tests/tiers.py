"""The test tiers, as markers: what `tests/conftest.py` checks and selects with."""

from __future__ import annotations

import os

import pytest

# The two tiers are markers on the tests: each module says `pytestmark = pytest.mark.fast` or
# `pytest.mark.slow`. A fast test starts no pipeline (`dvc repro`, a flow), no server
# (uvicorn, `transformers serve`, vLLM, MLflow, Prefect, PostgreSQL, Chromium), no training
# rank and no stage in a subprocess; a short `python -c` process or a git command is allowed.
# A bare `pytest` runs the fast tier on a worker a core, as `make test-fast` does; `make test`
# runs both (`-m "fast or slow"`); `pytest path::test` runs what it names, whatever its tier,
# in one process.
TIERS = ("fast", "slow")
MAX_FAST_WORKERS = 4  # the Makefile's FAST_WORKERS: more start-up than they save beyond it


def bare(config: pytest.Config) -> bool:
    """No paths and no `-m`: the run a contributor types without thinking."""
    return not config.option.markexpr and config.args_source == pytest.Config.ArgsSource.TESTPATHS


def spread_a_bare_run(config: pytest.Config) -> None:
    """A bare `pytest` takes a worker a core (at most 4), unless told `-n`, `--pdb`,
    `--collect-only` or `-p no:xdist`: the inner loop's wait, about two thirds on 2 cores.

    It sets xdist's own `-n` before xdist reads it (this hook runs first), so the run is
    exactly `pytest -n N`.
    """
    cores = len(os.sched_getaffinity(0))
    if not bare(config) or cores < 2 or not config.pluginmanager.hasplugin("xdist"):
        return
    if "PYTEST_XDIST_WORKER" in os.environ:  # a worker runs this hook too: it must not spawn
        return
    told = config.option.numprocesses is not None or config.getoption("usepdb", False)
    if told or config.option.collectonly:
        return
    config.option.numprocesses = min(cores, MAX_FAST_WORKERS)


def tiers_of(item: pytest.Item) -> list[str]:
    return [tier for tier in TIERS if item.get_closest_marker(tier) is not None]


def untiered(items: list[pytest.Item]) -> list[str]:
    """The modules of tests in no tier or in both: every test is in exactly one."""
    return sorted({item.nodeid.split("::", 1)[0] for item in items if len(tiers_of(item)) != 1})


def fast_by_default(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A bare `pytest` (no paths, no `-m`) keeps the fast tier and deselects the rest."""
    if not bare(config):
        return
    slow = [item for item in items if "fast" not in tiers_of(item)]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if "fast" in tiers_of(item)]
