"""Model and dataset cards from the pipeline's own files, and the card inside exported folders.

The cards of a real trained project are checked in tests/test_evaluate.py; here the inputs
are written by hand so that every section's source is known.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from tests.helpers import ROOT
from tuneloop.data.metrics import CleanMetrics, IngestMetrics, ReplayMetrics
from tuneloop.io import write_json
from tuneloop.judge import cards, gate
from tuneloop.judge.decision import Decision
from tuneloop.judge.gate import BASE, CANDIDATE, FP8, SuiteItems
from tuneloop.params import load_params
from tuneloop.training.metrics import TrainMetrics

# The fast tier: no pipeline, server or rank.
pytestmark = pytest.mark.fast

SUITE = "support_demo"
DIRECTIONS = {SUITE: {"accuracy": True}}


def decision() -> Decision:
    ids = [str(i) for i in range(100)]
    lang = ["zh" if i % 2 else "en" for i in range(100)]
    items = {
        BASE: {SUITE: SuiteItems.of(ids, {"accuracy": [float(i < 40) for i in range(100)]})},
        CANDIDATE: {
            SUITE: SuiteItems.of(
                ids, {"accuracy": [float(i < 80) for i in range(100)]}, slices={"lang": lang}
            )
        },
        FP8: {SUITE: SuiteItems.of(ids, {"accuracy": [float(i < 80) for i in range(100)]})},
    }
    params = load_params(ROOT / "params.yaml")
    found = gate.decide(items, DIRECTIONS, params.gate, [SUITE])
    return found.judged(champion=None, candidate_key="abc123", backend="hf", engines={})


def project(folder: Path) -> None:
    """The files a run leaves: stage metrics, a pooled month, dvc.lock, a watchdog summary."""
    ingest = IngestMetrics(
        lines=10, accepted=8, accepted_by_source={"support-export": 8}, accepted_by_task={},
        quarantined=1, duplicates=1, blank_lines=0, reject_rate=0.1,
        quarantine_reasons={"bad_json": 1}, pii_scrubbed={"email": 2, "phone": 0},
        pool_records=8, by_task_folder={},
    )  # fmt: skip
    write_json(folder / "metrics/ingest.json", ingest.model_dump())
    replay = ReplayMetrics(
        fraction=0.25, seen_batches=(), new_batches=("b1",), replayed_train=0, new_train=6,
        not_replayed=0, replayed_dpo_pairs=0,
    )  # fmt: skip
    clean = CleanMetrics(
        records_in=8, train=6, val=1, train_tokens=600, dpo_pairs=1,
        removed={"eval_contamination": 1}, dpo_removed={}, batches=("b1",), replay=replay,
    )  # fmt: skip
    write_json(folder / "metrics/clean.json", clean.model_dump())
    train = TrainMetrics(
        method="lora", phases={}, train_loss=2.0, first_logged_loss=3.0, last_logged_loss=1.0,
        eval_loss=1.2, global_steps=30, epochs=1.0, seconds=12.5, tokens_per_second=900.0,
        gpu_hours=0.5, trainable_parameters=1000, lora_alpha=16,
        gradient_accumulation_steps=1, world_size=1,
    )  # fmt: skip
    write_json(folder / "metrics/train.json", train.model_dump())
    records = folder / "data/pool/records"
    records.mkdir(parents=True)
    lines = []
    for i, (source, created) in enumerate(
        [("support-export", "2026-10-02T00:00:00Z"), ("router-feedback", None)] * 2
    ):
        lines.append({
            "id": f"r{i}", "kind": "chat",
            "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
            "meta": {"source": source, "created_at": created},
            "provenance": {"ingested_at": "2026-11-01T00:00:00+00:00"},
        })  # fmt: skip
    (records / "b1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    lock = {
        "schema": "2.0",
        "stages": {"merge": {"outs": [{"path": "models/merged", "md5": "m1"}]}},
    }
    (folder / "dvc.lock").write_text(yaml.safe_dump(lock))
    watch = folder / "checkpoints/train/watch/20261101-000000"
    watch.mkdir(parents=True)
    write_json(watch / "watch.json", {
        "accounting": {
            "gpu_hours": {"compute": 0.4, "checkpoint-or-deadlock": 0.1},
            "share": {"compute": 0.8, "checkpoint-or-deadlock": 0.2},
        },
        "calibrations": {"0": {"gpu_model": "generic", "estimated": True}},
    })  # fmt: skip


def test_the_model_card_reports_every_section_from_its_source(tmp_path: Path) -> None:
    project(tmp_path)
    shipped = load_params(ROOT / "params.yaml")  # the demo trains in full; the card of a LoRA
    train = shipped.train.model_copy(update={"method": "lora", "learning_rate": 3.0e-3})
    params = shipped.model_copy(update={"train": train})
    facts = cards.gather(params, tmp_path, watch_root=Path("checkpoints/train/watch"))
    assert facts.pool == {("2026-10", "support-export"): 2, ("2026-11", "router-feedback"): 2}
    found = decision()
    card = cards.model_card(params, facts, found)
    front = yaml.safe_load(card.split("---\n")[1])
    assert front == {
        "base_model": "builtin:tiny",
        "library_name": "transformers",
        "tags": ["tuneloop", "sft", "lora", "fine-tuned"],
        "pipeline_tag": "text-generation",
    }
    assert "| month | router-feedback | support-export |" in card
    assert "| 2026-10 | 0 | 2 |" in card and "| 2026-11 | 2 | 0 |" in card
    assert "6 training and 1 validation chats, 1 DPO pairs" in card
    assert "| learning rate (sft) | 0.003 |" in card and "| result: eval_loss | 1.2 |" in card
    # The eval table with its interval, the slices, and the gate's reasons.
    assert "| support_demo | accuracy | candidate vs base | 0.800 | 0.400 | +0.400 [" in card
    assert "| support_demo | lang=en | accuracy | 50 |" in card
    assert "Verdict: **PASS**" in card and found.reasons[0] in card
    # GPU-hours by state, said to rest on estimated power bands.
    assert "0.5 GPU-hours" in card and "the power bands are estimates" in card
    assert "| compute | 0.4000 | 80.0% |" in card
    assert "- merged folder manifest sha256: `abc123`" in card
    assert "  - `models/merged`: `m1`" in card


def test_the_dataset_card_reports_sources_processing_and_decontamination(tmp_path: Path) -> None:
    project(tmp_path)
    params = load_params(ROOT / "params.yaml")
    card = cards.dataset_card(params, cards.gather(params, tmp_path))
    front = yaml.safe_load(card.split("---\n")[1])
    assert front["size_categories"] == ["n<1K"] and front["tags"] == ["tuneloop", "sft", "dpo"]
    assert "10 lines in, 8 accepted, 1 quarantined (bad_json 1), 1 duplicates" in card
    assert "email 2, phone 0" in card
    assert "decontamination: 1 chats removed" in card


def test_missing_facts_are_said_to_be_missing(tmp_path: Path) -> None:
    params = load_params(ROOT / "params.yaml")
    facts = cards.gather(params, tmp_path, watch_root=Path("checkpoints/train/watch"))
    card = cards.model_card(params, facts, decision())
    assert "No pool records found" in card
    assert "metrics/clean.json is missing" in card
    assert "metrics/train.json is missing" in card
    assert "GPU-hours by watchdog state: not recorded" in card
    assert "no dvc.lock yet" in card


def test_the_card_goes_into_linked_copies_not_the_dvc_outs(tmp_path: Path) -> None:
    merged = tmp_path / "merged"
    merged.mkdir()
    (merged / "model.safetensors").write_bytes(b"weights")
    (merged / "README.md").write_text("an old card")
    card = tmp_path / "model-card.md"
    card.write_text("---\nbase_model: x\n---\n# card\n")
    with cards.with_card({"merged": merged}, card) as copies:
        copy = copies["merged"]
        assert (copy / "README.md").read_text() == card.read_text()
        assert os.path.samefile(copy / "model.safetensors", merged / "model.safetensors")
        kept = copy
    assert not kept.exists()  # the copies are temporary
    assert (merged / "README.md").read_text() == "an old card"
