"""The merge's pure parts: the probe set spread over the suites, and what the check says.

No model here; the merge itself, on the tiny base, is in test_merge.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tuneloop.training import merge

# The fast tier: no pipeline, server or rank.
pytestmark = pytest.mark.fast


def test_probes_are_spread_over_every_suite(tmp_path: Path) -> None:
    for suite, count in (("a", 30), ("b", 10)):
        (tmp_path / suite).mkdir()
        lines = [json.dumps({"question": f"{suite}{i}", "answer": "x"}) for i in range(count)]
        (tmp_path / suite / "test.jsonl").write_text("\n".join(lines) + "\n")
    probes = merge.probe_questions(tmp_path, 8)
    assert len(probes) == len(set(probes)) == 8
    assert {p[0] for p in probes} == {"a", "b"}
    with pytest.raises(FileNotFoundError, match=r"paths\.eval_suites"):
        merge.probe_questions(tmp_path / "missing", 8)


def test_the_check_reports_differing_generations() -> None:
    with pytest.raises(merge.NotEquivalent, match="4 of 16 greedy generations differ"):
        merge.check(
            merge.MergeMetrics(
                max_abs_logit_diff=1e-6,
                mean_abs_logit_diff=1e-7,
                max_rel_logit_diff=1e-7,
                max_abs_logit=10.0,
                identical_generations=0.75,
                probes=16,
                saved_dtype="float32",
                tolerance=1e-3,
                passed=False,
            ),
            1e-3,
        )
