"""What every stage wrote in the tiny project, each run once in order by the retrain flow.

The in-process entry point (each stage's ``main()``) is run by tests/test_evaluate.py.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from pydantic import BaseModel

from tests.helpers import ROOT, dvc_name, flow_runs
from tuneloop.cli.reference import metrics_models
from tuneloop.data.metrics import CleanMetrics, IngestMetrics, PackMetrics, TaskNames
from tuneloop.demo import domain
from tuneloop.io import read_model
from tuneloop.judge.decision import Decision, read_scores
from tuneloop.judge.fixed_badcases import FixedBadcasesMetrics
from tuneloop.models import BaseMetrics
from tuneloop.orchestration.flow_results import TasksRun
from tuneloop.pipeline import stage_order
from tuneloop.preflight.run import PreflightMetrics
from tuneloop.quantization import ExportMetrics
from tuneloop.tracking.init_from import InitMetrics, TaskChampion
from tuneloop.training.merge import MergeFile
from tuneloop.training.metrics import TrainMetrics

# The whole suite (`make test`): the tiny project (the retrain flow)
pytestmark = pytest.mark.slow

STAGES = [importlib.import_module(f"stages.{name}") for name in stage_order(ROOT)]


def metrics(folder: Path, stage: str) -> dict[str, Any]:
    return json.loads((folder / "metrics" / f"{stage}.json").read_text())


@pytest.fixture(scope="module")
def project(tiny_project: tuple[Path, TasksRun]) -> Path:
    """The session's tiny project: every stage ran once, under the retrain flow."""
    return tiny_project[0]


