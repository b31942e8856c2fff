"""The two test tiers lose no test: every test is in exactly one, and a bare `pytest` runs
the fast one.

The tiers are markers (each module's ``pytestmark``); ``tests/conftest.py`` refuses to run a
collection with a test in no tier or in both, so a new module cannot be forgotten.
"""

from __future__ import annotations

import pytest

from tests.tiers import untiered

# The fast tier: no pipeline, server or rank.
pytestmark = pytest.mark.fast


def test_a_test_in_no_tier_or_in_both_is_named(request: pytest.FixtureRequest) -> None:
    item = request.node
    assert untiered([item]) == []
    item.add_marker(pytest.mark.slow)
    assert untiered([item]) == ["tests/test_tiers.py"]


PROJECT = {
    "pytest.ini": "[pytest]\ntestpaths = suite\nmarkers =\n    fast: f\n    slow: s\n",
    "suite/conftest.py": (
        "from tests.tiers import untiered, fast_by_default\n"
        "def pytest_collection_modifyitems(config, items):\n"
        "    assert not untiered(items)\n"
        "    fast_by_default(config, items)\n"
    ),
    "suite/test_quick.py": "import pytest\npytestmark = pytest.mark.fast\ndef test_q(): pass\n",
    "suite/test_long.py": "import pytest\npytestmark = pytest.mark.slow\ndef test_l(): pass\n",
}


@pytest.mark.parametrize(
    ("args", "ran"),
    [
        ((), ["test_quick.py::test_q"]),
        (("-m", "fast or slow"), ["test_long.py::test_l", "test_quick.py::test_q"]),
        (("-m", "fast"), ["test_quick.py::test_q"]),
        (("suite/test_long.py::test_l",), ["test_long.py::test_l"]),
    ],
    ids=["bare", "make-test", "make-test-fast", "named"],
)
def test_a_bare_pytest_runs_the_fast_tier_and_a_named_test_runs_whatever_its_tier(
    pytester: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
    args: tuple[str, ...],
    ran: list[str],
) -> None:
    for name, text in PROJECT.items():
        (pytester.path / name).parent.mkdir(exist_ok=True)
        (pytester.path / name).write_text(text)
    result = pytester.runpytest("-p", "no:cacheprovider", "-p", "no:xdist", "-v", *args)
    passed = sorted(
        line.split("suite/", 1)[1].split(" ")[0] for line in result.outlines if " PASSED" in line
    )
    assert passed == ran, result.outlines


def test_the_fast_tier_is_marked(request: pytest.FixtureRequest) -> None:
    assert request.node.get_closest_marker("fast") is not None
