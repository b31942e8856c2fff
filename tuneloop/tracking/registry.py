"""The MLflow model registry: the champion the gate compares with, and registering a candidate.

The project's registered model (``tracking.registered_model``) holds one version
per candidate that passed the evaluate gate. Each version is a logged pyfunc
model whose artifacts are the merged folder (what ``mlflow.pyfunc.load_model``
serves) and the FP8 folder (what vLLM serves), and for a LoRA candidate its adapter
folder too (MBs: what vLLM loads onto a running base, tagged with that base's name and
revision); its tags carry the lineage (git
commit, params hash, DVC md5s, Prefect flow run), its description the eval
report, and both folders the model card as their ``README.md``. Aliases live here
only: ``challenger`` is set when a candidate is registered; ``champion`` and
``previous-champion`` move in :func:`promote`, which the release flow calls when a
release reaches 100 % and passes.

Registration runs in the retrain flow after the ``evaluate`` stage, not inside
it: a DVC stage must be a function of its declared inputs, and writing to the
registry is a side effect DVC cannot see or undo. Inside the stage, a cached
``dvc repro`` would skip it, and a rerun would register a second version of
the same model. The flow task reads the stage's ``decision.json`` and is
idempotent (a version is keyed by its merged folder's manifest), so it may
retry.

The other registry read, the champion, does happen inside ``evaluate``: the
gate must score it. DVC cannot see an alias move, so the decision records the
champion version it compared with (and which merged folder it judged), and
:func:`register_candidate` refuses to register when either has changed since
(rerun ``dvc repro --force --single-item evaluate@<task>``).

Logging a version copies both folders into the MLflow artifact store: for a
real model that is the merged checkpoint plus its FP8 export, once per version.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import shutil
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import Any

import mlflow
from mlflow.entities import Run
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException
from mlflow.models import Model
from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST, ErrorCode
from mlflow.pyfunc import PythonModel, PythonModelContext
from mlflow.tracking import MlflowClient
from pydantic import BaseModel, ConfigDict

from tuneloop.data.metrics import CleanMetrics
from tuneloop.io import ModelFileError, atomic_dir, read_model, write_json
from tuneloop.judge import cards
from tuneloop.judge.decision import Champion, Decision
from tuneloop.judge.verdict import PASS
from tuneloop.params import Params
from tuneloop.params.groups import ExportFormat
from tuneloop.quantization import folder_of
from tuneloop.tracking import init_from, lineage, runs

log = logging.getLogger(__name__)

CHAMPION, CHALLENGER, PREVIOUS = "champion", "challenger", "previous-champion"
MERGED, FP8 = "merged", "fp8"  # artifact names inside every logged model
# Each export format is an artifact named as the format (``export.formats``); the version's
# tag lists those it holds, so a release picks one its serving hosts run (``tuneloop serve
# --format``). A format the gate refused (an FP4 past ``gate.fp4_max_drop``) is left out.
TAG_FORMATS = "tuneloop.export_formats"
# A LoRA candidate's adapter folder (MBs), logged beside the merged one: what vLLM loads onto a
# running base (``tuneloop.release.serve.load_version``). The base it was trained on is tagged.
ADAPTER = "adapter"
TAG_ADAPTER_BASE, TAG_ADAPTER_REVISION = "tuneloop.adapter.base", "tuneloop.adapter.base_revision"
MODEL_NAME = "candidate"  # the logged model's name in its run
TAG_CANDIDATE = "tuneloop.merged_manifest_sha256"
TAG_GATE = "gate.passed"
# What a person must acknowledge before approving (gate.on_inconclusive: warn): one line per
# rule the gate could not settle, as the approval form and `tuneloop status` show them.
TAG_ON_INCONCLUSIVE, TAG_UNSETTLED = "gate.on_inconclusive", "gate.unsettled"
REVIEW_ITEMS = "review-items.jsonl"  # in paths.metrics, and in the run's evaluation/
MAX_TAG = 5000  # characters MLflow keeps in a tag's value
# The registry stores descriptions in a 5000-character column.
MAX_DESCRIPTION = 5000
# What loading a version back needs (besides this package, whose class it pickles).
REQUIREMENTS = ("mlflow", "torch", "transformers", "compressed-tensors")


class StaleDecision(RuntimeError):
    """decision.json no longer describes what would be registered; evaluate again."""


class ChampionChanged(StaleDecision):
    """The champion moved after the gate compared the candidate with the old one."""


# --- reading ----------------------------------------------------------------------------------


def find_alias(name: str, alias: str, client: MlflowClient | None = None) -> ModelVersion | None:
    """The version of registered model ``name`` that holds ``alias``; None if there is none."""
    client = client or MlflowClient()
    try:
        registered = client.get_registered_model(name)
    except MlflowException as error:
        if error.error_code == ErrorCode.Name(RESOURCE_DOES_NOT_EXIST):
            return None
        raise
    version = registered.aliases.get(alias)
    return None if version is None else client.get_model_version(name, str(version))


def describe(version: ModelVersion | None) -> Champion | None:
    """A version's identity as decision.json records it."""
    if version is None:
        return None
    return Champion(
        name=version.name,
        version=str(version.version),
        run_id=version.run_id or "",
        source=version.source or "",
    )


