"""What the evaluation and the start of training reuse is keyed on (docs/caches.md).

Each reuse here: change one thing its value depends on and it misses; change nothing and it
hits. The data path's caches are tested beside their own tests (``test_clean_cache``,
``test_pack_cache``, ``test_tokencache``, ``test_ingest``) and the resume key in
``test_train_units``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
from dataclasses import asdict
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from mlflow.entities.model_registry import ModelVersion, ModelVersionTag

from tests.gate_helpers import a_decision
from tests.helpers import ROOT
from tuneloop.io import read_model, write_json
from tuneloop.judge.decision import Champion, Decision
from tuneloop.judge.fixed_badcases import ITEMS_FOLDER_ENV, FixedBadcasesMetrics
from tuneloop.judge.gate import GateError
from tuneloop.params import Params, parse_params
from tuneloop.release import signoff
from tuneloop.review.store import ReviewItem, ReviewStore, create_review
from tuneloop.tracking import init_from

# The fast tier: no pipeline, server or rank.
pytestmark = pytest.mark.fast


def project_params(root: Path, **groups: dict[str, Any]) -> Params:
    """The shipped params.yaml with its folders in ``root`` and ``groups`` merged in."""
    data = yaml.safe_load((ROOT / "params.yaml").read_text(encoding="utf-8"))
    for key in ("init", "metrics", "fixed_badcases", "pool"):
        data["paths"][key] = str(root / key)
    for group, values in groups.items():
        data[group].update(values)
    return parse_params(data)


# --- init: the stage ends without a run when what it would write is written -------------------

CHAMPION = init_from.Champion("3", "run-a", ("b1", "b2"))
# (what changes, whether the stage's record is stale: it must run again)
INIT_CHANGES = [
    ("nothing", False),
    ("the champion's version", True),
    ("the champion's run", True),  # the same number in another registry
    ("the champion's pool batches", True),
    ("no champion any more", True),
    ("train.init_from", True),
    ("tracking.registered_model", True),
    ("the champion's weights gone from paths.init", True),
]


@pytest.mark.parametrize(("change", "stale"), INIT_CHANGES, ids=[c for c, _ in INIT_CHANGES])
def test_init_reruns_when_anything_it_writes_would_differ(
    tmp_path: Path, change: str, stale: bool
) -> None:
    params = project_params(tmp_path, train={"init_from": "champion"})
    start = init_from.start_for(params, CHAMPION)
    (params.paths.init / init_from.MODEL_DIR).mkdir(parents=True)
    write_json(params.paths.init / init_from.INIT_FILE, asdict(start))
    # Through the file, as the stage reads it back (tuples come back from JSON lists).
    path = tmp_path / "init-metrics.json"
    write_json(path, init_from.stage_metrics(start, CHAMPION).model_dump())
    metrics = read_model(path, init_from.InitMetrics)
    assert init_from.already_recorded(params, CHAMPION, metrics)
    serving: init_from.Champion | None = CHAMPION
    if change == "the champion's version":
        serving = init_from.Champion("4", "run-a", CHAMPION.batches)
    elif change == "the champion's run":
        serving = init_from.Champion("3", "run-b", CHAMPION.batches)
    elif change == "the champion's pool batches":
        serving = init_from.Champion("3", "run-a", ("b1",))
    elif change == "no champion any more":
        serving = None
    elif change == "train.init_from":
        params = project_params(tmp_path, train={"init_from": "base"})
    elif change == "tracking.registered_model":
        params = project_params(tmp_path, train={"init_from": "champion"}, tracking={})
        data = params.model_dump(mode="json")
        data["tracking"]["registered_model"] = "another-model"
        params = parse_params(data)
    elif change == "the champion's weights gone from paths.init":
        (params.paths.init / init_from.MODEL_DIR).rmdir()
    else:
        assert change == "nothing", change
    assert init_from.already_recorded(params, serving, metrics) is not stale


# --- the fixed-badcase suite: scored only against the champion it was built for ---------------


def test_evaluate_uses_the_suite_only_for_its_champion(tmp_path: Path) -> None:
    from tuneloop.judge.evaluation import fixed_suite

    params = project_params(tmp_path)
    params.paths.metrics.mkdir()
    built = FixedBadcasesMetrics(
        items=2,
        champion_version="3",
        champion_batches=("b1",),
        items_by_batch={"b1": 2},
        items_by_source={"router-feedback": 2},
        left_out={},
    )
    write_json(params.paths.metrics / "fixed_badcases.json", built.model_dump())

    def champion(version: str) -> Champion:
        return Champion(name="tuneloop", version=version, run_id="", source="")

    assert fixed_suite(params, champion("3")) == params.paths.fixed_badcases.name
    for other in (champion("4"), None):
        with pytest.raises(GateError, match="was built for champion 3"):
            fixed_suite(params, other)


# --- the champion that is the base: scored once, as the base -------------------------------


@pytest.mark.parametrize(
    ("change", "reused"),
    [
        ("nothing", True),
        ("the base rebuilt since", False),  # another md5 of models/base in dvc.lock
        ("a trained champion", False),  # no base tag: a candidate registered by the gate
        ("a fixed-badcase suite", False),  # the champion is scored on it, the base is not
        ("no champion", False),
        ("an unknown revision", False),
    ],
)
def test_the_base_registered_as_champion_is_scored_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: str, reused: bool
) -> None:
    from tuneloop.judge.evaluation import champion_is_base
    from tuneloop.tracking import registry, runs

    monkeypatch.chdir(tmp_path)
    params = parse_params(yaml.safe_load((ROOT / "params.yaml").read_text(encoding="utf-8")))
    built = "0" * 32 if change != "the base rebuilt since" else "1" * 32
    lock = {"stages": {"base": {"outs": [{"path": "models/base", "md5": built + ".dir"}]}}}
    (tmp_path / "dvc.lock").write_text(yaml.safe_dump(lock))
    tags = {registry.TAG_BASE: params.model.base, runs.TAG_BASE_REVISION: "0" * 32 + ".dir"}
    if change == "a trained champion":
        tags = {}
    elif change == "an unknown revision":
        tags[runs.TAG_BASE_REVISION] = "unknown"
    listed = [ModelVersionTag(key, value) for key, value in tags.items()]
    version = ModelVersion("tuneloop-support", "1", creation_timestamp=0, tags=listed)
    champion = None if change == "no champion" else version
    fixed = "fixed_badcases" if change == "a fixed-badcase suite" else None
    assert registry.base_identity(params)[1] == built + ".dir"
    assert champion_is_base(params, champion, fixed) is reused


def test_the_suites_dvc_key_holds_what_it_is_built_from() -> None:
    """DVC reruns the stage (its out is the suite's cache) when the pool (a task's records),
    the champion and its batches (``metrics/init.json``) or the code change."""
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text(encoding="utf-8"))["stages"]
    each = stages["fixed_badcases"]["do"]
    assert {
        "${paths.pool}/records/${key}",
        "${item.folder}/${paths.metrics}/init.json",
    } <= set(each["deps"])
    assert "tasks.${key}" in each["params"]
    assert {"tuneloop/judge/fixed_badcases.py", "tuneloop/data/records.py"} <= set(each["deps"])


# --- the suites' items: read from the file's bytes every time -----------------------------------

SUITES = ("fixed_badcases", "general_demo", "orders_demo", "support_demo")


def suite_loader(folder: Path, suite: str) -> ModuleType:
    """A suite's ``utils.py`` imported from a copy of the suite in ``folder``."""
    shutil.copytree(ROOT / "eval" / suite, folder)
    spec = importlib.util.spec_from_file_location(f"{suite}_utils_copy", folder / "utils.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("suite", SUITES)
def test_a_suite_loads_its_items_bytes_even_under_a_kept_mtime(
    tmp_path: Path, suite: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """datasets' JSON loader kept a local file's items by path and mtime: other items copied
    in with the old mtime (cp -p, a restore) were scored as the old ones."""
    utils = suite_loader(tmp_path / suite, suite)
    items = tmp_path / suite / "test.jsonl"
    if suite == "fixed_badcases":  # written by its stage, where the evaluate stage says
        monkeypatch.setenv(ITEMS_FOLDER_ENV, str(items.parent))
        rows = [{"id": f"{i:016x}", "question": f"q{i}?", "answer": f"a{i}"} for i in range(6)]
        items.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    lines = items.read_text(encoding="utf-8").splitlines(keepends=True)[:6]
    items.write_text("".join(lines), encoding="utf-8")
    before = items.stat()
    first = utils.load()["test"]
    assert first.to_list() == [json.loads(line) for line in lines]
    items.write_text("".join(reversed(lines)), encoding="utf-8")  # the same size
    os.utime(items, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert utils.load()["test"].to_list() == [json.loads(line) for line in reversed(lines)]


# --- the blind review: found by the candidate, reused only for the pair it shows ---------------


def version(number: str, model: str = "tuneloop") -> ModelVersion:
    return ModelVersion(model, number, creation_timestamp=0, run_id=f"run-{number}")


# (the review in the store: its champion and candidate labels; reused for v5 against v4?)
REVIEWS = [
    ("as the release makes it", "tuneloop v4", "tuneloop v5", True),
    ("against another champion", "tuneloop v3", "tuneloop v5", False),
    ("of another candidate", "tuneloop v4", "tuneloop v6", False),
    ("labelled by hand", "the model serving today", "the new one", True),
]


@pytest.mark.parametrize(
    ("made", "champion", "candidate", "reused"), REVIEWS, ids=[r[0] for r in REVIEWS]
)
def test_a_review_is_reused_only_for_the_pair_it_shows(
    tmp_path: Path, made: str, champion: str, candidate: str, reused: bool
) -> None:
    store = ReviewStore(f"sqlite:///{tmp_path / 'review.db'}")
    try:
        assert signoff.existing_review(store, version("5"), version("4")) is None
        name = signoff.review_name("tuneloop", "5")
        item = ReviewItem("q?", "old answer", "new answer")
        create_review(store, name, [item], champion=champion, candidate=candidate)
        if reused:
            assert signoff.existing_review(store, version("5"), version("4")) == name
        else:
            with pytest.raises(signoff.ReviewUnavailable, match="another pair"):
                signoff.existing_review(store, version("5"), version("4"))
    finally:
        store.close()


def test_a_review_is_made_from_answers_beside_the_champion_that_serves() -> None:
    def evaluated_against(version_: str | None) -> Decision:
        found = (
            None
            if version_ is None
            else Champion(name="tuneloop", version=version_, run_id="", source="")
        )
        return a_decision(champion=found)

    signoff.compared_with(evaluated_against("4"), version("5"), version("4"))
    for evaluated in (evaluated_against("3"), evaluated_against(None)):
        with pytest.raises(signoff.ReviewUnavailable, match="evaluated against champion"):
            signoff.compared_with(evaluated, version("5"), version("4"))


# --- the environments: remade when what they are built with changes ---------------------------

ENVIRONMENTS = [
    ("VENV", "EXTRAS", "dev,server", "dev,server,gpu"),
    ("VENV", "TORCH", "torch==2.13.0", "torch==2.12.0"),
    ("SERVE_VENV", "SERVE_DEVICE", "cpu", "gpu"),
]


@pytest.mark.parametrize(("venv", "variable", "before", "after"), ENVIRONMENTS)
def test_an_environment_is_remade_when_its_build_changes(
    tmp_path: Path, venv: str, variable: str, before: str, after: str
) -> None:
    """Its ``.installed`` stamp depends on a key file that changes only with what it keys."""
    folder = tmp_path / "env"
    key = folder / ".key"

    def make(*args: str) -> str:
        done = subprocess.run(
            ["make", "--no-print-directory", "-C", str(ROOT), f"{venv}={folder}", *args],
            capture_output=True,
            text=True,
            check=True,
        )
        return done.stdout

    make("-s", str(key), f"{variable}={before}")
    written = key.stat().st_mtime_ns
    os.utime(key, ns=(written - 10**9, written - 10**9))  # older than now, as after a while
    make("-s", str(key), f"{variable}={before}")
    assert key.stat().st_mtime_ns == written - 10**9  # unchanged: nothing to remake
    make("-s", str(key), f"{variable}={after}")
    assert key.stat().st_mtime_ns > written - 10**9 and after in key.read_text()
    rules = make("-n", "-p", str(key)).splitlines()
    assert any(r.startswith(f"{folder}/.installed:") and r.endswith(f" {key}") for r in rules)
