"""Metrics of the support_demo suite (loaded by lm-eval through the task YAML).

- accuracy: the normalised answer equals the reference (factual accuracy).
- format_compliance: the answer follows the desk's format, ``[intent] sentence``.
- hallucination_rate: of the questions the model cannot answer (products the
  shop does not sell), the share that got an invented answer instead of a refusal.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import datasets

# The project's one normaliser: "the same answer" means what "the same text" means in clean.
from tuneloop.data.text import normalise

HERE = Path(__file__).parent
ANSWER_FORMAT = re.compile(r"^\[(return|warranty|shipping|unknown|greeting)\] \S.*$")
REFUSAL_TAG = "[unknown]"


def load(**_: object) -> datasets.DatasetDict:
    # Resolved beside this file, so the suite runs from any working directory.
    # Read here, not by datasets' JSON loader: its cache keys a local file by path and mtime,
    # so other items under a kept mtime (cp -p, a restore) came back as the old ones.
    lines = (HERE / "test.jsonl").read_text(encoding="utf-8").splitlines()
    items = [json.loads(line) for line in lines if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(items)})


def process_results(doc: dict, results: list[str]) -> dict[str, object]:
    prediction = results[0].strip()
    return {
        "accuracy": float(normalise(prediction) == normalise(doc["answer"])),
        "format_compliance": float(bool(ANSWER_FORMAT.match(prediction))),
        # (is unanswerable, answered anyway), aggregated over the unanswerable items only.
        "hallucination_rate": (
            not doc["answerable"],
            not doc["answerable"] and not prediction.startswith(REFUSAL_TAG),
        ),
    }


def rate_over_unanswerable(items: list[tuple[bool, bool]]) -> float:
    unanswerable = [invented for is_unanswerable, invented in items if is_unanswerable]
    return sum(unanswerable) / len(unanswerable) if unanswerable else 0.0
