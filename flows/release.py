"""The release flow: canary, analysis, a person's approval, ramp, promote — or roll back.

Reads the registry's ``challenger`` and ``champion`` versions of
``tracking.registered_model`` and drives the canary router(s) in
``release.routers`` through ``release.steps`` (e.g. 10 -> 50 -> 100 %):

1. **Preflight**: the router's arms must serve exactly those two versions,
   send the challenger nothing yet, sign their request ids (or no badcase
   reaches the analysis) and hold no other release's lease; otherwise nothing
   moves.
   **The people's sign-off** (``tuneloop/release/signoff.py``): the candidate's blind review
   (``<registered_model>-v<N>`` in the review store) is judged and recorded on its run, card
   and version. With ``gate.blind_review`` set the flow creates it if needed and pauses
   until it is settled (``await_review``): a failed review, or none settled within
   ``approval_timeout``, blocks the release; unset, the review is only reported. The rules
   the gate let through unsettled (``gate.on_inconclusive: warn``) are listed on every
   approval form, and an approval without ``acknowledge_inconclusive`` is refused.
2. **Load test** before the first traffic: candidate and champion backends,
   called directly at the same concurrency and a fixed answer length, on median
   TTFT and time per output token (``release.loadtest``, ``tuneloop/release/loadtest.py``);
   a regression past the thresholds blocks the release. ``enabled: false`` skips
   it, and the release records that it did.
3. **Shadow step** (optional, ``release.shadow_percent`` > 0): the routers
   mirror that share of users' requests to the challenger; users get the
   champion's answer only. Every ``analysis_interval`` the two arms' answers to
   the same requests are compared (errors, latency, the suites' answer format,
   length, the suites' scores on their own questions) until
   ``analyses_per_step`` have passed; only then does the first canary step start.
4. **Each step**: set the weight, then analyse every ``analysis_interval``
   seconds (challenger against champion on the interval's own requests: error
   and badcase rates by a two-proportion test, latency and TTFT by Mann-Whitney;
   ``tuneloop.release.analysis``) until ``analyses_per_step`` have passed. An
   inconclusive analysis extends its interval (``max_extensions``), then counts
   as failed. Failed analyses are counted over the whole release; at
   ``failure_limit`` the flow rolls back by itself. Analysis goes on while the
   flow waits for a person.
5. **Before every increase** the flow pauses for a person
   (``pause_flow_run(wait_for_input=...)``): approve (optionally choosing the
   next percent) or reject, with name and comment, from the Prefect UI or
   ``tuneloop approve|reject``. The answer is validated again here. Reject, or
   no answer within ``approval_timeout``, rolls back; it never ramps.
6. **At 100 %**, after its analyses pass, **promote**: alias ``champion`` moves
   to the candidate, ``previous-champion`` marks the old one (kept, for an
   instant return), ``challenger`` is removed.

**The lease.** Before the first traffic moves, the flow takes a lease on every
router (``release.lease_ttl_s``) and renews it from a background thread every
third of that, also while it waits days for a person. A flow that dies (OOM,
host lost, SIGKILL) stops renewing, and every router sets the challenger to 0 %
by itself when its lease lapses, and records why. While the lease holds, each
router also rolls back on its own at a burst of challenger errors
(``release.fast_fail``), without waiting for the next analysis. A crash or a
cancellation that Prefect sees runs ``roll_back_on_exit`` at once.

**Rollback** is ``POST /admin/rollback`` on every replica: the challenger gets
0 % from the very next request; registry aliases are not touched. Every step,
analysis, answer and decision is logged on the candidate's MLflow run (the run
its model version came from): ``release.*`` metrics and tags, and the event
log as the text artifact ``release/<flow-run-id>.jsonl``.

The load test runs while the champion serves its live traffic and the
candidate serves none, which favours the candidate: set the thresholds with
that in mind, or point the test at an idle copy of the champion.

The flow ends COMPLETED only when it promoted. A blocked or rolled-back
release ends FAILED with the reason as the state message; an approval timeout
also ends FAILED, with Prefect's own message ("The flow was failed and never
resumed."), because the server fails a paused run whose pause timed out even
though the flow catches the timeout, rolls back and records why.

After a promotion the router still sends 100 % to its ``challenger`` arm:
the operator swaps the arms in ``router.yaml`` (the new version becomes the
``champion`` arm at 0 %) at the next router deploy.

This module holds the Prefect tasks and the flow. What they drive lives in
``tuneloop/release/``: the controller that moves weights, judges intervals and
records every event (``controller.py``), the analysis (``analysis.py``, with the
router's readings in ``readings.py`` and the tests in ``checks.py``), the person's
answer (``approval.py``) and the load test (``loadtest.py``).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
import time
from pathlib import Path
from typing import Any, Literal
from uuid import UUID

from mlflow.entities.model_registry import ModelVersion
from mlflow.tracking import MlflowClient
from prefect import flow, get_run_logger, runtime, task
from prefect.cache_policies import NONE
from prefect.client.schemas.objects import FlowRun
from prefect.exceptions import FlowPauseTimeout
from prefect.flow_runs import pause_flow_run, resume_flow_run
from prefect.input import RunInput
from prefect.states import Failed, State
from pydantic import BaseModel, Field

from tuneloop.judge.verdict import FAIL, PASS
from tuneloop.orchestration.flow_results import ReleaseOutcome
from tuneloop.params import Params, load_params
from tuneloop.release import shadow as suite_judges
from tuneloop.release import signoff
from tuneloop.release.admin import AdminError, LeaseKeeper, RouterAdmin
from tuneloop.release.analysis import Verdict
from tuneloop.release.approval import (
    Approval,
    InvalidAnswer,
    approval_form,
    approval_poll_seconds,
    validate_answer,
)
from tuneloop.release.controller import Logger, Release, ReleaseLog, next_step
from tuneloop.release.events import ApprovalStep
from tuneloop.release.loadtest import compare_load, load_test
from tuneloop.review.store import ReviewError, ReviewStore
from tuneloop.tracking import runs
from tuneloop.tracking.registry import CHALLENGER, CHAMPION, PREVIOUS, find_alias, promote

# The approver name the flow answers its own pause with when analysis rolls back.
CONTROLLER = "tuneloop-release-controller"


class ReleaseRefused(RuntimeError):
    """The release cannot start; nothing was moved. The message names the fix."""


class ReleaseFailed(RuntimeError):
    """A release that ended without promoting: blocked by the load test, or rolled back.

    It is the data of the flow's FAILED state, so a caller without
    ``return_state`` gets this exception (the reason as its message) and one
    with it reads ``outcome`` (``release_outcome``). Prefect resolves a failed
    state's data into an exception; a plain dict there ends in a ``TypeError``.
    """

    def __init__(self, message: str, outcome: ReleaseOutcome) -> None:
        super().__init__(message, outcome)  # both, so it pickles back whole
        self.message = message
        self.outcome = outcome

    def __str__(self) -> str:
        return self.message


def release_outcome(state: State[Any]) -> ReleaseOutcome:
    """What a finished release did (``outcome``, ``reason``, ``history`` ...), from its state."""
    result = state.result(raise_on_failure=False)
    if isinstance(result, ReleaseFailed):
        return result.outcome
    if isinstance(result, ReleaseOutcome):
        return result
    # Refused before it started, or stopped by an error: no outcome of its own.
    return ReleaseOutcome(outcome="failed", reason=state.message or str(result))


# --- registry ----------------------------------------------------------------------------------
# tuneloop.tracking.registry sets `challenger` when a candidate passes the gate and moves
# `champion` and `previous-champion` when the release flow promotes.


def registry_pair(client: MlflowClient, name: str) -> tuple[ModelVersion, ModelVersion]:
    """(candidate, champion): the versions aliased ``challenger`` and ``champion``."""
    found: dict[str, ModelVersion] = {}
    for alias in (CHALLENGER, CHAMPION):
        version = find_alias(name, alias, client)
        if version is None:
            raise ReleaseRefused(
                f"registered model {name!r} has no version with alias {alias!r}; a candidate "
                "gets `challenger` when it passes the gate (tuneloop.tracking.registry), and "
                "the model that serves now needs `champion`: "
                f"MlflowClient().set_registered_model_alias("
                f"{name!r}, {alias!r}, <version>)"
            )
        found[alias] = version
    candidate, champion = found[CHALLENGER], found[CHAMPION]
    if str(candidate.version) == str(champion.version):
        raise ReleaseRefused(
            f"{name} v{candidate.version} is both champion and challenger; nothing to release"
        )
    return candidate, champion


# --- the record on the candidate's MLflow run ----------------------------------------------------


def candidate_run(client: MlflowClient, version: ModelVersion, params: Params, log: Logger) -> str:
    """The run the candidate version came from, where its release is recorded."""
    if version.run_id:
        return str(version.run_id)
    log.warning(
        "%s v%s has no source run (registered without one); recording the release in a new run",
        version.name,
        version.version,
    )
    experiment = client.get_experiment_by_name(params.tracking.experiment)
    experiment_id = (
        experiment.experiment_id
        if experiment is not None
        else client.create_experiment(params.tracking.experiment)
    )
    run = client.create_run(experiment_id, run_name=f"release-v{version.version}")
    return str(run.info.run_id)


# --- tasks -------------------------------------------------------------------------------------
# No cache: they act on live systems. No retries: a traffic shift is a decision,
# not something to repeat behind a person's back.


@task(task_run_name="load test", cache_policy=NONE, retries=0)
def loadtest_gate(release: Release, arms: dict[str, dict[str, str]]) -> Verdict:
    """Candidate against champion, each backend called directly, before any user sees it."""
    p = release.params.loadtest
    if not p.enabled:
        release.log.record(
            "loadtest",
            "SKIPPED: release.loadtest.enabled is false; the candidate's speed is judged by the "
            "canary's latency and TTFT analyses only",
            {"loadtest.skipped": 1.0},
            warn=True,
        )
        return Verdict(())  # nothing checked: nothing blocks
    results = {
        arm: load_test(
            arms[arm]["base_url"], arms[arm]["model"], p.requests, p.concurrency, p.max_tokens
        )
        for arm in (CHAMPION, CHALLENGER)
    }
    verdict = compare_load(results[CHAMPION], results[CHALLENGER], p)
    metrics = {
        f"loadtest.{arm}.{key}": float(value)
        for arm, result in results.items()
        for key, value in result.summary().items()
        if isinstance(value, int | float)  # bools too: fixed_length 1.0 / 0.0
    }
    metrics["loadtest.passed"] = float(verdict.passed)
    release.log.record(
        "loadtest",
        f"{'PASS' if verdict.passed else 'BLOCKED'}: " + "; ".join(verdict.reasons),
        metrics,
        warn=not verdict.passed,
        results={arm: r.summary() for arm, r in results.items()},
        **verdict.as_dict(),
    )
    return verdict


@task(task_run_name="challenger to {percent} %", cache_policy=NONE, retries=0)
def shift_traffic(release: Release, percent: int, reason: str) -> None:
    release.shift(percent, reason)


@task(task_run_name="analysis at {percent} %", cache_policy=NONE, retries=0)
def hold_and_analyse(release: Release, percent: int) -> Verdict:
    time.sleep(release.params.analysis_interval)
    return release.analyse(percent)


@task(task_run_name="shadow {percent} %", cache_policy=NONE, retries=0)
def set_shadow(release: Release, percent: int, reason: str) -> None:
    release.shadow(percent, reason)


@task(task_run_name="shadow analysis", cache_policy=NONE, retries=0)
def hold_and_analyse_shadow(release: Release) -> Verdict:
    time.sleep(release.params.analysis_interval)
    return release.analyse_shadow()


# --- the person in the loop --------------------------------------------------------------------


def _describe_step(
    release: Release,
    name: str,
    versions: tuple[str, str],
    current: int,
    proposed: int,
    people: str = "",
) -> str:
    last = next((e for e in reversed(release.log.events) if e["kind"] == "analysis"), None)
    figures = last["message"] if last else "no analysis yet"
    timeout = release.params.approval_timeout
    return (
        f"**{name} v{versions[0]}** (champion v{versions[1]}) serves **{current} %** of users.\n\n"
        f"Last analysis: {figures}\n\n"
        + (f"{people}\n\n" if people else "")
        + f"Approve to move to **{proposed} %** (or set another percent above {current}), or "
        f"reject to roll back to 0 % at once. No answer within {timeout} s rolls back.\n\n"
        f"CLI: `tuneloop approve {release.flow_run_id} --approver NAME [--percent N]` or "
        f"`tuneloop reject {release.flow_run_id} --approver NAME --comment WHY`; "
        "figures: `tuneloop status`."
    )


def _watch(release: Release, percent: int, stop: threading.Event) -> None:
    """Keep analysing while the flow waits for a person; roll back and answer for them if needed."""
    while not stop.wait(release.params.analysis_interval):
        try:
            release.analyse(percent)
        except AdminError as error:
            # The rollback itself failed: wake the flow, which tries again and fails loudly.
            _answer_for_the_person(release, f"rollback failed: {error}")
            return
        except Exception:
            # A bookkeeping failure (MLflow unreachable) must not end the watch; the
            # router calls inside already count as failed analyses.
            release.log.logger.exception("analysis at %d %% failed; still watching", percent)
            continue
        if release.rolled_back is not None:
            _answer_for_the_person(release, release.rolled_back)
            return


def _answer_for_the_person(release: Release, reason: str) -> None:
    # Wake the paused flow with a rejection in the controller's name. If a
    # person answered first, the flow still sees `rolled_back` and stops.
    try:
        resume_flow_run(
            UUID(release.flow_run_id),
            run_input={"decision": "reject", "approver": CONTROLLER, "comment": reason},
        )
    except Exception as error:  # already resumed or timed out; the flow checks anyway
        release.log.logger.info("could not answer the pause (%s); the flow checks", error)


def await_approval(
    release: Release,
    current: int,
    proposed: int,
    description: str,
    unsettled: tuple[str, ...] = (),
) -> Approval | None:
    """The person's valid answer, or None when none came within ``approval_timeout``.

    An invalid answer (an approval without the acknowledgement ``unsettled`` rules need
    among them) is logged and the flow pauses again for the time left.
    """
    params = release.params
    form = approval_form(current, proposed, description)
    poll = approval_poll_seconds(params.approval_timeout)
    deadline = time.monotonic() + params.approval_timeout
    stop = threading.Event()
    # The thread needs this run's Prefect settings and context, which live in contextvars.
    context = contextvars.copy_context()
    watcher = threading.Thread(
        target=context.run,
        args=(_watch, release, current, stop),
        name="release-analysis",
        daemon=True,
    )
    watcher.start()
    try:
        while True:
            left = int(deadline - time.monotonic())
            if left < 1:
                return None
            try:
                answer = pause_flow_run(wait_for_input=form, timeout=left, poll_interval=poll)
            except FlowPauseTimeout:
                return None
            try:
                return validate_answer(answer.model_dump(), current, unsettled)
            except InvalidAnswer as error:
                release.log.record(
                    "approval_invalid", str(error), warn=True, answer=answer.model_dump()
                )
    finally:
        stop.set()
        watcher.join()


# --- the people's sign-off before traffic ------------------------------------------------------


class ReviewDone(BaseModel):
    """What a person answers when the blind review has had its votes: look again."""

    approver: str = Field(min_length=1, max_length=100, description="who says so (your name)")
    comment: str = Field(default="", max_length=2000, description="kept with the release")


def await_review(
    release: Release,
    params: Params,
    client: MlflowClient,
    candidate: ModelVersion,
    champion: ModelVersion,
) -> tuple[signoff.ReviewJudgement | None, str | None]:
    """The candidate's blind review, recorded on its run, and why it blocks (None: it does not).

    Without ``gate.blind_review`` an existing review is reported and never blocks. With it,
    the review is created if needed (from the candidate's evaluated answers) and judged; while
    it is unsettled and blocking (too few votes, or inconclusive under ``on_inconclusive:
    block``) the flow pauses for a person to say the reviewers are done, then judges again,
    until ``approval_timeout``. A failed review blocks the release.
    """
    store = ReviewStore()
    rule = params.gate.blind_review
    name = signoff.review_name(candidate.name, str(candidate.version))
    try:
        if rule is not None:
            name = signoff.ensure_review(store, client, candidate, champion)
        judged = signoff.judge_review(store, name, params.gate)
    except signoff.ReviewUnavailable as error:
        release.log.record("review", f"BLOCKED: {error}", warn=True)
        return None, f"blind review: {error}"
    except ReviewError:  # no review of this candidate, and none is required
        release.log.record("review", f"no blind review {name!r} in {store.engine.url!r}")
        return None, None
    finally:
        store.close()
    deadline = time.monotonic() + release.params.approval_timeout
    poll = approval_poll_seconds(release.params.approval_timeout)
    while True:
        signoff.record_review(client, release.log.run_id, judged, candidate)
        check = judged.check
        settled_ok = check is None or check.status == PASS or not check.blocking
        release.log.record(
            "review",
            judged.summary() if check is None else check.reason,
            warn=not settled_ok,
            check=None if check is None else check.model_dump(),
        )
        if check is None or settled_ok:
            return judged, None
        if check.status == FAIL:
            return judged, check.reason
        left = int(deadline - time.monotonic())
        if left < 1:
            return judged, f"no settled blind review within {release.params.approval_timeout} s"
        description = (
            f"The release of **{candidate.name} v{candidate.version}** waits for its blind "
            f"review ({check.reason}). Invite reviewers with `tuneloop review invite NAME "
            f"--review {name}` and serve the page with `tuneloop review serve`; when they have "
            "voted, submit this form (or `tuneloop approve "
            f"{release.flow_run_id} --approver NAME`) and the review is judged again."
        )
        form = RunInput.subclass_from_base_model_type(ReviewDone)
        try:
            pause_flow_run(
                wait_for_input=form.with_initial_data(description=description),
                timeout=left,
                poll_interval=poll,
            )
        except FlowPauseTimeout:
            return judged, f"no settled blind review within {release.params.approval_timeout} s"
        store = ReviewStore()
        try:
            judged = signoff.judge_review(store, name, params.gate)
        finally:
            store.close()


# --- the flow ----------------------------------------------------------------------------------


def _check_routers(admin: RouterAdmin, candidate: str, champion: str) -> dict[str, dict[str, str]]:
    """The arms (base_url, model) of the first replica, after checking every replica's versions."""
    statuses = admin.status()
    for url, status in statuses.items():
        serving = {arm: str(status["arms"][arm]["model_version"]) for arm in (CHAMPION, CHALLENGER)}
        wanted = {CHAMPION: champion, CHALLENGER: candidate}
        if serving != wanted:
            raise ReleaseRefused(
                f"router {url} serves {serving} but the registry says {wanted}: point the "
                "router's arms at those versions (router.yaml) and restart it"
            )
        if status["challenger_percent"] != 0:
            raise ReleaseRefused(
                f"router {url} already sends {status['challenger_percent']} % to the challenger; "
                "a release starts from 0 % (`tuneloop rollback --reason ...`, then run the flow "
                "again)"
            )
        lease = status.get("lease")
        if lease is not None:
            raise ReleaseRefused(
                f"router {url}: another release ({lease['holder']}) holds the lease until "
                f"{lease['expires_at']}; one release at a time (wait, or `tuneloop rollback`)"
            )
        if not status.get("request_ids_signed"):
            raise ReleaseRefused(
                f"router {url} signs no request ids, so no badcase reaches the analysis: start it "
                "with its request_id_secret_env set (the same secret on every replica)"
            )
    first = next(iter(statuses.values()))
    return {
        arm: {k: str(v) for k, v in first["arms"][arm].items()} for arm in (CHAMPION, CHALLENGER)
    }


def _end(
    release: Release,
    outcome: Literal["promoted", "rolled_back", "blocked"],
    reason: str,
) -> Any:
    result = ReleaseOutcome(
        outcome=outcome,
        reason=reason,
        flow_run_id=release.flow_run_id,
        analyses=release.analyses,
        failures=release.failures,
        rollback_seconds=release.rollback_seconds,
        history=release.history,
        approval_form=release.people,
    )
    release.log.tag(status=outcome, reason=reason)
    if outcome == "promoted":
        return result
    message = f"release {outcome.replace('_', ' ')}: {reason}"
    return Failed(message=message, data=ReleaseFailed(message, result))


def roll_back_on_exit(flow: Any, flow_run: FlowRun, state: State[Any]) -> None:
    """Prefect hook for a crashed or cancelled release: challenger to 0 on every router.

    The flow rolls back by itself on any exception it sees; this covers what it
    does not see (a cancellation from the UI, a crash Prefect notices first). A
    process killed outright runs no hook at all: there the lease lapses and
    every router rolls back by itself.
    """
    given = flow_run.parameters or {}
    repo = Path(str(given.get("repo") or ".")).resolve()
    task = given.get("task")
    params = load_params(
        repo / "params.yaml", given.get("overrides"), None if task is None else str(task)
    )
    routers = params.release
    reason = (
        f"release flow run {flow_run.name} ({flow_run.id}) ended {state.name}: "
        f"{state.message or 'no message'}"
    )
    with RouterAdmin.for_release(routers) as admin:
        seconds = admin.rollback(reason)
    # The plain logger: the Prefect API may be what failed, and a hook must not wait on it.
    logging.getLogger(__name__).warning("rolled back in %.0f ms: %s", seconds * 1000, reason)


@flow(name="release", on_crashed=[roll_back_on_exit], on_cancellation=[roll_back_on_exit])
def release(
    repo: Path = Path(), overrides: dict[str, Any] | None = None, task: str | None = None
) -> ReleaseOutcome | State[Any]:
    """Canary the registry's challenger, ramp it with a person's approval, promote or roll back.

    ``overrides``: params.yaml values to use instead for this release (``{"release": {...}}``,
    validated the same way), e.g. the demo's short intervals (configs/demo.yaml).
    ``task``: with ``tasks:`` in params.yaml, the one task to release (its registered model,
    its suites, its router at ``/tasks/<task>``); the other tasks' traffic stays as it is.
    """
    logger = get_run_logger()
    repo = repo.resolve()
    task = task or None  # "" from a project of one task's registration event (prefect.yaml)
    params = load_params(repo / "params.yaml", overrides).the_task(task, "name the task")
    if overrides:
        logger.info("params.yaml overridden for this release: %s", overrides)
    rp = params.release
    name = params.tracking.registered_model
    flow_run_id = str(runtime.flow_run.id or "local")
    # MLflow's default store and lineage reads are relative to the project, as in retrain.
    with contextlib.chdir(repo):
        client = MlflowClient(runs.tracking_uri())
        candidate, champion = registry_pair(client, name)
        cv, pv = str(candidate.version), str(champion.version)
        log = ReleaseLog(
            client, candidate_run(client, candidate, params, logger), flow_run_id, logger
        )
        log.tag(
            flow_run_id=flow_run_id,
            status="running",
            candidate_version=cv,
            champion_version=pv,
            reason="",
        )
        judges = None
        if rp.shadow_percent:
            judges = suite_judges.judges(params.paths.eval_suites, params.evaluate.suites)
        with RouterAdmin.for_release(rp) as admin:
            run = Release(rp, admin, log, flow_run_id, judges)
            try:
                arms = _check_routers(admin, cv, pv)
            except (ReleaseRefused, AdminError) as error:
                log.record("refused", str(error), warn=True)
                log.tag(status="refused", reason=str(error))
                raise
            log.record(
                "start",
                f"{name} v{cv} against champion v{pv}, steps {list(rp.steps)}, "
                f"routers {list(rp.routers)}",
                candidate=cv,
                champion=pv,
                steps=list(rp.steps),
            )
            judged, blocked = await_review(run, params, client, candidate, champion)
            if blocked is not None:
                return _end(run, "blocked", blocked)
            unsettled = signoff.unsettled_rules(candidate, judged)
            if unsettled:
                log.record(
                    "unsettled",
                    f"{len(unsettled)} rule(s) the gate could not settle; every approval needs "
                    "their acknowledgement: " + "; ".join(unsettled),
                    warn=True,
                    rules=list(unsettled),
                )
            run.people = signoff.form_section(judged, list(unsettled))
            run.unsettled = unsettled
            gate = loadtest_gate(run, arms)
            if not gate.passed:
                return _end(run, "blocked", "load test: " + "; ".join(gate.reasons))
            # From here traffic may move: the routers hold this release to its lease.
            with LeaseKeeper(
                admin, flow_run_id, rp.lease_ttl_s, rp.fast_fail.model_dump(), logger
            ) as lease:
                log.record(
                    "lease",
                    f"lease taken on every router: {rp.lease_ttl_s:g} s, renewed every "
                    f"{lease.interval:g} s; fast fail {rp.fast_fail.max_errors} errors in the "
                    f"last {rp.fast_fail.window} challenger requests",
                    ttl_s=rp.lease_ttl_s,
                )
                try:
                    return _ramp(run, name, (cv, pv), client)
                except BaseException as error:
                    # Whatever broke, the challenger must not keep traffic nobody watches.
                    if run.rolled_back is None:
                        reason = f"release flow stopped by {type(error).__name__}: {error}"
                        with contextlib.suppress(AdminError):
                            run.roll_back(reason)
                    raise


def _ramp(run: Release, name: str, versions: tuple[str, str], client: MlflowClient) -> Any:
    """Steps, analyses, approvals: the body of the release once traffic may move."""
    rp = run.params
    if rp.shadow_percent:
        # Only a passing shadow step leads to the first canary step.
        set_shadow(run, rp.shadow_percent, "shadow step")
        passes = 0
        while passes < rp.analyses_per_step:
            verdict = hold_and_analyse_shadow(run)
            if run.rolled_back is not None:
                return _end(run, "rolled_back", "shadow step: " + run.rolled_back)
            passes += verdict.passed
        set_shadow(run, 0, f"shadow step passed {passes} analyses")
    percent = rp.steps[0]
    shift_traffic(run, percent, "canary")
    while True:
        passes = 0
        while passes < rp.analyses_per_step:
            verdict = hold_and_analyse(run, percent)
            if run.rolled_back is not None:
                return _end(run, "rolled_back", run.rolled_back)
            passes += verdict.passed
        proposed = next_step(rp.steps, percent)
        if proposed is None:
            promote(client, name, *versions)
            run.log.record(
                "promote",
                f"{name} v{versions[0]} is champion; v{versions[1]} keeps alias {PREVIOUS!r}. "
                f"Next: make v{versions[0]} the router's champion arm at the next router deploy",
                candidate=versions[0],
                previous=versions[1],
            )
            return _end(run, "promoted", f"v{versions[0]} promoted at 100 %")
        description = _describe_step(run, name, versions, percent, proposed, run.people)
        answer = await_approval(run, percent, proposed, description, run.unsettled)
        if run.rolled_back is not None:  # the analysis thread rolled back during the pause
            return _end(run, "rolled_back", run.rolled_back)
        if answer is None:
            reason = f"no approval within {rp.approval_timeout} s at {percent} %"
            run.log.record("approval_timeout", reason, warn=True)
            run.roll_back(reason)
            return _end(run, "rolled_back", reason)
        run.log.record(
            "approval",
            f"{answer.decision} by {answer.approver} at {percent} %"
            + (f" -> {answer.next_percent} %" if answer.decision == "approve" else "")
            + (f": {answer.comment}" if answer.comment else ""),
            **answer.model_dump(),
        )
        run.log.tag(**{f"approval.{percent}": f"{answer.decision} by {answer.approver}"})
        run.history.append(ApprovalStep(percent=percent, **answer.model_dump()))
        if answer.decision == "reject":
            reason = (
                f"rejected by {answer.approver} at {percent} %: {answer.comment or '(no comment)'}"
            )
            run.roll_back(reason)
            return _end(run, "rolled_back", reason)
        percent = answer.next_percent
        shift_traffic(run, percent, f"approved by {answer.approver}")
