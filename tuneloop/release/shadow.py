"""The business suites' own judges, applied to live answers during the shadow step.

A mirrored request has no reference answer, so of a suite's metrics only what
needs none applies to every answer: its answer format (``ANSWER_FORMAT`` in
``eval/<suite>/utils.py``, the regex its ``format_compliance`` uses). When a
live prompt is one of a suite's questions (a replay of the suite, a frequent
question), the suite's own ``process_results`` scores both arms' answers
against that item's reference, exactly as the eval gate would.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from tuneloop.data.text import normalise
from tuneloop.io import read_jsonl


class SuiteError(ValueError):
    """A suite named in params cannot be loaded for the shadow step; the message says why."""


@dataclass(frozen=True)
class Judges:
    """``compliant(answer)`` (None: no suite defines a format) and ``score(prompt, answer)``."""

    compliant: Callable[[str], bool] | None
    score: Callable[[str, str], Mapping[str, float] | None]
    formats: tuple[str, ...]  # the suites whose format is checked


def _load(utils: Path, name: str) -> ModuleType:
    # By path, as lm-eval loads a task's utils.py: suites are not a package.
    spec = importlib.util.spec_from_file_location(f"tuneloop_suite_{name}", utils)
    if spec is None or spec.loader is None:
        raise SuiteError(f"{utils} cannot be imported")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def judges(root: Path, suites: Sequence[str]) -> Judges:
    """The answer formats and per-item scorers of ``suites`` under ``root`` (eval/)."""
    patterns: list[re.Pattern[str]] = []
    formats: list[str] = []
    items: dict[str, tuple[Callable[..., Any], dict[str, Any]]] = {}
    for name in suites:
        folder = root / name
        if not (folder / "utils.py").is_file() or not (folder / "test.jsonl").is_file():
            raise SuiteError(
                f"suite {name!r} has no {folder}/utils.py and test.jsonl (evaluate.suites)"
            )
        module = _load(folder / "utils.py", name)
        pattern = getattr(module, "ANSWER_FORMAT", None)
        if pattern is not None:
            patterns.append(re.compile(pattern) if isinstance(pattern, str) else pattern)
            formats.append(name)
        process = getattr(module, "process_results", None)
        if process is None:
            continue
        for doc in read_jsonl(folder / "test.jsonl"):
            # The first suite to ask a question scores it.
            items.setdefault(normalise(str(doc["question"])), (process, doc))

    def compliant(answer: str) -> bool:
        text = answer.strip()
        return any(p.match(text) for p in patterns)

    def score(prompt: str, answer: str) -> Mapping[str, float] | None:
        found = items.get(normalise(prompt))
        if found is None:
            return None
        process, doc = found
        results = process(doc, [answer])
        # Only plain numbers: a metric aggregated over a subset (a tuple) needs its suite's
        # aggregation, which one item cannot give.
        return {k: float(v) for k, v in results.items() if isinstance(v, int | float | bool)}

    return Judges(compliant if patterns else None, score, tuple(formats))
