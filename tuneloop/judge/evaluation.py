"""Which models the evaluate stage scores, on which engine and which suites.

The base, the champion (when there is one), the candidate and its exports. The served models
(the candidate, its exports) are scored through the engine that serves them; the references
(the base, the champion) on transformers. The champion that is the base itself is scored
once, as the base. The fixed-badcase suite is scored for the champion it was built for and
the candidate only.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from tuneloop.io import read_model
from tuneloop.judge import scoring
from tuneloop.judge.decision import Champion
from tuneloop.judge.fixed_badcases import FixedBadcasesMetrics
from tuneloop.judge.gate import BASE, CANDIDATE, CHAMPION, EXPORT_MODELS, GateError
from tuneloop.models import base_model_ref
from tuneloop.params import Params
from tuneloop.quantization import FORMATS, folder_of
from tuneloop.tracking import registry

if TYPE_CHECKING:
    from mlflow.entities.model_registry import ModelVersion

log = logging.getLogger(__name__)


def fixed_suite(params: Params, champion: Champion | None) -> str | None:
    """The fixed-badcase suite's name when it has items to score, else None.

    The suite holds the corrections the champion of its ``fixed_badcases`` run trained on;
    scored against another champion it would count fixes that model never made.
    """
    folder = params.paths.fixed_badcases
    built = read_model(params.paths.metrics / "fixed_badcases.json", FixedBadcasesMetrics)
    if not built.items:
        return None
    version = None if champion is None else champion.version
    if built.champion_version != version:
        raise GateError(
            f"{folder} was built for champion {built.champion_version}, but the champion "
            f"is {version} now; run `dvc repro` so the suite follows the champion"
        )
    return folder.name


def champion_is_base(params: Params, champion: ModelVersion | None, fixed: str | None) -> bool:
    """Whether the champion is today's base itself (``tuneloop register-base``: the same model
    and a revision that pins its weights) and is scored on the base's suites (no fixed-badcase
    suite, which the base is not scored on). Its answers are then the base's, item for item:
    the first month of a project scores that model once, not twice (on a real model, a pass
    over every suite)."""
    if champion is None or fixed is not None:
        return False
    registered = registry.registered_base(champion)
    # A local folder's revision is "local", whatever its weights are now: scored again.
    return (
        registered is not None
        and registered[1] not in ("unknown", "local")
        and registered == registry.base_identity(params)
    )


def score_models(
    params: Params,
    kind: str,
    tasks: scoring.TaskManager,
    general: list[str],
    fixed: str | None,
    champion: ModelVersion | None,
) -> dict[str, scoring.Scored]:
    """Each model's scores by its name in the gate: the base, the champion (when there is
    one), the candidate and its exports."""
    scored_by: dict[str, scoring.Scored] = {}
    same_as_base = champion_is_base(params, champion, fixed)
    # The champion's folder is fetched for this evaluation only, not kept as an output.
    with tempfile.TemporaryDirectory(prefix="tuneloop-champion-") as tmp:
        models: dict[str, str | Path] = {BASE: base_model_ref(params)}
        if champion is not None and not same_as_base:
            models[CHAMPION] = registry.download_folder(champion, registry.MERGED, Path(tmp))
        models[CANDIDATE] = params.paths.merged
        exports = {EXPORT_MODELS[fmt]: fmt for fmt in params.export.formats}
        models |= {EXPORT_MODELS[fmt]: folder_of(params, fmt) for fmt in params.export.formats}
        for name, ref in models.items():
            # The served models through the server that serves them; the references on hf;
            # an export vLLM cannot run here on transformers' decompressed path.
            engine = "hf" if name not in (CANDIDATE, *exports) else kind
            if name in exports:
                engine = scoring.export_backend(kind, FORMATS[exports[name]], params.serve.venv)
            log.info("evaluate: scoring %s (%s) with %s", name, ref, engine)
            scored_by[name] = scoring.score(
                ref,
                params,
                tasks,
                engine,
                () if name in exports else general,
                [fixed] if fixed and name in (CHAMPION, CANDIDATE) else [],
            )
            if name == BASE and same_as_base:
                log.info("evaluate: the champion is the base itself: its scores are the base's")
                scored_by[CHAMPION] = scored_by[BASE]
    return scored_by
