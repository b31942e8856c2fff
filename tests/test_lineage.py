"""Each stage's MLflow run records the data versions DVC records for that run, by any entry point.

A tiny project runs its first stages (base, ingest, clean: seconds each) under `dvc repro`,
then clean again after a param change under `dvc repro`, `dvc exp run` and `python -m
stages.clean`; after each, the newest clean run's ``dvc.dep.*``/``dvc.out.*`` tags and
dataset inputs must equal what DVC then records in dvc.lock. (Queued experiments: the sweep
in tests/test_flow.py.) Also: the base model's pinned revision, and the stage order.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from mlflow.entities import Run
from mlflow.tracking import MlflowClient

from tests.helpers import ROOT, copy_project, dvc_name, seed_demo_month, write_params
from tuneloop.params import ParamsError, parse_params
from tuneloop.pipeline import StageOrderError, stage_order
from tuneloop.tracking import lineage

# The whole suite (`make test`): dvc repro
pytestmark = pytest.mark.slow

# Enough lines that the demo's malformed ones stay under ingest.max_reject_rate.
SMALL = {"demo": {"n_support": 120, "n_badcases": 8}}


def run(repo: Path, *args: str) -> str:
    # dvc.yaml runs `python -m stages.<name>`: this environment's python must come first.
    env = os.environ | {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(args, cwd=repo, capture_output=True, text=True, env=env)
    assert done.returncode == 0, f"{args} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def dvc(repo: Path, *args: str) -> str:
    return run(repo, sys.executable, "-m", "dvc", *args)


def set_param(repo: Path, group: str, key: str, value: Any) -> None:
    path = repo / "params.yaml"
    data = yaml.safe_load(path.read_text())
    data[group][key] = value
    path.write_text(yaml.safe_dump(data, sort_keys=False))


def lock_entry(repo: Path, stage: str) -> dict[str, Any]:
    """dvc.lock's entry of the one task's ``stage``, its paths as the readers name them
    (./metrics/clean.json: metrics/clean.json)."""
    entry: dict[str, Any] = yaml.safe_load((repo / "dvc.lock").read_text())["stages"][
        dvc_name(stage)
    ]
    for kind in ("deps", "outs"):
        for item in entry.get(kind, []):
            item["path"] = os.path.normpath(item["path"])
    return entry


def latest_run(repo: Path, stage: str) -> Run:
    client = MlflowClient(f"sqlite:///{repo / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("tuneloop")
    assert experiment is not None
    found = client.search_runs(
        [experiment.experiment_id],
        filter_string=f"tags.`tuneloop.stage` = '{dvc_name(stage)}'",
        order_by=["attributes.start_time DESC"],
        max_results=1,
    )
    assert found, f"no MLflow run of {stage}"
    return found[0]


def assert_run_matches_lock(run: Run, entry: dict[str, Any]) -> None:
    """The run's DVC tags and dataset inputs are exactly the dvc.lock entry's deps and outs."""
    deps = {d["path"]: d["md5"] for d in entry["deps"]}
    outs = {o["path"]: o["md5"] for o in entry["outs"]}
    tags = {k: v for k, v in run.data.tags.items() if k.startswith(("dvc.dep.", "dvc.out."))}
    assert tags == {f"dvc.dep.{p}": m for p, m in deps.items()} | {
        f"dvc.out.{p}": m for p, m in outs.items()
    }
    datasets = {i.dataset.name: i.dataset for i in run.inputs.dataset_inputs}
    data_deps = {p: m for p, m in deps.items() if not p.endswith(".py")}
    assert {name: d.digest for name, d in datasets.items()} == data_deps
    for name, dataset in datasets.items():
        assert dataset.source_type == "dvc"
        assert json.loads(dataset.source) == {"path": name}  # no DVC remote in this project
    stage = run.data.tags["tuneloop.stage"]
    for dataset_input in run.inputs.dataset_inputs:
        assert [(t.key, t.value) for t in dataset_input.tags] == [("mlflow.data.context", stage)]


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny project whose base, ingest and clean stages ran under `dvc repro`."""
    repo = copy_project(tmp_path_factory.mktemp("lineage"))
    write_params(repo, SMALL)
    seed_demo_month(repo)
    dvc(repo, "repro", "clean")  # every task's clean: the one task's, clean@support
    return repo


def test_dvc_repro_records_each_stage_with_its_lock_entry(project: Path) -> None:
    for stage in ("base", "ingest", "clean"):
        assert_run_matches_lock(latest_run(project, stage), lock_entry(project, stage))
    clean = latest_run(project, "clean")
    # builtin:tiny's revision is the DVC md5 of the model folder clean loaded.
    base_md5 = {d["path"]: d["md5"] for d in lock_entry(project, "clean")["deps"]}["models/base"]
    assert clean.data.tags["base_model.revision"] == base_md5
    manifest = json.loads((project / "data/clean/manifest.json").read_text())
    assert manifest["base_model"] == {"base": "builtin:tiny", "revision": base_md5}
    records = "data/pool/records/support"
    pool = {d["path"]: d["md5"] for d in lock_entry(project, "clean")["deps"]}[records]
    assert manifest["inputs"]["pool"] == {"path": records, "md5": pool}


