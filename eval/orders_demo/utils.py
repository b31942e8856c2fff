"""Metrics of the orders_demo suite (loaded by lm-eval through the task YAML).

- accuracy: the answer parses to exactly the reference object (key order and spacing aside).
- format_compliance: the answer is one JSON object of the order schema: exactly its keys, a
  string product and a boolean express.
- field_accuracy: the share of the fields right (0 for an answer that is not JSON).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import datasets

HERE = Path(__file__).parent
TYPES = {"product": str, "express": bool}


def load(**_: object) -> datasets.DatasetDict:
    # Resolved beside this file, so the suite runs from any working directory.
    # Read here, not by datasets' JSON loader: its cache keys a local file by path and mtime,
    # so other items under a kept mtime (cp -p, a restore) came back as the old ones.
    lines = (HERE / "test.jsonl").read_text(encoding="utf-8").splitlines()
    items = [json.loads(line) for line in lines if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(items)})


def parse(text: str) -> dict[str, Any] | None:
    """The answer as an object, or None for anything that is not one."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def in_schema(value: dict[str, Any]) -> bool:
    # type(), not isinstance(): a bool is an int in Python, and 1 is not true here.
    return set(value) == set(TYPES) and all(type(value[k]) is t for k, t in TYPES.items())


def process_results(doc: dict, results: list[str]) -> dict[str, float]:
    said, right = parse(results[0].strip()), json.loads(doc["answer"])
    if said is None:
        return {"accuracy": 0.0, "format_compliance": 0.0, "field_accuracy": 0.0}
    return {
        "accuracy": float(said == right),
        "format_compliance": float(in_schema(said)),
        "field_accuracy": sum(said.get(key) == value for key, value in right.items()) / len(right),
    }
