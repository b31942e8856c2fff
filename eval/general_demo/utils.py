"""Metric of the general_demo suite (loaded by lm-eval through the task YAML).

- accuracy: the last number in the reply is the reference's (``The larger is 8.``).
"""

from __future__ import annotations

import re
from pathlib import Path

import datasets

HERE = Path(__file__).parent
NUMBER = re.compile(r"\d+")


def load(**_: object) -> datasets.DatasetDict:
    # Resolved beside this file, so the suite runs from any working directory.
    return datasets.DatasetDict({"test": datasets.Dataset.from_json(str(HERE / "test.jsonl"))})


def last_number(text: str) -> str | None:
    found = NUMBER.findall(text)
    return found[-1] if found else None


def process_results(doc: dict, results: list[str]) -> dict[str, object]:
    said = last_number(results[0])
    return {"accuracy": float(said is not None and said == last_number(doc["answer"]))}
