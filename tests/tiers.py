"""The test tiers, as markers: what `tests/conftest.py` checks and selects with."""

from __future__ import annotations

import pytest

# The two tiers are markers on the tests: each module says `pytestmark = pytest.mark.fast` or
# `pytest.mark.slow`. A fast test starts no pipeline (`dvc repro`, a flow), no server
# (uvicorn, `transformers serve`, vLLM, MLflow, Prefect, PostgreSQL, Chromium), no training
# rank and no stage in a subprocess; a short `python -c` process or a git command is allowed.
# A bare `pytest` runs the fast tier (`make test-fast` too); `make test` runs both
# (`-m "fast or slow"`); `pytest path::test` runs what it names, whatever its tier.
TIERS = ("fast", "slow")


def tiers_of(item: pytest.Item) -> list[str]:
    return [tier for tier in TIERS if item.get_closest_marker(tier) is not None]


def untiered(items: list[pytest.Item]) -> list[str]:
    """The modules of tests in no tier or in both: every test is in exactly one."""
    return sorted({item.nodeid.split("::", 1)[0] for item in items if len(tiers_of(item)) != 1})


def fast_by_default(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A bare `pytest` (no paths, no `-m`) keeps the fast tier and deselects the rest."""
    if config.option.markexpr or config.args_source != pytest.Config.ArgsSource.TESTPATHS:
        return
    slow = [item for item in items if "fast" not in tiers_of(item)]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if "fast" in tiers_of(item)]