def test_a_param_change_reruns_clean_and_its_run_carries_the_new_lock(project: Path) -> None:
    before = lock_entry(project, "clean")
    set_param(project, "clean", "val_fraction", 0.3)
    ran = dvc(project, "repro", "clean")
    assert "Running stage 'clean@support'" in ran and "Running stage 'ingest'" not in ran
    after = lock_entry(project, "clean")
    # The split moved, so the out changed: tags read before the run would be stale.
    assert after["outs"] != before["outs"]
    assert_run_matches_lock(latest_run(project, "clean"), after)


def test_dvc_exp_run_records_the_experiments_lock(project: Path) -> None:
    before = lock_entry(project, "clean")
    dvc(project, "exp", "run", "clean@support", "-S", "clean.val_fraction=0.15")
    after = lock_entry(project, "clean")  # `dvc exp run` leaves its lock in the workspace
    assert after["outs"] != before["outs"]
    assert_run_matches_lock(latest_run(project, "clean"), after)


def test_a_stage_run_directly_records_what_dvc_commit_then_records(project: Path) -> None:
    before = lock_entry(project, "clean")
    set_param(project, "clean", "val_fraction", 0.4)
    run(project, sys.executable, "-m", "stages.clean")
    dvc(project, "commit", "--force", "clean")
    after = lock_entry(project, "clean")
    assert after["outs"] != before["outs"]
    assert_run_matches_lock(latest_run(project, "clean"), after)
    assert "up to date" in dvc(project, "status", "clean")


def test_outside_a_dvc_project_nothing_is_hashed(tmp_path: Path) -> None:
    assert lineage.stage_md5s("clean", tmp_path) is None


# --- the base model's revision ----------------------------------------------------------------


def shipped_params() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((ROOT / "params.yaml").read_text())
    return data


def with_model(**model: Any) -> Any:
    data = shipped_params()
    data["model"].update(model)
    return parse_params(data)


def test_an_unpinned_hub_id_is_refused_with_the_fix(in_folder: Path) -> None:
    params = with_model(base="Qwen/Qwen3-8B", revision=None)
    with pytest.raises(ParamsError, match=r"model\.revision: .*'Qwen/Qwen3-8B' is a Hugging Face"):
        params.model.pinned_revision()
    with pytest.raises(ParamsError, match="HfApi"):  # how to find the commit
        lineage.base_model_revision(params, {})


def test_a_revision_must_be_a_full_commit_and_fit_the_base(in_folder: Path) -> None:
    with pytest.raises(ParamsError, match=r"model\.revision"):
        with_model(base="Qwen/Qwen3-8B", revision="main")  # a branch moves
    with pytest.raises(ParamsError, match=r"builtin:tiny is built here"):
        with_model(revision="0" * 40)
    (in_folder / "my-model").mkdir()
    params = with_model(base="my-model", revision="0" * 40)
    with pytest.raises(ParamsError, match="is a local folder"):
        params.model.pinned_revision()
    local = with_model(base="my-model", revision=None)
    assert lineage.base_model_revision(local, {}) == "local"


def test_a_pinned_hub_id_loads_that_commit_from_the_hub_cache(
    in_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pinned commit's snapshot is what every loader gets (offline: from the cache)."""
    import huggingface_hub.constants
    from transformers import Qwen3Config

    from tuneloop.models import base_model_ref, model_limits

    commit = "0123456789abcdef0123456789abcdef01234567"
    cache = in_folder / "hub"
    snapshot = cache / "models--acme--tiny-chat" / "snapshots" / commit
    Qwen3Config(max_position_embeddings=777, vocab_size=999).save_pretrained(snapshot)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)

    params = with_model(base="acme/tiny-chat", revision=commit)
    ref = base_model_ref(params)
    assert Path(ref).resolve() == snapshot.resolve()
    assert model_limits(ref) == (777, 999)
    assert lineage.base_model_revision(params, {}) == commit
    other = with_model(base="acme/tiny-chat", revision="f" * 40)
    with pytest.raises(Exception, match="snapshot"):  # never another commit's files
        base_model_ref(other)


# --- the stage order (the shipped one: tests/test_dvc_yaml.py) ----------------------------


def test_a_stage_listed_before_its_upstream_is_refused(tmp_path: Path) -> None:
    repo = copy_project(tmp_path)
    spec = yaml.safe_load((repo / "dvc.yaml").read_text())
    stages = spec["stages"]
    spec["stages"] = {"clean": stages.pop("clean"), **stages}
    (repo / "dvc.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    with pytest.raises(StageOrderError, match=r"'clean' is listed before '(ingest|base)'"):
        stage_order(repo)
