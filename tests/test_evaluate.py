"""The evaluate gate: planted scores for every rule, then the real path on a tiny trained project.

The real path trains the tiny model just long enough to learn the reply format
(format_compliance 0 -> 1; exact answers need the full demo), so the project's
gate here judges on ``format_compliance``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from mlflow.tracking import MlflowClient

from stages import base, clean, evaluate, export, ingest, merge, pack, preflight, train
from tests.helpers import ROOT, write_params
from tuneloop import demo, gate, registry, scoring
from tuneloop.gate import BASE, CANDIDATE, CHAMPION, FP8, GateError, Scores, decide
from tuneloop.params import GateParams, load_params

SUITE = "support_demo"
DIRECTIONS = {SUITE: {"accuracy": True, "format_compliance": True, "hallucination_rate": False}}
GATE = GateParams(primary_metric="accuracy", min_gain=0.05, max_regression=0.02, fp8_max_drop=0.02)


def scores(**models: tuple[float, float, float]) -> Scores:
    """``name=(accuracy, format_compliance, hallucination_rate)`` for each model."""
    return {
        name.replace("_", "-"): {
            SUITE: {"accuracy": a, "format_compliance": f, "hallucination_rate": h}
        }
        for name, (a, f, h) in models.items()
    }


def failed_rules(decision: dict[str, Any]) -> set[tuple[str, str]]:
    return {(c["rule"], c["metric"]) for c in decision["checks"] if not c["passed"]}


# --- decide() on planted scores ---------------------------------------------------------------


def test_a_candidate_that_beats_base_passes_without_a_champion() -> None:
    planted = scores(
        base=(0.40, 0.50, 0.60), candidate=(0.75, 0.99, 0.10), candidate_fp8=(0.74, 0.99, 0.10)
    )
    decision = decide(planted, DIRECTIONS, GATE)
    assert decision["passed"] and not decision["failed"]
    # A reason for every check, pass or fail, and one for the missing champion.
    assert len(decision["reasons"]) == len(decision["checks"]) + 1
    assert any("no champion" in reason for reason in decision["reasons"])
    assert {c["rule"] for c in decision["checks"]} == {"beats_base", "fp8_within"}


def test_too_small_a_gain_over_base_fails() -> None:
    planted = scores(
        base=(0.72, 0.9, 0.2), candidate=(0.75, 0.9, 0.2), candidate_fp8=(0.75, 0.9, 0.2)
    )
    decision = decide(planted, DIRECTIONS, GATE)
    assert not decision["passed"]
    assert failed_rules(decision) == {("beats_base", "accuracy")}
    assert "gain +0.030 (needs >= +0.050): FAIL" in decision["reasons"][0]


def test_a_gain_exactly_at_the_threshold_passes() -> None:
    # 0.75 - 0.70 is 0.04999999999999993 in floats; a tie must not fail.
    planted = scores(
        base=(0.70, 0.9, 0.2), candidate=(0.75, 0.9, 0.2), candidate_fp8=(0.75, 0.9, 0.2)
    )
    assert decide(planted, DIRECTIONS, GATE)["passed"]


def test_a_planted_fp8_drop_past_the_limit_fails() -> None:
    planted = scores(
        base=(0.40, 0.5, 0.5), candidate=(0.75, 0.98, 0.10), candidate_fp8=(0.70, 0.98, 0.10)
    )
    decision = decide(planted, DIRECTIONS, GATE)
    assert not decision["passed"]
    assert failed_rules(decision) == {("fp8_within", "accuracy")}
    assert decision["failed"] == [
        "support_demo/accuracy (higher is better): candidate-fp8 0.700 vs candidate 0.750: "
        "drop +0.050 (allowed <= 0.020): FAIL"
    ]


def test_fp8_hallucinating_more_is_a_drop() -> None:
    planted = scores(
        base=(0.40, 0.5, 0.5), candidate=(0.75, 0.98, 0.10), candidate_fp8=(0.75, 0.98, 0.15)
    )
    assert failed_rules(decide(planted, DIRECTIONS, GATE)) == {("fp8_within", "hallucination_rate")}


def test_falling_behind_the_champion_on_any_metric_fails() -> None:
    planted = scores(
        base=(0.40, 0.50, 0.50),
        champion=(0.78, 0.99, 0.05),
        candidate=(0.75, 0.99, 0.05),
        candidate_fp8=(0.75, 0.99, 0.05),
    )
    decision = decide(planted, DIRECTIONS, GATE)
    assert not decision["passed"]
    assert failed_rules(decision) == {("no_regression", "accuracy")}
    assert "candidate 0.750 vs champion 0.780: behind by +0.030" in decision["failed"][0]


def test_hallucination_rate_is_lower_is_better_against_the_champion() -> None:
    worse = scores(
        base=(0.4, 0.5, 0.5),
        champion=(0.75, 0.99, 0.05),
        candidate=(0.80, 0.99, 0.10),
        candidate_fp8=(0.80, 0.99, 0.10),
    )
    decision = decide(worse, DIRECTIONS, GATE)
    assert failed_rules(decision) == {("no_regression", "hallucination_rate")}
    assert "(lower is better)" in decision["failed"][0]
    better = scores(
        base=(0.4, 0.5, 0.5),
        champion=(0.75, 0.99, 0.10),
        candidate=(0.80, 0.99, 0.05),
        candidate_fp8=(0.80, 0.99, 0.05),
    )
    assert decide(better, DIRECTIONS, GATE)["passed"]


def test_a_primary_metric_no_suite_reports_is_an_error() -> None:
    planted = scores(base=(0, 0, 0), candidate=(0, 0, 0), candidate_fp8=(0, 0, 0))
    gate = GATE.model_copy(update={"primary_metric": "f1"})
    with pytest.raises(GateError, match=r"gate.primary_metric='f1' is not reported"):
        decide(planted, DIRECTIONS, gate)


def test_a_metric_without_a_direction_is_an_error() -> None:
    planted = scores(base=(0, 0, 0), candidate=(0, 0, 0), candidate_fp8=(0, 0, 0))
    directions = {SUITE: {"accuracy": True, "format_compliance": True}}
    with pytest.raises(GateError, match="higher_is_better"):
        decide(planted, directions, GATE)


def test_report_shows_every_model_and_metric_with_deltas() -> None:
    planted = scores(
        base=(0.40, 0.50, 0.50),
        champion=(0.70, 0.90, 0.10),
        candidate=(0.75, 0.95, 0.05),
        candidate_fp8=(0.74, 0.95, 0.05),
    )
    decision = decide(planted, DIRECTIONS, GATE)
    decision["champion"] = {"name": "m", "version": "3", "run_id": "", "source": ""}
    text = gate.report(planted, decision)
    assert "Gate: **PASS**" in text and "Champion: m v3" in text
    header = next(line for line in text.splitlines() if line.startswith("| metric"))
    for column in (BASE, CHAMPION, CANDIDATE, FP8, "candidate - base", "candidate - champion"):
        assert column in header
    row = next(line for line in text.splitlines() if line.startswith("| accuracy"))
    assert row == "| accuracy ↑ | 0.400 | 0.700 | 0.750 | 0.740 | +0.350 | +0.050 | -0.010 |"
    assert "| hallucination_rate ↓ |" in text


def test_backend_auto_is_hf_without_vllm_and_a_gpu() -> None:
    params = load_params(ROOT / "params.yaml")
    assert params.evaluate.backend == "auto"
    if not (importlib.util.find_spec("vllm") and torch.cuda.is_available()):
        assert scoring.backend(params) == "hf"
    if importlib.util.find_spec("vllm") is None:
        vllm = params.model_copy(
            update={"evaluate": params.evaluate.model_copy(update={"backend": "vllm"})}
        )
        with pytest.raises(RuntimeError, match=r"evaluate.backend=vllm but vllm is not installed"):
            scoring.backend(vllm)


# --- the real path ----------------------------------------------------------------------------

OVERRIDES: dict[str, dict[str, Any]] = {
    "train": {"max_steps": 40, "learning_rate": 1.0e-2, "logging_steps": 10},
    "evaluate": {"limit": 12, "batch_size": 12},
    "gate": {"primary_metric": "format_compliance", "min_gain": 0.05},
}


def read(folder: Path, name: str) -> Any:
    return json.loads((folder / "metrics" / name).read_text())


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    folder = tmp_path_factory.mktemp("gate")
    shutil.copytree(ROOT / "eval", folder / "eval")
    write_params(folder, OVERRIDES)
    previous = Path.cwd()
    os.chdir(folder)
    try:
        params = load_params()
        demo.seed_incoming(
            params.paths.incoming, params.demo.seed, params.demo.n_support, params.demo.n_badcases
        )
        for stage in (base, ingest, clean, pack, preflight, train, merge, export, evaluate):
            stage.main()
        yield folder
    finally:
        os.chdir(previous)


def test_the_trained_candidate_beats_the_base(project: Path) -> None:
    scores = read(project, "evaluate.json")
    decision = read(project, "decision.json")
    assert set(scores) == {BASE, CANDIDATE, FP8}  # no champion registered yet
    metric = decision["primary_metric"]
    assert scores[CANDIDATE][SUITE][metric] >= scores[BASE][SUITE][metric] + 0.05
    assert decision["passed"], decision["failed"]
    assert decision["champion"] is None
    assert decision["higher_is_better"][SUITE]["hallucination_rate"] is False
    assert read(project, "merge.json")["passed"] is True
    assert "| format_compliance ↑ |" in (project / "reports/eval.md").read_text()


def test_lm_eval_runs_the_suite_on_the_merged_model_offline(project: Path) -> None:
    out = project / "lm_eval_out"
    env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    command = [
        str(Path(sys.executable).parent / "lm_eval"),
        "--include_path",
        str(ROOT / "eval"),
        "--tasks",
        SUITE,
        "--model",
        "hf",
        "--model_args",
        f"pretrained={project / 'models/merged'},dtype=float32",
        "--apply_chat_template",
        "--device",
        "cpu",
        "--limit",
        "6",  # items 1-6: the sixth is unanswerable, so every metric has data
        "--output_path",
        str(out),
    ]
    # From another folder: the suite must find its data beside its own files.
    result = subprocess.run(command, cwd=out.parent.parent, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(next(out.rglob("results_*.json")).read_text())
    metrics = found["results"][SUITE]
    for name in ("accuracy", "format_compliance", "hallucination_rate"):
        assert isinstance(metrics[f"{name},none"], float), name
    assert found["higher_is_better"][SUITE]["hallucination_rate"] is False


def test_a_passed_candidate_is_registered_as_challenger(project: Path) -> None:
    params = load_params()
    done = registry.register_candidate(params, flow_run_id="flow-1")
    assert done.registered and done.version == "1" and done.alias == registry.CHALLENGER
    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    version = client.get_model_version_by_alias(params.tracking.registered_model, "challenger")
    assert str(version.version) == "1"
    assert version.tags["prefect.flow_run_id"] == "flow-1"
    assert (version.description or "").startswith("# Evaluation")


def test_a_planted_fp8_drop_fails_the_gate_on_the_real_path(project: Path) -> None:
    # An FP8 export of the untrained base stands in for a broken quantization.
    params = load_params()
    broken = params.model_copy(
        update={"paths": params.paths.model_copy(update={"merged": params.paths.base_model})}
    )
    kept = project / "fp8-kept"
    shutil.copytree(project / "models/fp8", kept)
    try:
        shutil.rmtree(project / "models/fp8")
        (project / "models/fp8").mkdir()
        export.export(broken, project / "models/fp8")
        evaluate.main()
        decision = read(project, "decision.json")
        assert not decision["passed"]
        assert ("fp8_within", "format_compliance") in failed_rules(decision)
        assert all(c["rule"] == "fp8_within" for c in decision["checks"] if not c["passed"])
    finally:
        shutil.rmtree(project / "models/fp8")
        kept.rename(project / "models/fp8")


def test_a_candidate_worse_than_the_champion_is_not_registered(project: Path) -> None:
    # Last in this module: it retrains the project far too short.
    params = load_params()
    name = params.tracking.registered_model
    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    client.set_registered_model_alias(name, "champion", "1")
    data = yaml.safe_load(Path("params.yaml").read_text())
    data["train"]["max_steps"] = 2
    Path("params.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    shutil.rmtree("checkpoints", ignore_errors=True)  # a fresh run, not a resumed one
    for stage in (train, merge, export, evaluate):
        stage.main()

    scores = read(project, "evaluate.json")
    decision = read(project, "decision.json")
    assert set(scores) == {BASE, CHAMPION, CANDIDATE, FP8}
    assert decision["champion"]["version"] == "1"
    assert not decision["passed"]
    assert ("no_regression", "format_compliance") in failed_rules(decision)
    assert any("vs champion" in reason for reason in decision["failed"])

    done = registry.register_candidate(load_params())
    assert not done.registered and done.version is None
    assert done.reasons[0] == "gate failed: nothing registered"
    assert set(decision["failed"]) <= set(done.reasons)
    versions = client.search_model_versions(f"name = '{name}'")
    assert [str(v.version) for v in versions] == ["1"]
    assert str(client.get_model_version_by_alias(name, "challenger").version) == "1"
