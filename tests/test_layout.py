"""The layout's one rule of direction: the library never imports an entry point.

``tuneloop/`` is what stages, flows, the router and the tests share; the
``stages/``, ``flows/`` and ``serving/`` packages sit on top of it. Only the CLI
(``tuneloop/cli/``), the top of everything, may reach into them (to start a flow), and
nothing else imports the CLI.

And its sizes: at most 12 modules directly in ``tuneloop/``, a stage module of at most 200
lines (its DVC entry), no product file over 700.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

# The fast tier: no pipeline, server or rank.
pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[1]
ENTRY_POINTS = ("stages", "flows", "serving")
CLI = ROOT / "tuneloop" / "cli"


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_no_library_module_imports_stages_flows_or_serving() -> None:
    offenders = {
        str(path.relative_to(ROOT)): sorted(
            name for name in imported_modules(path) if name.split(".")[0] in ENTRY_POINTS
        )
        for path in sorted((ROOT / "tuneloop").rglob("*.py"))
        if not path.is_relative_to(CLI)
    }
    offenders = {path: names for path, names in offenders.items() if names}
    assert not offenders, f"tuneloop/ modules import entry-point packages: {offenders}"


def imported_names(path: Path) -> set[str]:
    """Like ``imported_modules``, with ``X.Y`` for each ``from X import Y`` (Y may be a module)."""
    names = imported_modules(path)
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_nothing_below_the_cli_imports_it() -> None:
    """The CLI is the top: stages, flows, the router and the library never import it."""
    product = [ROOT / "tuneloop", *(ROOT / name for name in ENTRY_POINTS)]
    offenders = {
        str(path.relative_to(ROOT)): sorted(
            name
            for name in imported_names(path)
            if name == "tuneloop.cli" or name.startswith("tuneloop.cli.")
        )
        for folder in product
        for path in sorted(folder.rglob("*.py"))
        if not path.is_relative_to(CLI)
    }
    offenders = {path: names for path, names in offenders.items() if names}
    assert not offenders, f"modules below the CLI import it: {offenders}"


def test_no_test_module_imports_another() -> None:
    """What tests share lives in tests/*helpers.py and conftest.py, never in a test module:
    importing one runs its module-level set-up and couples two files' fixtures."""
    offenders = {
        path.name: sorted(n for n in imported_modules(path) if n.startswith("tests.test_"))
        for path in sorted((ROOT / "tests").glob("*.py"))
    }
    offenders = {name: found for name, found in offenders.items() if found}
    assert not offenders, f"test modules import test modules: {offenders}"


# How big the layout lets things grow: a few shared basics at the root of tuneloop/ (the rest
# in a package by concern), a stage module that is its DVC entry only (the logic in
# tuneloop/), and no product file a reader cannot hold in their head.
MAX_ROOT_MODULES = 12
MAX_STAGE_LINES = 200
MAX_PRODUCT_LINES = 700
PRODUCT = ("tuneloop", "stages", "flows", "serving")


def lines_over(paths: list[Path], limit: int) -> dict[str, int]:
    counts = {
        str(path.relative_to(ROOT)): len(path.read_text(encoding="utf-8").splitlines())
        for path in paths
    }
    return {name: count for name, count in counts.items() if count > limit}


def test_few_modules_sit_directly_in_tuneloop() -> None:
    root = sorted(path.name for path in (ROOT / "tuneloop").glob("*.py"))
    assert len(root) <= MAX_ROOT_MODULES, (
        f"{len(root)} modules directly in tuneloop/ (at most {MAX_ROOT_MODULES}): {root}; "
        "move them into the package of their concern"
    )


def test_a_stage_module_is_its_entry_only() -> None:
    over = lines_over(sorted((ROOT / "stages").glob("*.py")), MAX_STAGE_LINES)
    assert not over, (
        f"stage modules over {MAX_STAGE_LINES} lines: {over}; move the logic into tuneloop/"
    )


def test_no_product_file_is_over_700_lines() -> None:
    paths = sorted(path for name in PRODUCT for path in (ROOT / name).rglob("*.py"))
    over = lines_over(paths, MAX_PRODUCT_LINES)
    assert not over, f"product files over {MAX_PRODUCT_LINES} lines: {over}; split them by role"
