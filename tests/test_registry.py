"""Registering a candidate in a real MLflow store (SQLite in a temp project); finding the champion.

The candidate is the tiny base model with a planted gate decision: what is
under test is the registry, not the scores (tests/test_evaluate.py runs the
real gate).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import mlflow.pyfunc
import pytest
import yaml
from mlflow.tracking import MlflowClient

from stages import base, export
from tests.gate_helpers import a_decision
from tests.helpers import ROOT, write_params
from tuneloop.data.metrics import CleanMetrics, ReplayMetrics
from tuneloop.io import write_json, write_text
from tuneloop.judge import cards, gate, gate_report
from tuneloop.judge.decision import Champion, UnsettledRule
from tuneloop.params import Params, load_params
from tuneloop.tracking import init_from, registry

SUITE = "support_demo"
DIRECTIONS = {SUITE: {"accuracy": True, "format_compliance": True, "hallucination_rate": False}}
NAME = "tuneloop-support"
ITEMS = 100
BATCHES = ["20261001T020000000000Z", "20261101T020000000000Z"]


def planted(candidate: float, champion: float | None = None) -> gate.Items:
    """Per-item scores: each model right on the first ``share x ITEMS`` items."""
    models = {"base": 0.4, "candidate": candidate, "candidate-fp8": candidate}
    if champion is not None:
        models["champion"] = champion
    ids = [str(i) for i in range(ITEMS)]
    return {
        name: {
            SUITE: gate.SuiteItems.of(
                ids,
                {
                    "accuracy": [float(i < round(share * ITEMS)) for i in range(ITEMS)],
                    "format_compliance": [1.0] * ITEMS,
                    "hallucination_rate": [0.0] * ITEMS,
                },
            )
        }
        for name, share in models.items()
    }


def write_evaluation(params: Params, items: gate.Items, champion: str | None) -> None:
    """What the evaluate stage leaves behind, for planted per-item scores."""
    compared = None
    if champion is not None:
        compared = Champion(name=NAME, version=champion, run_id="", source="")
    decision = gate.decide(items, DIRECTIONS, params.gate, [SUITE]).judged(
        champion=compared,
        candidate_key=registry.candidate_key(params.paths.merged),
        backend="hf",
        engines={},
    )
    scores = gate.scores_of(items)
    decision.write(params.paths.metrics / "decision.json")
    write_json(params.paths.metrics / "evaluate.json", scores)
    write_text(params.paths.reports / "eval.md", gate_report.report(scores, decision, DIRECTIONS))
    gate_report.plot(scores, DIRECTIONS, params.paths.reports / "eval.png")
    facts = cards.gather(params, Path())
    write_text(params.paths.reports / "model-card.md", cards.model_card(params, facts, decision))
    write_text(params.paths.reports / "dataset-card.md", cards.dataset_card(params, facts))


def client(project: Path) -> MlflowClient:
    return MlflowClient(f"sqlite:///{project / 'mlflow.db'}")


# The whole suite (`make test`): dvc repro, the base stage
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    folder = tmp_path_factory.mktemp("registry")
    shutil.copytree(ROOT / "eval", folder / "eval")
    write_params(folder)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com"]
    subprocess.run([*git, "init", "-q"], cwd=folder, check=True)
    subprocess.run([*git, "add", "params.yaml"], cwd=folder, check=True)
    subprocess.run([*git, "commit", "-qm", "params"], cwd=folder, check=True)
    previous = Path.cwd()
    os.chdir(folder)
    try:
        base.main()
        params = load_params()
        shutil.copytree(params.paths.base_model, params.paths.merged)
        as_merged = params.paths.model_copy(update={"merged": params.paths.base_model})
        export.export(params.model_copy(update={"paths": as_merged}))
        lock = {
            "schema": "2.0",
            "stages": {
                "ingest": {
                    "deps": [{"path": "data/badcases/incoming", "md5": "in.dir"}],
                    "outs": [{"path": "data/pool", "md5": "pool.dir"}],
                },
                "merge": {
                    "deps": [{"path": "stages/merge.py", "md5": "code"}],
                    "outs": [{"path": "models/merged", "md5": "merged.dir"}],
                },
            },
        }
        Path("dvc.lock").write_text(yaml.safe_dump(lock))
        # What clean says the training set drew from: month 2 in full, month 1 replayed.
        clean = CleanMetrics(
            records_in=10,
            train=8,
            val=2,
            train_tokens=800,
            dpo_pairs=0,
            removed={},
            dpo_removed={},
            batches=tuple(BATCHES),
            replay=ReplayMetrics(
                fraction=0.25,
                seen_batches=tuple(BATCHES[:1]),
                new_batches=tuple(BATCHES[1:]),
                replayed_train=2,
                new_train=6,
                not_replayed=0,
                replayed_dpo_pairs=0,
            ),
        )
        write_json(params.paths.metrics / "clean.json", clean.model_dump())
        write_evaluation(params, planted(0.75), champion=None)
        yield folder
    finally:
        os.chdir(previous)


@pytest.fixture(scope="module")
def v1(project: Path) -> tuple[registry.Registration, str]:
    """The passed candidate registered as v1 under a run of the flow's; and that run's id."""
    params = load_params()
    store = client(project)
    experiment = store.get_experiment_by_name(params.tracking.experiment)
    assert experiment is not None
    retrain = store.create_run(experiment.experiment_id, run_name="retrain")  # the flow's run
    done = registry.register_candidate(params, run_id=retrain.info.run_id, flow_run_id="flow-42")
    return done, retrain.info.run_id


@pytest.fixture(scope="module")
def champion(project: Path, v1: tuple[registry.Registration, str]) -> str:
    """v1 released: the champion alias on it (as a promotion leaves it)."""
    client(project).set_registered_model_alias(NAME, registry.CHAMPION, "1")
    return "1"


def test_no_registered_model_means_no_champion(project: Path) -> None:
    assert registry.find_alias(NAME, registry.CHAMPION, client(project)) is None


def test_a_passed_candidate_is_registered_with_its_lineage_and_report(
    project: Path, tmp_path: Path, v1: tuple[registry.Registration, str]
) -> None:
    store = client(project)
    done, run_id = v1
    assert done.registered and done.created and (done.version, done.alias) == ("1", "challenger")
    version = store.get_model_version_by_alias(NAME, "challenger")
    assert str(version.version) == "1" and version.run_id == run_id
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    tags = version.tags
    assert tags["git.commit"] == commit
    assert tags["git.dirty"] in {"true", "false"}
    assert len(tags["params.hash"]) == 16
    assert tags["prefect.flow_run_id"] == "flow-42"
    assert tags["dvc.out.models/merged"] == "merged.dir"
    assert tags["dvc.out.data/pool"] == "pool.dir"
    assert tags["dvc.dep.data/badcases/incoming"] == "in.dir"
    assert "dvc.dep.stages/merge.py" not in tags  # code is pinned by the commit
    assert tags["gate.passed"] == "true"
    # Month over month: where training started, which pool batches, at what replay share.
    assert tags[init_from.TAG] == "base"
    assert tags[init_from.TAG_BATCHES] == ",".join(BATCHES)
    assert tags[init_from.TAG_NEW_BATCHES] == BATCHES[1]
    assert tags[init_from.TAG_REPLAY] == "0.25"
    assert version.description == (project / "reports/eval.md").read_text()
    logged = {a.path for a in store.list_artifacts(run_id, "evaluation")}
    assert logged == {
        f"evaluation/{name}"
        for name in (
            "eval.md",
            "eval.png",
            "model-card.md",
            "dataset-card.md",
            "decision.json",
            "evaluate.json",
        )
    }

    # The model card travels in both exported folders; the DVC outs themselves are untouched.
    card = (project / "reports/model-card.md").read_text()
    assert card.startswith("---\nbase_model: builtin:tiny\n")
    for artifact in (registry.MERGED, registry.FP8):
        folder = registry.download_folder(version, artifact, tmp_path / artifact)
        assert (folder / "README.md").read_text() == card
    assert not (project / "models/merged/README.md").exists()
    assert not (project / "models/fp8/README.md").exists()
    # Its formats are tagged, so a release picks one its hosts run (export.formats: fp8).
    assert version.tags[registry.TAG_FORMATS] == "fp8" and registry.formats_of(version) == ("fp8",)

    model = mlflow.pyfunc.load_model(f"models:/{NAME}@challenger")
    answers = model.predict(["How long does shipping take for the Pixel camera?"])
    assert isinstance(answers, list) and len(answers) == 1 and isinstance(answers[0], str)


def test_registering_the_same_candidate_again_adds_no_version(
    project: Path, v1: tuple[registry.Registration, str]
) -> None:
    done = registry.register_candidate(load_params())
    assert done.registered and done.version == "1"
    assert not done.created  # so the flow does not announce it, and start a release, again
    assert done.reasons[0] == f"already registered as {NAME} v1"
    assert len(client(project).search_model_versions(f"name = '{NAME}'")) == 1


def test_the_champion_is_found_and_downloaded(project: Path, tmp_path: Path, champion: str) -> None:
    store = client(project)
    found = registry.find_alias(NAME, registry.CHAMPION, store)
    assert found is not None and str(found.version) == "1"
    assert registry.describe(found) == Champion(
        name=NAME, version="1", run_id=found.run_id, source=found.source
    )
    merged = registry.download_folder(found, registry.MERGED, tmp_path / "m")
    assert (merged / "model.safetensors").read_bytes() == (
        project / "models/merged/model.safetensors"
    ).read_bytes()
    fp8 = registry.download_folder(found, registry.FP8, tmp_path / "f")
    config = json.loads((fp8 / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"


def test_init_from_champion_fetches_the_champion_once(project: Path, champion: str) -> None:
    # The champion is v1, whose merged folder is models/merged.
    params = load_params()
    assert params.train.init_from == "champion"
    start = registry.resolve_start(params, params.paths.init)
    assert (start.source, start.model, start.version) == ("champion", NAME, "1")
    # What the champion trained on, read back from its tags: clean replays these at a share.
    assert start.batches == tuple(BATCHES)
    assert init_from.recorded(params) == start
    assert init_from.model_ref(params) == str(params.paths.init / "model")
    fetched = params.paths.init / "model" / "model.safetensors"
    assert fetched.read_bytes() == (project / "models/merged/model.safetensors").read_bytes()
    # The same champion again: nothing fetched, nothing rewritten (DVC sees the same out).
    before = (params.paths.init / "init.json").stat().st_mtime_ns, fetched.stat().st_mtime_ns
    assert registry.resolve_start(params, params.paths.init) == start
    after = (params.paths.init / "init.json").stat().st_mtime_ns, fetched.stat().st_mtime_ns
    assert before == after


def test_init_from_base_ignores_the_champion(project: Path, champion: str) -> None:
    params = load_params()
    from_base = params.model_copy(
        update={"train": params.train.model_copy(update={"init_from": "base"})}
    )
    start = registry.resolve_start(from_base, from_base.paths.init)
    assert start.source == "base" and start.version is None
    assert not (from_base.paths.init / "model").exists()
    assert init_from.model_ref(from_base) == str(from_base.paths.base_model)
    # No champion yet (first month): the base, and the record says why.
    store = client(project)
    store.delete_registered_model_alias(NAME, registry.CHAMPION)
    try:
        first = registry.resolve_start(params, params.paths.init)
        assert first.source == "base" and "no 'champion' alias yet" in first.reason
    finally:
        store.set_registered_model_alias(NAME, registry.CHAMPION, "1")


def test_a_candidate_without_clean_metrics_is_not_registered(project: Path) -> None:
    params = load_params()
    path = params.paths.metrics / "clean.json"
    kept = path.read_bytes()
    path.write_text(json.dumps({"train": 1}))  # from before clean named its batches
    try:
        with pytest.raises(registry.StaleDecision, match=r"clean\.json is not a CleanMetrics"):
            registry.data_tags(params)
    finally:
        path.write_bytes(kept)


def test_a_champion_that_moved_after_the_gate_blocks_registration(
    project: Path, champion: str
) -> None:
    # decision.json compared with no champion; the registry has one now.
    with pytest.raises(registry.ChampionChanged, match=r"dvc repro --force --single-item evaluate"):
        registry.register_candidate(load_params())


def test_a_decision_about_another_candidate_blocks_registration(project: Path) -> None:
    params = load_params()
    decision = json.loads((params.paths.metrics / "decision.json").read_text())
    write_json(params.paths.metrics / "decision.json", decision | {"candidate_key": "other"})
    try:
        with pytest.raises(registry.StaleDecision, match=r"judged another candidate"):
            registry.register_candidate(params)
    finally:
        write_json(params.paths.metrics / "decision.json", decision)


def test_a_candidate_worse_than_the_champion_is_not_registered(
    project: Path, champion: str
) -> None:
    params = load_params()
    (params.paths.merged / "manifest.json").write_text('{"stage": "merge", "run": 2}')
    write_evaluation(params, planted(0.60, champion=0.75), champion="1")
    decision = json.loads((params.paths.metrics / "decision.json").read_text())
    assert decision["verdict"] == "fail" and not decision["passed"]
    [failed] = decision["failed"]
    assert failed.startswith(
        "support_demo/accuracy (higher is better): candidate 0.600 vs champion 0.750: "
        "better by -0.150 ["
    )
    assert failed.endswith("allowed down to -0.020: FAIL")

    done = registry.register_candidate(params)
    assert not done.registered and done.version is None and done.alias is None
    assert done.reasons == ["gate fail: nothing registered", *decision["failed"]]
    store = client(project)
    assert len(store.search_model_versions(f"name = '{NAME}'")) == 1
    assert str(store.get_model_version_by_alias(NAME, "challenger").version) == "1"


def test_the_base_is_registered_as_the_first_champion_once(project: Path, tmp_path: Path) -> None:
    params = load_params()
    store = client(project)
    # A champion exists (v1): nothing is registered.
    kept = registry.register_base(params)
    assert not kept.registered and kept.version == "1"
    before = len(store.search_model_versions(f"name = '{NAME}'"))
    store.delete_registered_model_alias(NAME, registry.CHAMPION)
    done = registry.register_base(params)
    assert done.registered and done.alias == registry.CHAMPION
    assert len(store.search_model_versions(f"name = '{NAME}'")) == before + 1
    champion = store.get_model_version_by_alias(NAME, registry.CHAMPION)
    assert str(champion.version) == done.version
    assert champion.tags[registry.TAG_BASE] == params.model.base
    assert registry.champion_batches(champion) == ()  # the base trained on no pool batch
    served = registry.download_folder(champion, registry.MERGED, tmp_path)
    assert (served / "model.safetensors").read_bytes() == (
        params.paths.base_model / "model.safetensors"
    ).read_bytes()
    assert not registry.register_base(params).registered


def test_an_inconclusive_gate_registers_nothing(project: Path) -> None:
    params = load_params()
    # 0.74 against 0.75 on 100 items: can't tell whether it fell more than 0.02 behind.
    items = planted(0.75, champion=0.75)
    for name in ("candidate", "candidate-fp8"):
        values = items[name][SUITE].values["accuracy"]
        values[[5, 7, 9, 11, 13]] = 0.0  # lose five of the champion's items
        values[[80, 81, 82, 83]] = 1.0  # and win four others
    write_evaluation(params, items, champion="1")
    decision = json.loads((params.paths.metrics / "decision.json").read_text())
    assert decision["verdict"] == "inconclusive" and not decision["passed"]
    done = registry.register_candidate(params)
    assert not done.registered
    assert done.reasons == ["gate inconclusive: nothing registered", *decision["inconclusive"]]
    assert "more items would settle it" in done.reasons[1]


def test_a_decision_without_a_verdict_is_stale(project: Path) -> None:
    params = load_params()
    decision = json.loads((params.paths.metrics / "decision.json").read_text())
    old = {k: v for k, v in decision.items() if k != "verdict"} | {"passed": True}
    write_json(params.paths.metrics / "decision.json", old)
    try:
        stale = r"decision\.json is not a Decision"
        with pytest.raises(registry.StaleDecision, match=stale) as error:
            registry.register_candidate(params)
        assert "verdict" in str(error.value) and "dvc repro evaluate" in str(error.value)
    finally:
        write_json(params.paths.metrics / "decision.json", decision)


def test_a_lora_candidate_is_registered_with_its_adapter_and_its_base(
    project: Path, tmp_path: Path
) -> None:
    """The adapter (kB here, MBs for a real model) beside the merged folder, with the base it
    was trained on as tags; ``serve.fetch_adapter`` downloads it back to load onto vLLM."""
    from tests.vllm_helpers import save_adapter
    from tuneloop.release import serve

    params = load_params()
    store = client(project)
    champion = str(store.get_model_version_by_alias(NAME, registry.CHAMPION).version)
    save_adapter(params.paths.base_model, params.paths.adapter)
    (params.paths.merged / "manifest.json").write_text('{"stage": "merge", "run": 3}')
    write_evaluation(params, planted(0.80, champion=0.75), champion=champion)
    done = registry.register_candidate(params)
    assert done.created and done.alias == registry.CHALLENGER
    version = store.get_model_version(NAME, str(done.version))
    # Trained from the base (init_from: base), not from a champion: the base's name and revision.
    assert registry.adapter_base(version) == registry.base_identity(params)
    assert registry.trained_on(params) == registry.base_identity(params)
    assert version.tags[registry.TAG_ADAPTER_BASE] == "builtin:tiny"
    number, adapter = serve.fetch_adapter(NAME, registry.CHALLENGER, tmp_path / "serve")
    assert adapter is not None and number == done.version
    assert adapter.base == registry.base_identity(params)
    assert (adapter.folder / "adapter_config.json").is_file()
    size = sum(p.stat().st_size for p in adapter.folder.iterdir())
    merged = sum(p.stat().st_size for p in params.paths.merged.iterdir())
    assert size < merged / 10  # 36 kB against 2.8 MB on the tiny model
    # A version without an adapter (the registered base) has none to load.
    assert registry.adapter_base(store.get_model_version(NAME, champion)) is None


def unsettled(line: str, blocking: bool) -> UnsettledRule:
    return UnsettledRule(
        rule="forgetting",
        suite="general_demo",
        metric="accuracy",
        slice=None,
        more_items=40,
        blocking=blocking,
        reason=line,
        line=line,
    )


def test_rules_let_through_unsettled_become_the_versions_tags() -> None:
    line = "forgetting general_demo/accuracy: inconclusive, about 40 more items"
    decision = a_decision().model_copy(
        update={
            "on_inconclusive": "warn",
            "unsettled": [unsettled(line, False), unsettled("blocks", True)],
        }
    )
    assert registry.unsettled_tags(decision) == {
        registry.TAG_ON_INCONCLUSIVE: "warn",
        registry.TAG_UNSETTLED: line,
    }
    lines = [unsettled(f"{i:03d} " + "x" * 96, False) for i in range(80)]
    many = a_decision().model_copy(update={"unsettled": lines})
    tags = registry.unsettled_tags(many)
    assert tags[registry.TAG_ON_INCONCLUSIVE] == "block"
    kept = tags[registry.TAG_UNSETTLED].splitlines()
    assert len(tags[registry.TAG_UNSETTLED]) <= registry.MAX_TAG
    assert kept[-1] == f"... and {80 - len(kept) + 1} more in metrics/decision.json"
