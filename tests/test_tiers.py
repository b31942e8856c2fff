"""The two test tiers lose no test: every test module is in exactly one of them.

``make test-fast`` runs the modules ``tests/conftest.py`` names in ``FAST_MODULES``;
``make test`` runs those and ``WHOLE_SUITE_MODULES``. A new module must be put in one,
a renamed one renamed there too.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import FAST_MODULES, WHOLE_SUITE_MODULES

TESTS = Path(__file__).resolve().parent


def test_every_test_module_is_in_exactly_one_tier() -> None:
    modules = {path.stem for path in TESTS.glob("test_*.py")}
    both = sorted(FAST_MODULES & WHOLE_SUITE_MODULES)
    assert not both, f"in both tiers: {both}"
    neither = sorted(modules - FAST_MODULES - WHOLE_SUITE_MODULES)
    assert not neither, (
        f"in no tier: {neither}; add each to FAST_MODULES or WHOLE_SUITE_MODULES in "
        "tests/conftest.py"
    )
    missing = sorted((FAST_MODULES | WHOLE_SUITE_MODULES) - modules)
    assert not missing, f"named in tests/conftest.py, but no such module: {missing}"


def test_the_fast_tier_is_marked(request: pytest.FixtureRequest) -> None:
    assert request.node.get_closest_marker("fast") is not None
