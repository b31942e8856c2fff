"""The layout's one rule of direction: the library never imports an entry point.

``tuneloop/`` is what stages, flows, the router and the tests share; the
``stages/``, ``flows/`` and ``serving/`` packages sit on top of it. Only the CLI
(``tuneloop/cli/``), the top of everything, may reach into them (to start a flow), and
nothing else imports the CLI.
"""

from __future__ import annotations

import ast
from pathlib import Path

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
