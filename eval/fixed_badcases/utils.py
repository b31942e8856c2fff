"""Metrics of the fixed_badcases suite (loaded by lm-eval through the task YAML).

- accuracy: the normalised answer equals the correction a person gave for the badcase, the
  same test support_demo's accuracy makes. The gate reads it per item: 1 is "answered right".
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import datasets

# The project's one normaliser: "the same answer" means what "the same text" means in clean.
from tuneloop.data.text import normalise
from tuneloop.judge.fixed_badcases import ITEMS_FOLDER_ENV

HERE = Path(__file__).parent
# The project's paths.fixed_badcases as params.yaml ships it, for lm-eval run by hand.
SHIPPED = HERE.parent.parent / "data" / "fixed_badcases"


def load(**_: object) -> datasets.DatasetDict:
    # The items lie where the evaluate stage says (each task's in its own folder); by hand,
    # where params.yaml ships them, from any working directory.
    folder = Path(os.environ.get(ITEMS_FOLDER_ENV) or SHIPPED)
    # Read here, not by datasets' JSON loader: its cache keys a local file by path and mtime,
    # so other items under a kept mtime (cp -p, a restore) came back as the old ones.
    lines = (folder / "test.jsonl").read_text(encoding="utf-8").splitlines()
    items = [json.loads(line) for line in lines if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(items)})


def process_results(doc: dict, results: list[str]) -> dict[str, object]:
    return {"accuracy": float(normalise(results[0].strip()) == normalise(doc["answer"]))}
