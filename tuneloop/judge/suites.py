"""Business eval suites under ``eval/``: one lm-eval task folder each.

A suite folder holds ``<suite>.yaml`` (the lm-eval task), ``utils.py`` (its
loader and metrics) and ``test.jsonl``, whose items carry at least
``question`` and ``answer``. Training data is decontaminated against every
suite found here, not only the ones being scored.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from pathlib import Path

from tuneloop.io import read_jsonl


def held_out_questions(root: Path, fixed_badcases: Path) -> Iterator[tuple[str, str]]:
    """The questions training data must not contain: every suite's but the fixed badcases'.

    The other suites are held out: they measure how a model does on questions it never saw,
    so their items (and near duplicates) are removed from training. The fixed-badcase suite
    (``paths.fixed_badcases``, ``tuneloop.judge.fixed_badcases``) is a regression suite: its
    items are corrected production badcases, training data in the month they arrive and regression
    tests afterwards. It measures whether what was learned stays learned, not whether
    something unseen is answered, so training on its items is the design, not a leak;
    decontaminating against it would remove the corrections (and next month's repeats of
    them) that it exists to protect.
    """
    return questions(root, skip=(fixed_badcases.name,))


def suite_names(root: Path) -> list[str]:
    return sorted(p.parent.name for p in root.glob("*/test.jsonl"))


def questions(root: Path, skip: Collection[str] = ()) -> Iterator[tuple[str, str]]:
    """``(suite/line, question)`` for every item of every suite but those named in ``skip``."""
    for path in sorted(root.glob("*/test.jsonl")):
        if path.parent.name in skip:
            continue
        for number, item in enumerate(read_jsonl(path), start=1):
            yield f"{path.parent.name}/{number}", str(item["question"])