def download_folder(version: ModelVersion, artifact: str, dst: Path) -> Path:
    """Download a version's logged model into ``dst`` and return its ``artifact`` folder."""
    local = Path(
        mlflow.artifacts.download_artifacts(
            artifact_uri=f"models:/{version.name}/{version.version}", dst_path=str(dst)
        )
    )
    artifacts = Model.load(str(local)).flavors["python_function"].get("artifacts", {})
    if artifact not in artifacts:
        raise KeyError(
            f"{version.name} v{version.version} has no {artifact!r} artifact (it has "
            f"{sorted(artifacts)}); it was not registered by tuneloop.tracking.registry"
        )
    return local / artifacts[artifact]["path"]


def base_identity(params: Params) -> tuple[str, str]:
    """The base model's name (``model.base``) and revision, as lineage records them.

    What an adapter version is tagged with, and what a server of the base records
    (``tuneloop serve base``): an adapter is loaded only onto the base it was trained on.
    """
    outs = {
        path: md5 for md5s in lineage.dvc_lock_md5s().values() for path, md5 in md5s["outs"].items()
    }
    return params.model.base, lineage.base_model_revision(params, outs) or "unknown"


def trained_on(params: Params) -> tuple[str, str]:
    """The base the candidate's adapter was trained on: ``model.base`` (:func:`base_identity`),
    or the champion version training continued from (``init_from``), named with its run."""
    start = init_from.recorded(params)
    if start.source == "champion":
        return f"{start.model} v{start.version}", f"run {start.run_id}"
    return base_identity(params)


def adapter_base(version: ModelVersion) -> tuple[str, str] | None:
    """(base name, revision) an adapter version was trained on; None for a version without one."""
    base = version.tags.get(TAG_ADAPTER_BASE)
    if base is None:
        return None
    return base, version.tags.get(TAG_ADAPTER_REVISION, "unknown")


def registered_base(version: ModelVersion) -> tuple[str, str] | None:
    """(base name, revision) of a version that is the base model itself (:func:`register_base`),
    None for any other. A base registered before its revision was tagged reads ``unknown``."""
    base = version.tags.get(TAG_BASE)
    if base is None:
        return None
    return base, version.tags.get(runs.TAG_BASE_REVISION, "unknown")


def champion_batches(version: ModelVersion) -> tuple[str, ...]:
    """The pool batches a registered version trained on (``init_from.trained_batches``)."""
    return init_from.trained_batches(version.tags, f"{version.name} v{version.version}")


def as_champion(version: ModelVersion) -> init_from.Champion:
    return init_from.Champion(str(version.version), version.run_id, champion_batches(version))


def serving_champion(name: str, client: MlflowClient | None = None) -> init_from.Champion | None:
    """Registered model ``name``'s champion, through MLflow; None: no such alias yet."""
    found = find_alias(name, CHAMPION, client)
    return None if found is None else as_champion(found)


