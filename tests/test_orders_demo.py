"""The two-task demo's second task: order fields out of a message as JSON
(``tuneloop/demo/orders.py``) and its suite's metrics (``eval/orders_demo/utils.py``)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

from tests.helpers import ROOT
from tuneloop.demo import orders
from tuneloop.params import load_params

# The fast tier: no pipeline, server or rank.
pytestmark = pytest.mark.fast


def suite_utils() -> ModuleType:
    path = ROOT / "eval/orders_demo/utils.py"
    spec = importlib.util.spec_from_file_location("orders_utils", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_order_has_one_right_object_in_english_whatever_the_language() -> None:
    gen = orders.Generator(3, "train")
    names = {p.en for p in orders.domain.CATALOGUE}
    for _ in range(200):
        item = gen.item()
        fields = json.loads(item.answer)
        assert list(fields) == list(orders.FIELDS)
        assert fields["product"] in names
        # The message names the product in its own language; the object always in English.
        shown = next(p for p in orders.domain.CATALOGUE if p.en == fields["product"])
        assert (shown.en if item.lang == "en" else shown.zh) in item.question


def test_the_eval_split_shares_no_customer_or_reference_with_the_train_split() -> None:
    train = [orders.Generator(0, "train").item().question for _ in range(300)]
    evaluated = [orders.Generator(0, "eval").item().question for _ in range(300)]
    assert not set(train) & set(evaluated)
    assert not any(name in q for q in train for name in orders.domain.NAMES_EVAL)


def test_the_shipped_suite_is_what_the_generator_writes(tmp_path: Path) -> None:
    shipped = ROOT / "eval/orders_demo/test.jsonl"
    orders.write_eval_suite(tmp_path / "test.jsonl", 0)
    assert (tmp_path / "test.jsonl").read_bytes() == shipped.read_bytes()
    questions = [json.loads(line)["question"] for line in shipped.read_text().splitlines()]
    assert len(questions) == len(set(questions)) == orders.EVAL_ITEMS


@pytest.mark.parametrize(
    ("said", "scores"),
    [
        ('{"product": "Zephyr fan", "express": true}', (1.0, 1.0, 1.0)),
        # Spacing and key order are not the answer.
        ('{ "express":true,"product":"Zephyr fan"}', (1.0, 1.0, 1.0)),
        ('{"product": "Zephyr fan", "express": false}', (0.0, 1.0, 0.5)),
        ('{"product": "Zephyr fan", "express": "yes"}', (0.0, 0.0, 0.5)),
        ('{"product": "Zephyr fan"}', (0.0, 0.0, 0.5)),
        ("Order received: Zephyr fan.", (0.0, 0.0, 0.0)),
        ('["Zephyr fan", true]', (0.0, 0.0, 0.0)),
    ],
)
def test_the_suite_scores_the_object_not_the_text(said: str, scores: tuple[float, ...]) -> None:
    doc = {"answer": orders.order_json("Zephyr fan", True)}
    got = suite_utils().process_results(doc, [said])
    assert (got["accuracy"], got["format_compliance"], got["field_accuracy"]) == scores


def test_a_corrected_order_was_wrong_and_its_correction_is_right() -> None:
    for record in orders.badcase_records(0, 50):
        assert record["bad_response"] != record["corrected_response"]
        assert json.loads(str(record["corrected_response"]))


def test_a_month_is_seeded_once_and_a_file_already_there_is_kept(tmp_path: Path) -> None:
    params = load_params(ROOT / "params.yaml").demo.model_copy(
        update={"n_orders": 50, "n_order_badcases": 5}
    )
    written = orders.seed_month(tmp_path, params)
    assert sorted(p.name for p in written) == [
        "order-corrections-2026-10.jsonl",
        "orders-export-2026-10.jsonl",
    ]
    export = tmp_path / "orders-export-2026-10.jsonl"
    lines = export.read_text().splitlines()
    assert len(lines) == 50
    # A share of the export is the general skill's replay, as the support export's is.
    sources = {json.loads(line)["source"] for line in lines}
    assert sources == {"orders-export", "general-replay"}
    export.write_text("kept\n")
    assert orders.seed_month(tmp_path, params) == []
    assert export.read_text() == "kept\n"
