"""One release under way: the ramp plan, the state the flow and its analysis thread share,
and the record of every event on the candidate's MLflow run.

``Release`` is the controller: it moves the routers' weights (``shift``, ``shadow``,
``roll_back``), reads each interval's requests from them, judges the interval
(``tuneloop/release/analysis.py``), extends an inconclusive one, counts failures and
rolls back at ``failure_limit``. ``ReleaseLog`` writes each event to the flow's log,
as MLflow metrics and tags, and as a JSON-lines artifact. The Prefect flow and its tasks
(``flows/release.py``) call them; nothing here knows about Prefect.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from tuneloop.judge.verdict import FAIL, INCONCLUSIVE, PASS
from tuneloop.params import ReleaseParams
from tuneloop.release.admin import AdminError, Batch, Cursor, RouterAdmin
from tuneloop.release.analysis import WEIGHT_CHECK, Verdict, analyse, analyse_shadow
from tuneloop.release.checks import comparison
from tuneloop.release.events import Analysis, ReleaseEvent, Rollback, Shadow, Shift
from tuneloop.release.readings import ArmSamples, StatsError, read_pairs, tally
from tuneloop.release.shadow import Judges

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

Logger = logging.Logger | logging.LoggerAdapter[Any]


def next_step(steps: Sequence[int], current: int) -> int | None:
    """The planned percent after ``current`` (None at 100: promote, not ramp)."""
    return next((s for s in steps if s > current), None)


# --- the record on the candidate's MLflow run ----------------------------------------------------


class ReleaseLog:
    """Every event of one release: the flow log, MLflow metrics and tags, a JSON-lines artifact.

    Written from the flow and from the analysis thread that runs during a pause,
    hence the lock.
    """

    def __init__(self, client: MlflowClient, run_id: str, flow_run_id: str, logger: Logger) -> None:
        self.client = client
        self.run_id = run_id
        self.artifact = f"release/{flow_run_id}.jsonl"
        self.logger = logger
        self.events: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def record(
        self,
        kind: str,
        message: str,
        metrics: dict[str, float] | None = None,
        step: int | None = None,
        warn: bool = False,
        **fields: Any,
    ) -> None:
        (self.logger.warning if warn else self.logger.info)("%s: %s", kind, message)
        at = datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
        with self._lock:
            self.events.append({"at": at, "kind": kind, "message": message, **fields})
            for key, value in (metrics or {}).items():
                self.client.log_metric(
                    self.run_id, f"release.{key}", value, step=step or len(self.events)
                )
            self.client.log_text(
                self.run_id,
                "".join(json.dumps(e, ensure_ascii=False) + "\n" for e in self.events),
                self.artifact,
            )

    def tag(self, **tags: str) -> None:
        for key, value in tags.items():
            self.client.set_tag(self.run_id, f"release.{key}", value[:5000])


# --- one release in progress -------------------------------------------------------------------


@dataclass
class Release:
    """What the flow and its analysis thread share while one release is under way.

    ``pending``: the items (requests, or shadow pairs) of the interval being
    analysed; an inconclusive analysis keeps them and extends the interval.
    """

    params: ReleaseParams
    admin: RouterAdmin
    log: ReleaseLog
    flow_run_id: str
    judges: Judges | None = None
    analyses: int = 0
    failures: int = 0
    extensions: int = 0
    rolled_back: str | None = None
    rollback_seconds: float | None = None
    history: list[ReleaseEvent] = field(default_factory=list)
    pending: list[dict[str, Any]] = field(default_factory=list)
    dropped: int = 0
    # The champion's requests of the last interval it served: what 100 % is judged against.
    champion_reference: ArmSamples | None = None
    # For the approval form: the blind review's result and the rules the gate let through
    # unsettled (gate.on_inconclusive: warn), which every approval must acknowledge.
    people: str = ""
    unsettled: tuple[str, ...] = ()
    samples: Cursor = field(init=False)
    pairs: Cursor = field(init=False)

    def __post_init__(self) -> None:
        self.samples = Cursor(self.admin, "/admin/samples")
        self.pairs = Cursor(self.admin, "/admin/shadow")

    def _new_interval(self) -> None:
        self.pending, self.dropped, self.extensions = [], 0, 0

    def shift(self, percent: int, reason: str) -> None:
        self.admin.set_weight(percent, reason)
        # Intervals are measured from here: traffic before the shift is not this step's.
        self.samples.skip()
        self._new_interval()
        self.log.record(
            "shift",
            f"challenger -> {percent} % ({reason})",
            {"challenger_percent": float(percent)},
            percent=percent,
        )
        self.history.append(Shift(percent=percent))

    def shadow(self, percent: int, reason: str) -> None:
        self.admin.set_shadow(percent, reason)
        self.pairs.skip()
        self._new_interval()
        self.log.record(
            "shadow",
            f"{percent} % of users mirrored to the challenger, its answers seen by nobody "
            f"({reason})",
            {"shadow_percent": float(percent)},
            percent=percent,
        )
        self.history.append(Shadow(percent=percent))

    def _read(self, cursor: Cursor) -> Batch:
        batch = cursor.read()
        self.pending.extend(batch.items)
        self.dropped += batch.dropped
        if batch.restarted:
            self.log.record(
                "router_restarted", f"{batch.restarted} restarted; read again", warn=True
            )
        if len(batch.percents) > 1:
            raise StatsError(
                f"router replicas disagree on challenger_percent ({sorted(batch.percents)}); "
                "a weight change reached only some of them: set it again or roll back"
            )
        return batch

    def analyse(self, percent: int) -> Verdict:
        """One analysis of the canary's requests since the last decided one."""

        def judge() -> tuple[Verdict, dict[str, Any]]:
            batch = self._read(self.samples)
            current = next(iter(batch.percents), percent)
            traffic = tally(self.pending, current, self.dropped)
            metrics: dict[str, float] = {}
            for arm, figures in traffic.arms.items():
                metrics[f"{arm}.requests"] = float(figures.requests)
            if traffic.challenger_share is not None:
                metrics["analysis.challenger_share"] = traffic.challenger_share
            fields = {
                "challenger_share": traffic.challenger_share,
                "requests": {arm: f.requests for arm, f in traffic.arms.items()},
            }
            champion = traffic.arms["champion"]
            verdict = analyse(traffic, self.params, percent, self.champion_reference)
            if percent < 100 and champion.requests >= self.params.min_requests:
                self.champion_reference = champion  # what 100 % is compared with
            return verdict, {"metrics": metrics, **fields}

        return self._analysis(f"{percent} %", percent, judge)

    def analyse_shadow(self) -> Verdict:
        """One analysis of the mirrored requests' answer pairs since the last decided one."""
        shadow_percent = self.params.shadow_percent

        def judge() -> tuple[Verdict, dict[str, Any]]:
            batch = self._read(self.pairs)
            judges = self.judges
            verdict = analyse_shadow(
                read_pairs(self.pending),
                self.params,
                None if judges is None else judges.compliant,
                None if judges is None else judges.score,
            )
            expected = {shadow_percent} if shadow_percent else set()
            if batch.shadows - expected or batch.percents - {0}:
                # Rolled back, or moved by someone else: the shadow step must stop.
                moved = comparison(
                    WEIGHT_CHECK,
                    FAIL,
                    float(max(batch.percents | {0})),
                    None,
                    f"== 0 with shadow {shadow_percent} % (set by this release); the router "
                    f"has shadow {sorted(batch.shadows)}",
                )
                verdict = Verdict((moved, *verdict.checks), verdict.figures)
            return verdict, {"metrics": {}, "pairs": len(self.pending)}

        return self._analysis("shadow", 0, judge)

    def _analysis(
        self, where: str, percent: int, judge: Callable[[], tuple[Verdict, dict[str, Any]]]
    ) -> Verdict:
        """Judge, count, extend or roll back, and record: shared by canary and shadow steps.

        An inconclusive analysis keeps its interval's items and extends it, up to
        ``max_extensions`` times; then it counts as a failure. A failure counts
        toward ``failure_limit``. The rollback comes before any bookkeeping, so that
        MLflow writes never delay it.
        """
        self.analyses += 1
        try:
            verdict, extra = judge()
        except (AdminError, StatsError) as error:
            unreadable = comparison(f"router_samples ({error})", FAIL, None, None, "readable")
            verdict = Verdict((unreadable,))
            extra = {"metrics": {}}
        outcome = verdict.outcome
        extend = outcome == INCONCLUSIVE and self.extensions < self.params.max_extensions
        if extend:
            self.extensions += 1
            limit = self.params.max_extensions
            label = f"INCONCLUSIVE, interval extended ({self.extensions}/{limit})"
        else:
            if not verdict.passed:
                self.failures += 1
            label = {PASS: "PASS", FAIL: "FAIL"}.get(
                outcome, "INCONCLUSIVE after every extension: FAIL"
            )
            self._new_interval()
        reason = self.must_roll_back(verdict)
        if reason is not None:
            self.roll_back(reason)
        metrics = {
            "analysis.passed": float(verdict.passed),
            "analysis.inconclusive": float(outcome == INCONCLUSIVE),
            "analysis.failures": float(self.failures),
            **extra.pop("metrics"),
            **{k: float(v) for k, v in verdict.figures.items()},
        }
        for check in verdict.checks:
            for key in ("challenger", "champion", "p_value"):
                value = check.value.get(key)
                if value is not None and check.name != WEIGHT_CHECK:
                    metrics[f"analysis.{check.name}.{key}"] = float(value)
        summary = "; ".join(verdict.reasons)
        self.log.record(
            "shadow_analysis" if where == "shadow" else "analysis",
            f"#{self.analyses} at {where}: {label} "
            f"(failures {self.failures}/{self.params.failure_limit}): {summary}",
            metrics,
            step=self.analyses,
            warn=not verdict.passed,
            percent=percent,
            number=self.analyses,
            extended=extend,
            **extra,
            **verdict.as_dict(),
        )
        self.history.append(
            Analysis(
                kind="shadow_analysis" if where == "shadow" else "analysis",
                percent=percent,
                passed=verdict.passed,
                outcome=outcome,
                extended=extend,
                challenger_share=extra.get("challenger_share"),
                requests=extra.get("requests"),
            )
        )
        return verdict

    def must_roll_back(self, verdict: Verdict) -> str | None:
        """Why this verdict ends the release, or None."""
        if verdict.interrupted:
            return "the router's weight was changed outside this flow: " + "; ".join(
                verdict.reasons
            )
        if self.failures >= self.params.failure_limit:
            return (
                f"{self.failures} failed analyses (limit {self.params.failure_limit}); last: "
                + "; ".join(verdict.reasons)
            )
        return None

    def roll_back(self, reason: str) -> None:
        """Challenger to 0 on every router now. Aliases stay as they are."""
        if self.rolled_back is not None:
            return
        try:
            seconds = self.admin.rollback(reason)
        except AdminError as error:
            self.log.record("rollback_failed", str(error), warn=True)
            self.log.tag(status="rollback_failed", reason=str(error))
            raise
        self.rolled_back, self.rollback_seconds = reason, seconds
        self.log.record(
            "rollback",
            f"challenger -> 0 % in {seconds * 1000:.0f} ms: {reason}",
            {"challenger_percent": 0.0, "rollback_seconds": seconds},
            warn=True,
            seconds=seconds,
        )
        self.log.tag(status="rolled_back", reason=reason)
        self.history.append(Rollback(reason=reason, seconds=seconds))
