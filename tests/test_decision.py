"""``metrics/decision.json`` and ``metrics/evaluate.json`` through their one model each."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.gate_helpers import SUITE, a_decision
from tuneloop.io import ModelFileError, read_json, write_json
from tuneloop.judge.decision import Champion, Decision, read_scores
from tuneloop.judge.gate import CANDIDATE

pytestmark = pytest.mark.fast


def test_a_decision_written_reads_back_the_same(tmp_path: Path) -> None:
    champion = Champion(name="tuneloop-support", version="3", run_id="r1", source="s")
    written = a_decision(champion=champion, engines={CANDIDATE: "hf transformers 4.x"})
    path = tmp_path / "metrics" / "decision.json"
    written.write(path)
    found = Decision.read(path)
    assert found == written
    assert found.passed and found.champion == champion and found.candidate_key == "abc123"
    [check] = [c for c in found.checks if c.rule == "beats_base"]
    assert check.suite == SUITE and check.low is not None and check.low > 0
    # The file keeps decision.json's shape: the keys every reader and old file know.
    data = read_json(path)
    assert {"verdict", "passed", "reasons", "checks", "comparisons", "slices"} <= set(data)
    assert data["champion"]["version"] == "3" and data["thresholds"]["min_gain"] == 0.05


def test_a_file_with_a_misspelt_or_missing_key_is_refused_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "decision.json"
    good = a_decision().model_dump(mode="json")
    misspelt = {("verdikt" if k == "verdict" else k): v for k, v in good.items()}
    write_json(path, misspelt)
    with pytest.raises(ModelFileError, match=r"decision\.json is not a Decision") as error:
        Decision.read(path)
    assert str(path) in str(error.value) and "verdikt" in str(error.value)
    missing = {k: v for k, v in good.items() if k != "reasons"}
    write_json(path, missing)
    with pytest.raises(ModelFileError, match="reasons"):
        Decision.read(path)
    path.write_text("{not json", encoding="utf-8")
    with pytest.raises(ModelFileError, match=str(path)):
        Decision.read(path)


def test_an_old_decision_without_the_evaluations_fields_still_reads(tmp_path: Path) -> None:
    # Before engines, exports or the fixed badcases were recorded: their defaults stand in.
    old = a_decision().model_dump(mode="json")
    for key in ("engines", "exports", "fixed_badcases", "backend", "unsettled"):
        del old[key]
    path = tmp_path / "decision.json"
    path.write_text(json.dumps(old), encoding="utf-8")
    found = Decision.read(path)
    assert found.engines == {} and not found.refused("fp8") and found.fixed_badcases.suite is None


def test_scores_read_as_model_suite_metric_numbers(tmp_path: Path) -> None:
    path = tmp_path / "evaluate.json"
    write_json(path, {CANDIDATE: {SUITE: {"accuracy": 0.8}}})
    assert read_scores(path) == {CANDIDATE: {SUITE: {"accuracy": 0.8}}}
    write_json(path, {CANDIDATE: {SUITE: {"accuracy": "high"}}})
    with pytest.raises(ModelFileError, match=r"evaluate\.json is not model -> suite"):
        read_scores(path)
