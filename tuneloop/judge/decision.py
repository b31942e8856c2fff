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

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from tuneloop.io import ModelFileError, read_json, read_model, write_model
from tuneloop.judge.verdict import Outcome

Scores = dict[str, dict[str, dict[str, float]]]  # model -> suite -> metric -> value
Directions = dict[str, dict[str, bool]]  # suite -> metric -> higher is better
NotARule = Literal["not a rule"]


class _Record(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Comparison(_Record):
    """``model`` vs ``reference`` on one metric, paired item by item ("better by" ``diff``)."""

    suite: str = Field(description="the eval suite")
    metric: str = Field(description="the metric compared, as the suite reports it")
    higher_is_better: bool = Field(description="the metric's direction, as the suite gives it")
    slice: str | None = Field(description='the slice, "field=label"; None: the whole suite')
    model: str = Field(description="the model judged: candidate, or an export (candidate-fp8)")
    value: float | None = Field(
        description="the model's figure: the weighted mean over the items; None: no item counts"
    )
    reference: str = Field(description="the model it is compared with: base, champion, candidate")
    reference_value: float | None = Field(
        description="the reference's figure; None: no item counts"
    )
    diff: float | None = Field(
        description="how much better the model is than the reference, whichever way the metric "
        "points (negative: worse); None: a figure is missing"
    )
    low: float | None = Field(
        description="low end of the paired bootstrap interval of diff (gate.confidence); None: "
        "no interval"
    )
    high: float | None = Field(description="high end of that interval; None: no interval")
    se: float | None = Field(
        description="standard deviation of the bootstrap differences; None: no interval"
    )
    items: int = Field(description="items that count toward both figures")


class SliceComparison(Comparison):
    """A comparison within one slice, and whether its whole interval is below zero."""

    regressed: bool = Field(description="the whole interval is below zero: the slice got worse")


class Check(_Record):
    """One rule judged on one comparison (or a count, or the people's votes)."""

    suite: str = Field(description='the eval suite; the blind review: "review:<name>"')
    metric: str = Field(description="the metric judged")
    slice: str | None = Field(description='the slice, "field=label"; None: the whole suite')
    model: str = Field(description="the model judged: candidate, or an export (candidate-fp8)")
    reference: str = Field(description="the model it is held against: base, champion, candidate")
    items: int = Field(
        description="items that count toward the comparison; fixed badcases: the fixes (items "
        "the champion answers right); the blind review: votes"
    )
    rule: str = Field(
        description="beats_base, no_regression, fp8_within, nvfp4_within, nvfp4a16_within, "
        "forgetting, slice_regression, fixed_badcases or blind_review"
    )
    threshold: float = Field(
        description="the least diff that passes (negative: the drop allowed); fixed badcases: "
        "the broken fixes allowed; the blind review: the least win rate"
    )
    status: Outcome = Field(description="pass, fail or inconclusive")
    passed: bool = Field(description="status is pass")
    blocking: bool = Field(
        description="it stops the candidate: a failure, or inconclusive where "
        "gate.on_inconclusive is block"
    )
    more_items: int | None = Field(
        description="about how many more suite items (the blind review: votes) would settle an "
        "inconclusive check; None: settled, or no number would"
    )
    reason: str = Field(description="the check in words: figures, threshold and outcome")
    higher_is_better: bool | None = Field(
        default=None, description="the metric's direction; None: a count or the blind review"
    )
    value: float | None = Field(
        default=None,
        description="the model's figure (the blind review: the candidate's decisive win rate); "
        "None: a count, or no item counts",
    )
    reference_value: float | None = Field(
        default=None, description="the reference's figure; None: a count or the blind review"
    )
    diff: float | None = Field(
        default=None,
        description="how much better the model is than the reference (negative: worse); None: "
        "a count, the blind review, or a figure missing",
    )
    low: float | None = Field(
        default=None,
        description="low end of the interval (the blind review: Wilson's); None: no interval",
    )
    high: float | None = Field(
        default=None, description="high end of the interval; None: no interval"
    )
    se: float | None = Field(
        default=None,
        description="standard deviation of the bootstrap differences; None: no bootstrap",
    )
    broken: int | None = Field(
        default=None, description="fixes the candidate broke; None: not the fixed_badcases rule"
    )


class UnsettledRule(_Record):
    """An inconclusive check as the approval form and ``tuneloop status`` list it."""

    rule: str = Field(description="the check's rule")
    suite: str = Field(description="the check's suite")
    metric: str = Field(description="the check's metric")
    slice: str | None = Field(description='the slice, "field=label"; None: the whole suite')
    more_items: int | None = Field(
        description="about how many more items (or votes) would settle it; None: no number would"
    )
    blocking: bool = Field(
        description="it blocks the candidate; false: let through (gate.on_inconclusive: warn)"
    )
    reason: str = Field(description="the check's reason")
    line: str = Field(description="the rule, where, and what would settle it, in one line")


class Thresholds(_Record):
    min_gain: float = Field(description="gate.min_gain: the least the candidate beats the base by")
    max_regression: float = Field(description="gate.max_regression: behind the champion, at most")
    fp8_max_drop: float | None = Field(
        description="gate.fp8_max_drop: the FP8 export behind the candidate, at most; None: not "
        "a rule"
    )
    max_forgetting: float = Field(
        description="gate.max_forgetting: behind the reference on a general suite, at most"
    )
    max_slice_regression: float | None = Field(
        description="gate.max_slice_regression: behind the reference in a slice, at most; None: "
        "slices reported only"
    )
    max_broken_fixes: int | None = Field(
        default=None,
        description="gate.max_broken_fixes; None: a decision written before the rule",
    )
    fp4_max_drop: float | None = Field(
        default=None,
        description="gate.fp4_max_drop: an FP4 export behind the candidate, at most; None: not "
        "a rule",
    )


class Statistics(_Record):
    method: str = Field(description="how the intervals are made: a paired bootstrap, percentile")
    confidence: float = Field(description="gate.confidence: of every interval")
    samples: int = Field(description="gate.bootstrap_samples: resamples per suite")
    seed: int = Field(description="gate.seed: of the bootstrap")


class Forgetting(_Record):
    suites: list[str] = Field(description="the general suites judged (those that could run)")
    reference: str = Field(description="what the candidate is held against: champion, else base")
    could_not_run: dict[str, str] = Field(description="general suite -> why it could not run")


class ExportStanding(_Record):
    """One export format's checks, their outcome, and whether the gate refused the format."""

    format: str = Field(description="the export format: fp8, nvfp4 or nvfp4a16")
    model: str = Field(description="the export's model name in the scores, e.g. candidate-fp8")
    rule: str = Field(description="the gate key that bounds it: fp8_max_drop or fp4_max_drop")
    max_drop: float | None = Field(description="that key's value; None: not a rule")
    status: Outcome | NotARule = Field(
        description="the worst of its checks (pass when none), or not a rule"
    )
    refused: bool = Field(
        description="the gate refused the format: it is not registered (a check failed, or is "
        "unsettled and blocking)"
    )
    reason: str = Field(description="why refused or within, in words")
    checks: list[Check] = Field(description="its checks, one per metric of each business suite")


class FixedBadcases(_Record):
    """The fixes the candidate broke (``suite`` None and status ``empty``: none to keep)."""

    suite: str | None = Field(
        default=None, description="the fixed-badcase suite; None: the suite is empty"
    )
    items: int = Field(default=0, description="the suite's items")
    fixed_by_champion: int = Field(
        default=0, description="items the champion answers right: the fixes to keep"
    )
    broken: int = Field(default=0, description="of those, the items the candidate answers wrong")
    broken_ids: list[str] = Field(default=[], description="the item ids of every broken fix")
    max_broken_fixes: int | None = Field(
        default=None, description="gate.max_broken_fixes; None: the suite is empty"
    )
    status: Outcome | Literal["empty"] = Field(
        default="empty", description="pass or fail; empty: no fix to keep yet"
    )


class Champion(_Record):
    """A registered version's identity, as the gate compared with it."""

    name: str = Field(description="the registered model")
    version: str = Field(description="its registered version")
    run_id: str = Field(description='the MLflow run that logged it; "": none recorded')
    source: str = Field(description='the version\'s source (artifact URI); "": none recorded')


class Decision(_Record):
    """The gate's verdict with every check, comparison and reason (``metrics/decision.json``).

    The last five fields are the evaluation's, not the rules': ``stages/evaluate.py`` sets
    them with :meth:`judged`.
    """

    verdict: Outcome = Field(
        description="fail when a blocking check failed, else inconclusive when one is unsettled, "
        "else pass"
    )
    passed: bool = Field(description="verdict is pass")
    primary_metric: str = Field(description="gate.primary_metric: the metric beats_base judges")
    thresholds: Thresholds = Field(description="the gate's thresholds the checks used")
    statistics: Statistics = Field(description="how the intervals were made")
    # What a person acts on comes first: failures, then what is not settled.
    reasons: list[str] = Field(
        description="every check's reason and every note: failures, blocking unsettled checks, "
        "regressed slices, the rest, notes"
    )
    failed: list[str] = Field(description="the failed checks' reasons")
    inconclusive: list[str] = Field(description="the blocking inconclusive checks' reasons")
    on_inconclusive: Literal["block", "warn"] = Field(
        default="block", description="gate.on_inconclusive: whether an unsettled rule blocks"
    )
    unsettled: list[UnsettledRule] = Field(
        default=[],
        description="every rule the data could not settle, blocking or not: what a person must "
        "read",
    )
    more_items: dict[str, int | None] = Field(
        description="suite -> items that would settle its blocking unsettled checks (the most "
        "any needs); None: one of them cannot say"
    )
    regressed_slices: list[str] = Field(
        description='"suite/metric [field=label]" of every slice whose interval is below zero'
    )
    reference: str = Field(description="what the candidate is held against: champion, else base")
    items: dict[str, int] = Field(description="suite -> items scored")
    forgetting: Forgetting = Field(description="the general suites and what could not run")
    checks: list[Check] = Field(
        description="every check of the rules (the FP4 exports' are under exports)"
    )
    comparisons: list[Comparison] = Field(description="every whole-suite comparison made")
    slices: list[SliceComparison] = Field(
        description="the candidate vs the reference in every slice of a business suite"
    )
    exports: dict[str, ExportStanding] = Field(
        default={}, description="export format -> its checks and whether the gate refused it"
    )
    fixed_badcases: FixedBadcases = Field(
        default=FixedBadcases(), description="the fixes the candidate broke"
    )
    higher_is_better: Directions = Field(
        description="suite -> metric -> whether a higher figure is better"
    )
    champion: Champion | None = Field(
        default=None, description="the registered champion compared with; None: none yet"
    )
    candidate_key: str | None = Field(
        default=None,
        description="sha256 of the judged merged folder's manifest: registration refuses "
        "another; None: not yet set by evaluate",
    )
    backend: str | None = Field(
        default=None,
        description="hf or vllm: what scored the candidate; None: not yet set by evaluate",
    )
    engines: dict[str, str] = Field(
        default={}, description="model -> what answered it, with its version"
    )

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
