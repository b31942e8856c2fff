"""Metric of the general_demo suite (loaded by lm-eval through the task YAML).

- accuracy: the reply, stripped, is the expected number.
"""

from __future__ import annotations

from pathlib import Path

import datasets

HERE = Path(__file__).parent


def load(**_: object) -> datasets.DatasetDict:
    # Resolved beside this file, so the suite runs from any working directory.
    return datasets.DatasetDict({"test": datasets.Dataset.from_json(str(HERE / "test.jsonl"))})


def process_results(doc: dict, results: list[str]) -> dict[str, object]:
    return {"accuracy": float(results[0].strip() == doc["answer"])}