def resolve_start(params: Params, folder: Path) -> init_from.Start:
    """Fill ``folder`` (``paths.init``) with the starting point ``train.init_from`` asks for
    (see ``tuneloop/tracking/init_from.py``).

    A champion already fetched into ``folder`` is not downloaded again.
    """
    champion = None
    if params.train.init_from == "champion":
        champion = find_alias(params.tracking.registered_model, CHAMPION)
    start = init_from.start_for(params, None if champion is None else as_champion(champion))
    if champion is None or start.source == "base":
        if params.train.init_from == "champion":
            log.warning("init: %s", start.reason)
        init_from.write_base(folder, start)
        return start
    if init_from.read(folder) == start and (folder / init_from.MODEL_DIR).is_dir():
        log.info("init: %s already in %s", start.describe(), folder)
        return start
    with atomic_dir(folder) as tmp:
        fetched = download_folder(champion, MERGED, tmp / "download")
        fetched.rename(tmp / init_from.MODEL_DIR)
        shutil.rmtree(tmp / "download")
        write_json(tmp / init_from.INIT_FILE, asdict(start))
    log.info("init: fetched %s into %s", start.describe(), folder / init_from.MODEL_DIR)
    return start


# --- the logged model -------------------------------------------------------------------------


class CandidateModel(PythonModel):
    """The merged model as a pyfunc: chat questions in, greedy answers out.

    The FP8 folder travels beside it as an artifact for vLLM; this wrapper
    serves the merged one, which any CPU can run.
    """

    max_new_tokens = 64

    def load_context(self, context: PythonModelContext) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        folder = context.artifacts[MERGED]
        self.tokenizer: Any = AutoTokenizer.from_pretrained(folder)
        self.model: Any = AutoModelForCausalLM.from_pretrained(folder)
        self.model.eval()

    def predict(
        self,
        context: PythonModelContext,
        model_input: list[str],
        params: dict[str, Any] | None = None,
    ) -> list[str]:
        import torch

        answers = []
        for question in model_input:
            batch: Any = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": question}],
                add_generation_prompt=True,
                return_tensors="pt",
                return_dict=True,
            )
            with torch.no_grad():
                out = self.model.generate(
                    **batch,
                    max_new_tokens=self.max_new_tokens,
                    do_sample=False,
                    pad_token_id=self.tokenizer.pad_token_id,
                )
            new = out[0, batch["input_ids"].shape[1] :]
            answers.append(str(self.tokenizer.decode(new, skip_special_tokens=True)).strip())
        return answers


def _requirements() -> list[str]:
    return [f"{name}=={importlib.metadata.version(name)}" for name in REQUIREMENTS]


# --- registering ------------------------------------------------------------------------------


class Registration(BaseModel):
    """What the retrain flow's register step did, and why."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    registered: bool
    name: str
    version: str | None = None
    alias: str | None = None
    model_uri: str | None = None
    run_id: str | None = None
    reasons: list[str] = []
    # This call made the version; False when it found the candidate registered already, so
    # a rerun of the flow does not announce (and release) the same version twice.
    created: bool = False


def candidate_key(merged: Path) -> str:
    """Identifies a merged folder: its manifest names its inputs, code and time of making."""
    return hashlib.sha256((merged / "manifest.json").read_bytes()).hexdigest()


def lineage_tags(params: Params, flow_run_id: str | None) -> dict[str, str]:
    """Git commit, params hash, every DVC data/model md5, and the flow run of a candidate."""
    git = lineage.git_state()
    tags = {
        runs.TAG_COMMIT: git.commit,
        runs.TAG_DIRTY: str(git.dirty).lower(),
        # Every group: the version depends on the whole pipeline, not one stage.
        runs.TAG_PARAMS_HASH: lineage.params_hash(params, list(type(params).model_fields)),
        TAG_CANDIDATE: candidate_key(params.paths.merged),
        # Month over month: the champion this version's training continued from, and the
        # pool batches its training set drew from (clean's metrics).
        init_from.TAG: init_from.recorded(params).describe(),
        **data_tags(params),
    }
    if flow_run_id:
        tags[runs.TAG_FLOW_RUN] = flow_run_id
    for md5s in lineage.dvc_lock_md5s().values():
        for path, md5 in md5s["outs"].items():
            tags[f"dvc.out.{path}"] = md5
        # Data deps only; code is pinned by the commit.
        for path, md5 in md5s["deps"].items():
            if not path.endswith(".py"):
                tags[f"dvc.dep.{path}"] = md5
    return tags


def data_tags(params: Params) -> dict[str, str]:
    """The pool batches the candidate's training data came from, and the replay share.

    From ``metrics/clean.json``, which the training set and this candidate came from: every
    batch of the pool at clean time (in full, or at the replay share for the batches the
    start had trained on), oldest first. Next month's ``init`` reads it back from the
    champion (``champion_batches``) to know which batches to replay.
    """
    path = params.paths.metrics / "clean.json"
    if not path.exists():
        raise StaleDecision(f"{path} missing: run `dvc repro` (clean) before registering")
    try:
        clean = read_model(path, CleanMetrics)
    except ModelFileError as error:  # an older clean wrote it
        raise StaleDecision(str(error)) from None
    return {
        init_from.TAG_BATCHES: ",".join(clean.batches),
        init_from.TAG_NEW_BATCHES: ",".join(clean.replay.new_batches),
        init_from.TAG_REPLAY: str(clean.replay.fraction),
    }


def _existing(client: MlflowClient, name: str, key: str) -> ModelVersion | None:
    try:
        versions = client.search_model_versions(f"name = '{name}'")
    except MlflowException as error:
        if error.error_code == ErrorCode.Name(RESOURCE_DOES_NOT_EXIST):
            return None
        raise
    return next((v for v in versions if v.tags.get(TAG_CANDIDATE) == key), None)


def _run(run_id: str | None, experiment_id: str) -> AbstractContextManager[Run]:
    """The run the model and report are logged to: the flow's retrain run, or a new one."""
    active = mlflow.active_run()
    if active is not None and run_id in (None, active.info.run_id):
        return nullcontext(active)
    if run_id is not None:
        return mlflow.start_run(run_id=run_id, nested=active is not None)
    return mlflow.start_run(
        run_name="register", experiment_id=experiment_id, nested=active is not None
    )