def test_base_builds_a_loadable_tiny_model(project: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(project / "models/base")
    tokenizer = AutoTokenizer.from_pretrained(project / "models/base")
    assert model.config.model_type == "qwen3"
    assert 100_000 < model.num_parameters() < 2_000_000
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    assert metrics(project, "base")["parameters"] == model.num_parameters()


def test_ingest_accounts_for_every_line(project: Path) -> None:
    m = metrics(project, "ingest")
    assert m["lines"] == m["accepted"] + m["quarantined"] + m["duplicates"]
    assert m["quarantined"] == len(domain.MALFORMED_LINES)
    assert m["lines"] == 500 + 40 + len(domain.MALFORMED_LINES)


def test_clean_splits_and_builds_dpo_pairs(project: Path) -> None:
    m = metrics(project, "clean")
    assert m["train"] > 0 and m["val"] > 0
    assert m["records_in"] == m["train"] + m["val"] + sum(m["removed"].values())
    assert m["dpo_pairs"] == 40  # every demo badcase carries a correction
    assert m["dpo_removed"] == {}  # and every pair passes the SFT filters
    pair = json.loads((project / "data/clean/dpo.jsonl").read_text().splitlines()[0])
    assert pair["chosen"] != pair["rejected"]


def test_pack_writes_balanced_bins_within_seq_len(project: Path) -> None:
    table = pq.read_table(project / "data/packed/rank-00000.parquet")
    for ids, labels, lengths in zip(
        table["input_ids"].to_pylist(),
        table["labels"].to_pylist(),
        table["seq_lengths"].to_pylist(),
        strict=True,
    ):
        assert len(ids) == len(labels) == sum(lengths) <= 128
    m = metrics(project, "pack")
    assert m["micro_batches_per_rank"] == table.num_rows
    assert 0.8 < m["efficiency"] <= 1.0


def test_preflight_passes_and_reports_every_check(project: Path) -> None:
    report = json.loads((project / "reports/preflight.json").read_text())
    # The demo's learning rate (3e-3, a random-init tiny model) warns; nothing may fail.
    assert report["ok"] and "fail" not in {c["status"] for c in report["checks"]}
    assert {c["name"] for c in report["checks"]} >= {"ranks_balanced", "labels_present"}
    # The contamination check read the user-turn keys clean wrote, not the JSON.
    (contamination,) = [c for c in report["checks"] if c["name"] == "no_eval_contamination"]
    assert contamination["status"] == "pass" and "train.turns.npz" in contamination["detail"]


def test_train_changes_only_the_adapter(project: Path) -> None:
    from safetensors.torch import load_file

    adapter = load_file(project / "models/adapter/adapter_model.safetensors")
    assert adapter and all("lora_" in name for name in adapter)
    # LoRA B starts at zero; training must have moved it.
    assert any(t.abs().sum() > 0 for name, t in adapter.items() if "lora_B" in name)
    m = metrics(project, "train")
    assert m["global_steps"] == 30
    assert m["last_logged_loss"] < m["first_logged_loss"]
    manifest = json.loads((project / "models/adapter/manifest.json").read_text())
    assert manifest["stage"] == "train@support" and manifest["params"]["train"]["max_steps"] == 30


def test_merge_is_equivalent_to_the_adapter(project: Path) -> None:
    m = metrics(project, "merge")
    assert m["max_abs_logit_diff"] < 1e-3
    assert m["identical_generations"] == 1.0
    assert (project / "models/merged/config.json").exists()


def test_export_writes_fp8_compressed_tensors(project: Path) -> None:
    config = json.loads((project / "models/fp8/config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    assert metrics(project, "export")["formats"]["fp8"]["size_ratio"] < 1.0
    # The formats export.formats does not list keep a folder (a DVC out) saying so.
    for fmt in ("nvfp4", "nvfp4a16"):
        assert [p.name for p in (project / "models" / fmt).iterdir()] == ["manifest.json"]
        manifest = json.loads((project / "models" / fmt / "manifest.json").read_text())
        assert manifest["exported"] is False and "export.formats" in manifest["reason"]


def test_evaluate_scores_every_model_and_decides(project: Path) -> None:
    scores = metrics(project, "evaluate")
    assert set(scores) == {"base", "candidate", "candidate-fp8"}
    for per_suite in scores.values():
        assert set(per_suite["support_demo"]) >= {
            "accuracy",
            "format_compliance",
            "hallucination_rate",
        }
    decision = json.loads((project / "metrics/decision.json").read_text())
    assert isinstance(decision["passed"], bool) and decision["reasons"]
    assert (project / "reports/eval.png").stat().st_size > 1000


# Each stage's metrics file and the model its readers read it through.
METRICS_MODELS: dict[str, type[BaseModel]] = {
    "base": BaseMetrics,
    "init": InitMetrics,
    "task_names": TaskNames,
    "ingest": IngestMetrics,
    "champions/<task>": TaskChampion,
    "fixed_badcases": FixedBadcasesMetrics,
    "clean": CleanMetrics,
    "pack": PackMetrics,
    "preflight": PreflightMetrics,
    "train": TrainMetrics,
    "merge": MergeFile,
    "export": ExportMetrics,
}
# The gate's scores and decision (evaluate.json, decision.json) have their own models.
GATE_FILES = {"evaluate", "decision"}


def key(path: Path) -> str:
    """A metrics file's key in ``METRICS_MODELS``: its stage, or ``champions/<task>``."""
    return "champions/<task>" if path.parent.name == "champions" else path.stem


def test_every_metrics_file_reads_back_through_its_model(project: Path) -> None:
    files = sorted([*project.glob("metrics/*.json"), *project.glob("tasks/*/metrics/*.json")])
    files += sorted(project.glob("metrics/champions/*.json"))
    # The manual's page of metrics files lists the same files (docs/reference/metrics.md).
    assert set(metrics_models()) == set(METRICS_MODELS) | {"decision"}
    # Every stage wrote its file, and no file is left without a model.
    assert {key(path) for path in files} - GATE_FILES == set(METRICS_MODELS)
    for path in files:
        if path.stem == "decision":
            assert Decision.read(path).verdict in {"pass", "fail", "inconclusive"}, path
            continue
        if path.stem == "evaluate":
            assert read_scores(path), path
            continue
        record = read_model(path, METRICS_MODELS[key(path)])
        # Nothing lost or added on the way: the model writes back the file it read.
        assert record.model_dump(mode="json") == json.loads(path.read_text()), path


def test_each_stage_logged_an_mlflow_run_with_lineage(project: Path) -> None:
    _, by_stage = flow_runs(project)
    assert set(by_stage) == {dvc_name(s.__name__.split(".")[-1]) for s in STAGES}
    for run in by_stage.values():
        assert run.info.status == "FINISHED"
        assert {"git.commit", "git.dirty", "params.hash"} <= set(run.data.tags)
    assert (
        "loss" in by_stage[dvc_name("train")].data.metrics
    )  # from the transformers MLflow callback
