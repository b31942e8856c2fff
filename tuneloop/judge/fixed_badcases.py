"""The fixed-badcase regression suite: corrected production badcases stay fixed.

A corrected badcase (a pooled ``badcase`` with a ``corrected_response``, mostly router
feedback) is training data in the month it arrives. Once a model trained on its month is
the champion, it becomes a regression test: an item of an lm-eval task like the other suites
(its ``<suite>.yaml`` and ``utils.py`` are source in ``eval/fixed_badcases``; its items, the
``test.jsonl`` written here, a DVC out of the ``fixed_badcases`` stage, lie in
``paths.fixed_badcases``, outside the suites' folder, so a month's new items rerun nothing that
reads only the other suites). The suite grows
with every month the champion has trained on, and DVC versions each month's items.

Which items count is decided at the gate, not here: the suite holds every correction from a
pool batch the champion trained on (its ``tuneloop.data.batches`` tag, via ``metrics/init.json``),
and ``tuneloop.judge.gate`` counts as *fixed* only the items the champion answers right today
(``gate.primary_metric`` 1 on the item). An item the champion gets wrong was never fixed for
the model that serves, so a candidate cannot break it; each one the champion gets right and
the candidate does not is a *broken fix*, and more than ``gate.max_broken_fixes`` of them
fail the gate.

An item is one question and its answer: the newest correction of a question wins (the shop's
policy may have changed since), dated by the first batch that gave that answer. A badcase
whose conversation is more than one user turn (or has a system turn) is left out and
counted: an lm-eval item here is one question, and dropping the rest of the conversation
would test something the user never asked.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from tuneloop.data.records import pool_batches
from tuneloop.data.text import normalise
from tuneloop.io import read_jsonl
from tuneloop.tracking.init_from import ServingChampion

# Where the suite's loader (eval/fixed_badcases/utils.py) reads test.jsonl from, set by the
# evaluate stage: a task's items lie in the task's folder (its paths.fixed_badcases).
ITEMS_FOLDER_ENV = "TUNELOOP_FIXED_BADCASES"

log = logging.getLogger(__name__)

ID_CHARS = 16


class FixedBadcasesMetrics(BaseModel):
    """``metrics/fixed_badcases.json``: the suite, and the champion it was built for."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    items: int = Field(description="the suite's items: one question and its newest correction")
    champion_version: str | None = Field(
        description="the serving champion's version (``metrics/init.json``); None: no champion"
    )
    champion_batches: tuple[str, ...] = Field(description="the pool batches it trained on")
    items_by_batch: dict[str, int] = Field(
        description="items by the pool batch that first gave the answer"
    )
    items_by_source: dict[str, int] = Field(
        description="items by the badcase's meta.source (unknown: none)"
    )
    left_out: dict[str, int] = Field(description="corrections not in the suite, by reason")


@dataclass
class Suite:
    items: list[dict[str, Any]] = field(default_factory=list)
    left_out: Counter[str] = field(default_factory=Counter)

    def metrics(self, champion: ServingChampion | None) -> FixedBadcasesMetrics:
        """The suite's numbers, built for ``champion`` (None: no champion yet)."""
        return FixedBadcasesMetrics(
            items=len(self.items),
            champion_version=champion.version if champion else None,
            champion_batches=champion.batches if champion else (),
            items_by_batch=dict(Counter(item["batch"] for item in self.items)),
            items_by_source=dict(Counter(item["source"] for item in self.items)),
            left_out=dict(self.left_out),
        )


def build(pool: Path, champion_batches: Collection[str], task: str | None = None) -> Suite:
    """The suite's items: the newest correction of each question, from the champion's batches
    (of ``task``'s records, with several tasks)."""
    seen = set(champion_batches)
    latest: dict[str, dict[str, Any]] = {}  # normalised question -> item
    suite = Suite()
    for path in pool_batches(pool, task):
        for record in read_jsonl(path):
            if record["kind"] != "badcase" or record.get("corrected_response") is None:
                continue
            messages = record["messages"]
            if len(messages) != 1 or messages[0]["role"] != "user":
                suite.left_out["not_one_user_turn"] += 1
                continue
            question, answer = messages[0]["content"], record["corrected_response"]
            key = normalise(question)
            before = latest.get(key)
            if before is not None and normalise(before["answer"]) == normalise(answer):
                continue  # the same fix again: it dates from its first batch
            if before is not None:
                suite.left_out["superseded_by_a_newer_correction"] += 1
            meta = record.get("meta") or {}
            latest[key] = {
                "id": record["id"][:ID_CHARS],
                "question": question,
                "answer": answer,
                "batch": path.stem,
                "source": str(meta.get("source") or "unknown"),
                "arm": meta.get("arm"),
                "model_version": meta.get("model_version"),
            }
    for item in latest.values():
        if item["batch"] in seen:
            suite.items.append(item)
        else:
            # Training data this month (the champion never trained on it): a test next month.
            suite.left_out["not_trained_on_by_the_champion"] += 1
    suite.items.sort(key=lambda item: (item["batch"], item["id"]))
    return suite
