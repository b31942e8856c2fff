"""Where training starts: the base model, or the champion released last month.

``train.init_from: champion`` makes month N+1 continue from what month N released: the
registry's ``champion`` alias is resolved and its merged folder fetched into ``paths.init``,
with ``init.json`` naming the version. A LoRA run trains a new adapter on the champion's
weights, and ``merge`` folds it into those same weights; a full fine-tune continues from them.
With no champion yet (the first month) training starts from the base, and ``init.json`` says
why. ``init_from: base`` always starts from the base (a retrain from scratch).

Fetching the champion is ``tuneloop.tracking.registry.resolve_start``; this module decides
what the start is from the champion (``start_for``) and records and reads the result, so
training and merging import no registry code. DVC cannot see an alias move, so stage
``champions`` (``always_changed`` in dvc.yaml) reads every task's alias on each ``dvc repro``
(``tuneloop.tracking.aliases``, without importing MLflow) into ``TaskChampion`` files; a
task's ``init`` depends on its own file and reruns only when its champion moved. Even then
it fetches, writes and logs a run only when the start differs from what ``paths.init``
holds; its out changes (and so ``train`` reruns) only when the champion changed.
``init.json`` holds no timestamp for that reason.

Month over month, ``init.json`` also names the pool batches the start already trained on
(the champion's ``tuneloop.data.batches`` tag; none for the base): ``clean`` replays only
``clean.replay_fraction`` of those and trains on every other batch in full.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from tuneloop.io import atomic_dir, read_json, write_json
from tuneloop.params import Params

log = logging.getLogger(__name__)

INIT_FILE = "init.json"
MODEL_DIR = "model"
# On the init and train runs and on the registered version: what training started from.
TAG = "tuneloop.init_from"
# On the registered version: the pool batch ids its training data came from (comma-separated,
# oldest first), those of them it saw in full (the rest at the replay share), and the share.
TAG_BATCHES = "tuneloop.data.batches"
TAG_NEW_BATCHES = "tuneloop.data.new_batches"
TAG_REPLAY = "tuneloop.data.replay_fraction"
# On the registered base model (the first champion): what it is; it trained on no pool batch.
TAG_BASE_MODEL = "tuneloop.base_model"


@dataclass(frozen=True)
class Start:
    """What training starts from, as ``init.json`` records it."""

    source: str  # "base" or "champion"
    reason: str
    model: str | None = None  # registered model name, for a champion
    version: str | None = None
    run_id: str | None = None
    batches: tuple[str, ...] = ()  # pool batches the start already trained on

    def describe(self) -> str:
        """In words: ``champion <name> v<N>`` or ``base``."""
        if self.source == "champion":
            return f"champion {self.model} v{self.version}"
        return "base"


@dataclass(frozen=True)
class Champion:
    """The registry's champion, as far as where training starts is concerned."""

    version: str
    run_id: str | None
    batches: tuple[str, ...]


def trained_batches(tags: Mapping[str, str], label: str) -> tuple[str, ...]:
    """The pool batches a registered version trained on, from its tags (``label`` names it).

    The registered base trained on none. A version registered before the tag existed says
    nothing: read as none, so ``clean`` trains on the whole pool in full rather than replay
    a share of data the version may never have seen.
    """
    if TAG_BASE_MODEL in tags:
        return ()
    if TAG_BATCHES not in tags:
        log.warning(
            "%s has no %s tag: taken as having trained on no pool batch", label, TAG_BATCHES
        )
    return split_batches(tags.get(TAG_BATCHES))


def start_for(params: Params, champion: Champion | None) -> Start:
    """Where training starts, given ``train.init_from`` and the registry's champion."""
    if params.train.init_from == "base":
        return Start("base", "train.init_from is base")
    name = params.tracking.registered_model
    if champion is None:
        return Start(
            "base",
            f"train.init_from is champion, but {name!r} has no 'champion' alias yet "
            "(the first month): starting from the base",
        )
    return Start(
        "champion",
        f"train.init_from is champion: {name} v{champion.version}",
        name,
        champion.version,
        champion.run_id,
        champion.batches,
    )


def in_place(folder: Path, start: Start) -> bool:
    """``folder`` holds ``start`` already: its record, and the champion's weights or none."""
    return read(folder) == start and (folder / MODEL_DIR).is_dir() == (start.source == "champion")


