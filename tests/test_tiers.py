"""The two test tiers lose no test: every test is in exactly one, and a bare `pytest` runs
the fast one, a worker a core.

The tiers are markers (each module's ``pytestmark``); ``tests/conftest.py`` refuses to run a
collection with a test in no tier or in both, so a new module cannot be forgotten.
"""

from __future__ import annotations

import os
import re

import pytest

from tests.helpers import ROOT
from tests.tiers import MAX_FAST_WORKERS, untiered

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
        "import pytest\n"
        "from tests.tiers import untiered, fast_by_default, spread_a_bare_run\n"
        "@pytest.hookimpl(tryfirst=True)\n"
        "def pytest_cmdline_main(config):\n"
        "    spread_a_bare_run(config)\n"
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
    write_project(pytester)
    result = pytester.runpytest("-p", "no:cacheprovider", "-p", "no:xdist", "-v", *args)
    passed = sorted(
        line.split("suite/", 1)[1].split(" ")[0] for line in result.outlines if " PASSED" in line
    )
    assert passed == ran, result.outlines


def write_project(pytester: pytest.Pytester) -> None:
    for name, text in PROJECT.items():
        (pytester.path / name).parent.mkdir(exist_ok=True)
        (pytester.path / name).write_text(text)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one core: one process")
@pytest.mark.parametrize(
    ("args", "spread"),
    [((), True), (("-n", "0"), False), (("suite/test_quick.py",), False), (("--pdb",), False)],
    ids=["bare", "n0", "named", "pdb"],
)
def test_a_bare_pytest_takes_a_worker_a_core_and_anything_else_one_process(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, args: tuple[str, ...], spread: bool
) -> None:
    write_project(pytester)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the workers import tests.tiers
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)  # under `make test`, this is one
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-v", *args, timeout=120)
    workers = min(len(os.sched_getaffinity(0)), MAX_FAST_WORKERS)
    text = "\n".join(result.outlines)
    assert (f"created: {workers}/{workers} workers" in text) is spread, text
    in_a_worker = re.search(r"\[gw\d+\] .*PASSED suite/test_quick\.py::test_q", text)
    assert bool(in_a_worker) is spread, text
    assert "test_long" not in text
    assert result.ret == 0, text


def test_the_fast_tier_is_marked(request: pytest.FixtureRequest) -> None:
    assert request.node.get_closest_marker("fast") is not None