def read_decision(params: Params) -> Decision:
    """The evaluate stage's ``decision.json``; ``StaleDecision`` when it does not parse."""
    try:
        return Decision.read(params.paths.metrics / "decision.json")
    except ModelFileError as error:
        raise StaleDecision(f"{error}; run `dvc repro evaluate` before registering") from None


def register_candidate(
    params: Params, run_id: str | None = None, flow_run_id: str | None = None
) -> Registration:
    """Register the evaluated candidate when its gate passed; otherwise register nothing.

    Reads ``metrics/decision.json`` (and the report beside it) as the
    ``evaluate`` stage left them. On a pass: logs a pyfunc model with the merged
    and FP8 folders into ``run_id`` (the flow's retrain run; a new ``register``
    run without one), registers it as a new version of
    ``tracking.registered_model`` with the lineage tags and the report, and
    points alias ``challenger`` at it. The same candidate is registered once.
    """
    name = params.tracking.registered_model
    decision = read_decision(params)
    verdict = decision.verdict
    # Only a pass registers: an inconclusive gate blocks as a failed one does.
    if verdict != PASS or not decision.passed:
        blocking = decision.failed + decision.inconclusive
        log.warning("gate %s; nothing registered: %s", verdict, "; ".join(blocking))
        return Registration(
            registered=False, name=name, reasons=[f"gate {verdict}: nothing registered", *blocking]
        )

    key, evaluate = candidate_key(params.paths.merged), lineage.dvc_stage("evaluate", params)
    if decision.candidate_key != key:
        raise StaleDecision(
            f"{params.paths.metrics / 'decision.json'} judged another candidate than the one in "
            f"{params.paths.merged}; run `dvc repro {evaluate}` before registering"
        )

    experiment_id = runs.setup(params.tracking.experiment)
    client = MlflowClient()
    champion = describe(find_alias(name, CHAMPION, client))
    compared = None if decision.champion is None else decision.champion.version
    serving = None if champion is None else champion.version
    if serving != compared:
        raise ChampionChanged(
            f"the gate compared the candidate with champion "
            f"{compared or 'none'}, but {name}@{CHAMPION} is now "
            f"{serving or 'none'}; run `dvc repro --force --single-item {evaluate}` so the "
            "gate compares with the model that serves now, then register"
        )

    found = _existing(client, name, key)
    if found is not None:
        version = str(found.version)
        alias = _point_challenger(client, name, version, champion)
        log.info("%s v%s already holds this candidate", name, version)
        return Registration(
            registered=True,
            name=name,
            version=version,
            alias=alias,
            model_uri=f"models:/{name}/{version}",
            run_id=found.run_id,
            reasons=[f"already registered as {name} v{version}", *decision.reasons],
        )

    tags = lineage_tags(params, flow_run_id or os.environ.get("TUNELOOP_FLOW_RUN_ID"))
    tags[TAG_GATE] = "true"
    tags |= unsettled_tags(decision)
    report = params.paths.reports / "eval.md"
    card = params.paths.reports / "model-card.md"
    evaluation = [
        report,
        params.paths.reports / "eval.png",
        card,
        params.paths.reports / "dataset-card.md",
        params.paths.metrics / "decision.json",
        params.paths.metrics / "evaluate.json",
    ]
    # The blind review's items (both answers per business item), from an evaluate that wrote
    # them: the release creates its review from this artifact (tuneloop.release.signoff).
    review_items = params.paths.metrics / REVIEW_ITEMS
    if missing := [str(path) for path in evaluation if not path.exists()]:
        raise StaleDecision(f"{missing} missing; run `dvc repro evaluate` before registering")
    formats = registered_formats(params, decision)
    tags[TAG_FORMATS] = ",".join(formats)
    folders = {MERGED: params.paths.merged} | {fmt: folder_of(params, fmt) for fmt in formats}
    artifacts: dict[str, str] = {}
    # A LoRA candidate keeps its adapter too (MBs beside the merged GBs), tagged with its base.
    if (params.paths.adapter / "adapter_config.json").is_file():
        artifacts[ADAPTER] = str(params.paths.adapter)
        tags[TAG_ADAPTER_BASE], tags[TAG_ADAPTER_REVISION] = trained_on(params)
    # The model card travels inside every exported folder as its README.md.
    with _run(run_id, experiment_id) as run, cards.with_card(folders, card) as carded:
        artifacts |= {name: str(folder) for name, folder in carded.items()}
        info = mlflow.pyfunc.log_model(
            name=MODEL_NAME,
            python_model=CandidateModel(),
            artifacts=artifacts,
            pip_requirements=_requirements(),
            tags=tags,
        )
        for path in evaluation + ([review_items] if review_items.is_file() else []):
            mlflow.log_artifact(str(path), artifact_path="evaluation")
        registered = mlflow.register_model(info.model_uri, name, tags=tags)
        version = str(registered.version)
        client.update_model_version(
            name, version, description=report.read_text(encoding="utf-8")[:MAX_DESCRIPTION]
        )
        alias = _point_challenger(client, name, version, champion)
        mlflow.set_tags({"registry.version": version, "registry.name": name})
        log.info("registered %s v%s as %s (%s)", name, version, alias, info.model_uri)
        return Registration(
            registered=True,
            name=name,
            version=version,
            alias=alias,
            model_uri=f"models:/{name}/{version}",
            run_id=run.info.run_id,
            reasons=[
                f"gate passed: registered {name} v{version} as {CHALLENGER}",
                *decision.reasons,
            ],
            created=True,
        )


