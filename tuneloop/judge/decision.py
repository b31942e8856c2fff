"""What the evaluate stage leaves for others to read: the gate's decision and the scores.

``metrics/decision.json`` is a :class:`Decision`: the verdict, every check and comparison
with its interval, and a reason for each (built by ``tuneloop.judge.gate.decide``, completed
by ``stages/evaluate.py``). ``metrics/evaluate.json`` is :data:`Scores` (model -> suite ->
metric -> value). Each is written and read here only, so a reader never guesses a key: a
file with a key missing or misspelt is refused with its path, and an old file of the same
shape still reads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, TypeAdapter

from tuneloop.io import ModelFileError, read_json, read_model, write_model
from tuneloop.judge.verdict import Outcome

Scores = dict[str, dict[str, dict[str, float]]]  # model -> suite -> metric -> value
Directions = dict[str, dict[str, bool]]  # suite -> metric -> higher is better
NotARule = Literal["not a rule"]


class _Record(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Comparison(_Record):
    """``model`` vs ``reference`` on one metric, paired item by item ("better by" ``diff``)."""

    suite: str
    metric: str
    higher_is_better: bool
    slice: str | None  # "field=label", None for the whole suite
    model: str
    value: float | None
    reference: str
    reference_value: float | None
    diff: float | None
    low: float | None
    high: float | None
    se: float | None
    items: int


class SliceComparison(Comparison):
    """A comparison within one slice, and whether its whole interval is below zero."""

    regressed: bool


class Check(_Record):
    """One rule judged on one comparison (or a count, or the people's votes)."""

    suite: str
    metric: str
    slice: str | None
    model: str
    reference: str
    items: int
    rule: str
    threshold: float
    status: Outcome
    passed: bool
    blocking: bool
    more_items: int | None
    reason: str
    # The comparison's figures; a count (fixed badcases) has none, a review some.
    higher_is_better: bool | None = None
    value: float | None = None
    reference_value: float | None = None
    diff: float | None = None
    low: float | None = None
    high: float | None = None
    se: float | None = None
    broken: int | None = None  # fixed badcases only


class UnsettledRule(_Record):
    """An inconclusive check as the approval form and ``tuneloop status`` list it."""

    rule: str
    suite: str
    metric: str
    slice: str | None
    more_items: int | None
    blocking: bool
    reason: str
    line: str


class Thresholds(_Record):
    min_gain: float
    max_regression: float
    fp8_max_drop: float | None
    max_forgetting: float
    max_slice_regression: float | None
    max_broken_fixes: int | None = None
    fp4_max_drop: float | None = None


class Statistics(_Record):
    method: str
    confidence: float
    samples: int
    seed: int


class Forgetting(_Record):
    suites: list[str]
    reference: str
    could_not_run: dict[str, str]  # general suite -> why it could not run


class ExportStanding(_Record):
    """One export format's checks, their outcome, and whether the gate refused the format."""

    format: str
    model: str
    rule: str
    max_drop: float | None
    status: Outcome | NotARule
    refused: bool
    reason: str
    checks: list[Check]


class FixedBadcases(_Record):
    """The fixes the candidate broke (``suite`` None and status ``empty``: none to keep)."""

    suite: str | None = None
    items: int = 0
    fixed_by_champion: int = 0
    broken: int = 0
    broken_ids: list[str] = []
    max_broken_fixes: int | None = None
    status: Outcome | Literal["empty"] = "empty"


class Champion(_Record):
    """A registered version's identity, as the gate compared with it."""

    name: str
    version: str
    run_id: str
    source: str


class Decision(_Record):
    """The gate's verdict with every check, comparison and reason (``metrics/decision.json``).

    The last five fields are the evaluation's, not the rules': ``stages/evaluate.py`` sets
    them with :meth:`judged`.
    """

    verdict: Outcome
    passed: bool
    primary_metric: str
    thresholds: Thresholds
    statistics: Statistics
    # What a person acts on comes first: failures, then what is not settled.
    reasons: list[str]
    failed: list[str]
    inconclusive: list[str]
    on_inconclusive: Literal["block", "warn"] = "block"
    # Every rule the data could not settle, blocking or not: what a person must read.
    unsettled: list[UnsettledRule] = []
    more_items: dict[str, int | None]  # suite -> items that would settle its unsettled checks
    regressed_slices: list[str]
    reference: str  # champion, else base
    items: dict[str, int]  # suite -> items scored
    forgetting: Forgetting
    checks: list[Check]
    comparisons: list[Comparison]
    slices: list[SliceComparison]
    exports: dict[str, ExportStanding] = {}
    fixed_badcases: FixedBadcases = FixedBadcases()
    higher_is_better: Directions
    champion: Champion | None = None
    candidate_key: str | None = None  # the judged merged folder: registration refuses another
    backend: str | None = None
    engines: dict[str, str] = {}  # model -> what answered, with its version

    def judged(
        self, champion: Champion | None, candidate_key: str, backend: str, engines: dict[str, str]
    ) -> Decision:
        """This decision with what was evaluated and how."""
        return self.model_validate(
            self.model_dump()
            | {
                "champion": champion,
                "candidate_key": candidate_key,
                "backend": backend,
                "engines": engines,
            }
        )

    def let_through(self) -> list[UnsettledRule]:
        """The rules left unsettled that did not block (``gate.on_inconclusive: warn``)."""
        return [u for u in self.unsettled if not u.blocking]

    def export(self, fmt: str) -> ExportStanding | None:
        return self.exports.get(fmt)

    def refused(self, fmt: str) -> bool:
        """Whether the gate refused export format ``fmt`` (not judged: not refused)."""
        found = self.exports.get(fmt)
        return found is not None and found.refused

    def write(self, path: Path) -> None:
        write_model(path, self)

    @classmethod
    def read(cls, path: Path) -> Decision:
        """``path`` as the gate wrote it; ``ModelFileError`` naming the file otherwise."""
        return read_model(path, cls)


def read_decision(path: Path) -> Decision:
    return Decision.read(path)


_SCORES = TypeAdapter(Scores)


def read_scores(path: Path) -> Scores:
    """``metrics/evaluate.json``, as the stage wrote it (``tuneloop.stage.write_metrics``, which
    logs the same numbers to MLflow): every model's figure of every metric on every suite."""
    try:
        return _SCORES.validate_python(read_json(path))
    except ValueError as error:  # not JSON, or not this shape
        raise ModelFileError(
            f"{path} is not model -> suite -> metric -> number: {error}; rerun "
            "`dvc repro evaluate` to write it again"
        ) from None
