"""Business eval suites under ``eval/``: one lm-eval task folder each.

A suite folder holds ``<suite>.yaml`` (the lm-eval task), ``utils.py`` (its
loader and metrics) and ``test.jsonl``, whose items carry at least
``question`` and ``answer``. Training data is decontaminated against every
suite found here, not only the ones being scored.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from tuneloop.io import read_jsonl


def suite_names(root: Path) -> list[str]:
    return sorted(p.parent.name for p in root.glob("*/test.jsonl"))


def questions(root: Path) -> Iterator[tuple[str, str]]:
    """``(suite/line, question)`` for every item of every suite."""
    for path in sorted(root.glob("*/test.jsonl")):
        for number, item in enumerate(read_jsonl(path), start=1):
            yield f"{path.parent.name}/{number}", str(item["question"])