def registered_formats(params: Params, decision: Decision) -> list[ExportFormat]:
    """The formats of ``export.formats`` a version holds: every one the gate did not refuse."""
    kept: list[ExportFormat] = []
    refused: list[ExportFormat] = []
    for fmt in params.export.formats:
        (refused if decision.refused(fmt) else kept).append(fmt)
    if refused:
        log.warning("not registering %s: the gate refused them", refused)
    return kept


def formats_of(version: ModelVersion) -> tuple[str, ...]:
    """The export formats a registered version holds (none for the registered base)."""
    text = (version.tags or {}).get(TAG_FORMATS)
    if text is None:  # registered before formats were tagged: FP8 was the only export
        return () if TAG_BASE in (version.tags or {}) else (FP8,)
    return tuple(f for f in text.split(",") if f)


def unsettled_tags(decision: Decision) -> dict[str, str]:
    """The version's tags for the rules its gate let through unsettled (none: no such tag)."""
    tags: dict[str, str] = {TAG_ON_INCONCLUSIVE: decision.on_inconclusive}
    lines = [entry.line for entry in decision.let_through()]
    if lines:
        kept: list[str] = []
        for number, line in enumerate(lines):
            rest = f"... and {len(lines) - number} more in metrics/decision.json"
            if sum(len(k) + 1 for k in kept) + len(line) + len(rest) + 1 > MAX_TAG:
                kept.append(rest)
                break
            kept.append(line)
        tags[TAG_UNSETTLED] = "\n".join(kept)
    return tags