class ServingChampion(BaseModel):
    """The registry's champion when the ``init`` stage ran, and the pool batches it trained on."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: str = Field(description="its registered version")
    batches: tuple[str, ...] = Field(description="the pool batches it trained on, oldest first")


class InitMetrics(BaseModel):
    """``metrics/init.json``: the start (``Start``'s fields), and the serving champion with its
    pool batches whatever ``train.init_from`` says (the ``fixed_badcases`` stage builds from
    those)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    source: str = Field(description="what training starts from: base or champion")
    reason: str = Field(description="why, in words (train.init_from and the registry)")
    model: str | None = Field(description="the registered model; None: the base")
    version: str | None = Field(description="the champion's registered version; None: the base")
    run_id: str | None = Field(description="the champion's MLflow run; None: the base or none")
    batches: tuple[str, ...] = Field(description="pool batches the start already trained on")
    from_champion: int = Field(description="1 when training starts from the champion, else 0")
    champion_version: int = Field(description="the start's registered version; 0 for the base")
    champion: ServingChampion | None = Field(
        description="the serving champion, even when training starts from the base; None: none yet"
    )

    @property
    def start(self) -> Start:
        return Start(self.source, self.reason, self.model, self.version, self.run_id, self.batches)


# Stage ``champions`` writes ``<paths.metrics>/champions/<task>.json`` (``TaskChampion``).
CHAMPIONS_DIR = "champions"


class TaskChampion(BaseModel):
    """``metrics/champions/<task>.json``: the champion of a task's registered model as the
    registry had it when stage ``champions`` last ran. The task's ``init`` depends on this
    file: it reruns when the champion moved, and only then."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = Field(description="the task's registered model (tracking.registered_model)")
    version: str | None = Field(description="the version holding its champion alias; None: none")
    run_id: str | None = Field(description="that version's MLflow run; None: none")
    batches: tuple[str, ...] = Field(description="the pool batches it trained on, oldest first")

    @classmethod
    def of(cls, model: str, champion: Champion | None) -> TaskChampion:
        if champion is None:
            return cls(model=model, version=None, run_id=None, batches=())
        return cls(model=model, **asdict(champion))


def stage_metrics(start: Start, serving: Champion | None) -> InitMetrics:
    """``metrics/init.json`` for ``start`` with ``serving`` as the registry's champion."""
    champion = None
    if serving is not None:
        champion = ServingChampion(version=serving.version, batches=serving.batches)
    return InitMetrics(
        **asdict(start),
        from_champion=int(start.source == "champion"),
        champion_version=int(start.version or 0),
        champion=champion,
    )


def already_recorded(params: Params, serving: Champion | None, metrics: InitMetrics | None) -> bool:
    """The ``init`` stage's no-op key: ``paths.init`` and the stage's ``metrics`` (as read back,
    None when absent) already say what it would write with ``serving`` as the champion.

    What the stage writes depends on ``train.init_from``, the registered model's name, and the
    serving champion's version, run and pool batches; each is in ``start_for``'s record or in
    ``stage_metrics``, so any of them moving reruns the stage. The champion's weights are those
    of its version and run: a registered version is never rewritten.
    """
    start = start_for(params, serving if params.train.init_from == "champion" else None)
    return in_place(params.paths.init, start) and metrics == stage_metrics(start, serving)


def write_base(folder: Path, start: Start) -> None:
    """Record a start from the base (no weights to fetch), leaving an identical record be."""
    if read(folder) == start and not (folder / MODEL_DIR).exists():
        return
    with atomic_dir(folder) as tmp:
        write_json(tmp / INIT_FILE, asdict(start))


def read(folder: Path) -> Start | None:
    path = folder / INIT_FILE
    if not path.exists():
        return None
    record = read_json(path)
    return Start(**(record | {"batches": tuple(record.get("batches", ()))}))


def recorded(params: Params) -> Start:
    """The starting point the ``init`` stage recorded (base when it has not run)."""
    return read(params.paths.init) or Start("base", "the init stage has not run")


def split_batches(tag: str | None) -> tuple[str, ...]:
    """A ``TAG_BATCHES`` value back as batch ids."""
    return tuple(b for b in (tag or "").split(",") if b)


def model_ref(params: Params) -> str:
    """The folder (or hub id) training starts from and ``merge`` folds the adapter into."""
    from tuneloop.models import base_model_ref

    if recorded(params).source == "champion":
        return str(params.paths.init / MODEL_DIR)
    return base_model_ref(params)
