"""Metric of the general_demo suite (loaded by lm-eval through the task YAML).

- accuracy: the last number in the reply is the reference's (``The larger is 8.``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import datasets

HERE = Path(__file__).parent
NUMBER = re.compile(r"\d+")


def load(**_: object) -> datasets.DatasetDict:
    # Resolved beside this file, so the suite runs from any working directory.
    # Read here, not by datasets' JSON loader: its cache keys a local file by path and mtime,
    # so other items under a kept mtime (cp -p, a restore) came back as the old ones.
    lines = (HERE / "test.jsonl").read_text(encoding="utf-8").splitlines()
    items = [json.loads(line) for line in lines if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(items)})


def last_number(text: str) -> str | None:
    found = NUMBER.findall(text)
    return found[-1] if found else None


def process_results(doc: dict, results: list[str]) -> dict[str, object]:
    said = last_number(results[0])
    return {"accuracy": float(said is not None and said == last_number(doc["answer"]))}