def unsettled_of(version: ModelVersion) -> list[str]:
    """The unsettled rules a person must acknowledge before approving ``version``'s release."""
    text = (version.tags or {}).get(TAG_UNSETTLED, "")
    return [line for line in text.splitlines() if line.strip()]


def _point_challenger(
    client: MlflowClient, name: str, version: str, champion: Champion | None
) -> str | None:
    # The champion already serves; calling it the challenger too would canary it against itself.
    if champion is not None and champion.version == version:
        return None
    client.set_registered_model_alias(name, CHALLENGER, version)
    return CHALLENGER


# --- the first champion ----------------------------------------------------------------------


TAG_BASE = init_from.TAG_BASE_MODEL


class NoLocalBase(RuntimeError):
    """``model.base`` is a hub id: the registry logs folders, so it needs a local copy."""


def register_base(params: Params) -> Registration:
    """Register the base model as the first ``champion``, once.

    A release compares a challenger with the model that serves now; before the first release
    that is the base. Registered as an ordinary version (its merged artifact is the base
    folder; it has no FP8 export) tagged ``tuneloop.base_model``, so the release flow, ``tuneloop
    serve champion`` and the gate treat it like any champion. Does nothing when the registered
    model already has a champion.
    """
    from tuneloop.models import base_model_ref

    name = params.tracking.registered_model
    experiment_id = runs.setup(params.tracking.experiment)
    client = MlflowClient()
    current = find_alias(name, CHAMPION, client)
    if current is not None:
        return Registration(
            registered=False,
            name=name,
            version=str(current.version),
            alias=CHAMPION,
            reasons=[f"{name} already has a champion (v{current.version}); nothing registered"],
        )
    folder = Path(base_model_ref(params))
    if params.model.is_builtin and not (folder / "config.json").exists():
        raise NoLocalBase(
            f"{folder} holds no model yet: build {params.model.base} first (`dvc repro base`)"
        )
    if not (folder / "config.json").exists():
        raise NoLocalBase(
            f"model.base is {params.model.base!r}, not a local model folder: download it "
            "(`huggingface-cli download <id> --local-dir /models/<name>`), point model.base "
            "at the folder, and run this again"
        )
    git = lineage.git_state()
    tags = {
        TAG_BASE: params.model.base,
        # What a base server checks before serving this version as its own model.
        runs.TAG_BASE_REVISION: base_identity(params)[1],
        runs.TAG_COMMIT: git.commit,
        runs.TAG_DIRTY: str(git.dirty).lower(),
        init_from.TAG_BATCHES: "",  # trained on none of the pool
    }
    with mlflow.start_run(run_name="register-base", experiment_id=experiment_id) as run:
        info = mlflow.pyfunc.log_model(
            name=MODEL_NAME,
            python_model=CandidateModel(),
            artifacts={MERGED: str(folder)},
            pip_requirements=_requirements(),
            tags=tags,
        )
        registered = mlflow.register_model(info.model_uri, name, tags=tags)
        version = str(registered.version)
        client.update_model_version(
            name,
            version,
            description=f"The base model ({params.model.base}), registered as the first "
            "champion: the model a first release is compared with.",
        )
        client.set_registered_model_alias(name, CHAMPION, version)
        mlflow.set_tags({"registry.version": version, "registry.name": name})
    log.info("registered the base model as %s v%s, alias %s", name, version, CHAMPION)
    return Registration(
        registered=True,
        name=name,
        version=version,
        alias=CHAMPION,
        model_uri=f"models:/{name}/{version}",
        run_id=run.info.run_id,
        reasons=[f"registered the base model as {name} v{version} with alias {CHAMPION}"],
    )


# --- promoting --------------------------------------------------------------------------------


def promote(client: MlflowClient, name: str, candidate: str, champion: str) -> None:
    """``champion`` to the candidate; ``previous-champion`` to the old one; no ``challenger``."""
    # `previous-champion` keeps the old version one alias-move away from serving again.
    client.set_registered_model_alias(name, CHAMPION, candidate)
    client.set_registered_model_alias(name, PREVIOUS, champion)
    client.delete_registered_model_alias(name, CHALLENGER)
