"""A person's answer to a paused release, in one place; rolling back and where a release stands.

- ``Approval`` and ``validate_answer``: the answer and the one check of it, which the
  flow (``flows/release.py``) trusts and the command line runs before sending; the
  flow pauses with ``approval_form``, the form the Prefect UI shows.
- ``approve(flow_run, approver, percent=None)``: resume the paused release flow
  with an approval; without ``percent`` the flow's planned next step applies.
- ``reject(flow_run, approver, comment)``: resume it with a rejection, which
  rolls the challenger back to 0 %. The flow acts on it the next time it asks
  the server (every few seconds); ``wait_rollback`` watches the routers until it
  has, so the CLI can say "rollback requested" and then when it happened.
- ``rollback(params, reason, operator)``: challenger to 0 % on every router in
  ``release.routers`` now, whether or not a release is running or paused; who
  and why go to the routers' logs and state files and, when a release is under
  way, onto its MLflow run.
- ``status(params)``: live weights, the lease and per-arm figures from every
  router, the registry's aliases, and the release runs waiting for an answer.

Both answers go through ``prefect.flow_runs.resume_flow_run(id, run_input=...)``,
exactly what the Prefect UI's form sends, so the server checks them against the
form's schema and the flow checks them again. ``<flow-run>`` is the run's id or
its name (``tuneloop status`` lists the waiting ones).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Literal
from uuid import UUID

import httpx
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from tuneloop.params import Params
from tuneloop.release.admin import AdminError, RouterAdmin
from tuneloop.release.readings import merge, parse_stats
from tuneloop.tracking import aliases, rest, runs

if TYPE_CHECKING:
    from prefect.client.schemas.objects import FlowRun
    from prefect.input import RunInput

logger = logging.getLogger(__name__)

RELEASE_FLOW = "release"
ALIASES = ("champion", "challenger", "previous-champion")


class ApprovalError(RuntimeError):
    """The answer cannot be given; the message says why and what to do."""


class Answered(BaseModel):
    """An answer given to a paused release: the flow run it resumed and what it said.

    ``review done``: the release waited for its blind review, and is told to judge it again.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    flow_run_id: str
    flow_run: str = Field(description="the flow run's name")
    decision: Literal["approve", "reject", "review done"]
    approver: str
    next_percent: int | None = Field(default=None, description="the step approved (approve)")
    comment: str = ""


# --- the answer ----------------------------------------------------------------------------------


class InvalidAnswer(ValueError):
    """A person's answer to the approval form that the flow must not act on; says why."""


class Approval(BaseModel):
    """A person's answer to "ramp the challenger?", validated before anything moves."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    decision: Literal["approve", "reject"] = Field(description="approve the next step or roll back")
    approver: str = Field(min_length=1, max_length=100, description="who decided (your name)")
    next_percent: int = Field(ge=1, le=100, description="challenger percent to move to")
    comment: str = Field(default="", max_length=2000, description="why; kept with the release")
    acknowledge_inconclusive: bool = Field(
        default=False,
        description="I have read every rule the gate could not settle (listed above); an "
        "approval without this tick is refused when there are any",
    )


def validate_answer(
    answer: Mapping[str, Any], current: int, unsettled: Sequence[str] = ()
) -> Approval:
    """The answer as an ``Approval``, checked again here.

    Prefect checks a form against the schema it saved, but a form class made
    with ``RunInput.with_initial_data`` loses its bounds, and an approval may
    come through the REST API as well: the flow trusts only this check.
    ``unsettled``: the rules the gate let through unsettled (``gate.on_inconclusive:
    warn``); an approval must acknowledge them.
    """
    try:
        approval = Approval.model_validate(dict(answer))
    except ValidationError as error:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in error.errors()
        )
        raise InvalidAnswer(f"approval form invalid: {problems}") from None
    if not approval.approver.strip():
        raise InvalidAnswer("approval form invalid: approver is blank; give your name")
    if approval.decision == "approve" and approval.next_percent <= current:
        raise InvalidAnswer(
            f"approval form invalid: next_percent {approval.next_percent} is not above the "
            f"current {current} %; to lower traffic, reject (which rolls back)"
        )
    if approval.decision == "approve" and unsettled and not approval.acknowledge_inconclusive:
        raise InvalidAnswer(
            f"approval refused: the gate could not settle {len(unsettled)} rule(s) and let the "
            "candidate through (gate.on_inconclusive: warn); read them on the form, then tick "
            "acknowledge_inconclusive (`tuneloop approve ... --acknowledge-inconclusive`): "
            + "; ".join(unsettled)
        )
    return approval


def approval_form(current: int, proposed: int, description: str) -> type[RunInput]:
    """The form the Prefect UI shows, with the bounds of this step in its schema.

    Built from ``Approval`` with ``next_percent`` narrowed to (current, 100] and
    defaulting to the planned step. Only the description goes through
    ``with_initial_data``, which would drop the bounds of any field it sets.
    """
    from prefect.input import RunInput  # here: `tuneloop status` never needs Prefect

    base = RunInput.subclass_from_base_model_type(Approval)
    form: type[RunInput] = create_model(
        "ReleaseApproval",
        __base__=base,
        next_percent=(
            int,
            Field(
                default=proposed,
                ge=current + 1,
                le=100,
                description=f"challenger percent to move to (planned: {proposed})",
            ),
        ),
    )
    return form.with_initial_data(description=description)


def approval_poll_seconds(approval_timeout: int) -> int:
    """How often a paused flow asks the server whether it was answered.

    Often enough that a short test timeout is honoured within a second or so,
    rarely enough that a day-long wait costs the server nothing.
    """
    return max(1, min(10, approval_timeout // 60))


# --- from the command line -----------------------------------------------------------------------


# `tuneloop status` answers in about a second: Prefect and MLflow take seconds to import and
# MLflow's SQLite store checks its schema on every open, so status reads both over plain HTTP
# (or SQLite) and imports them only where nothing cheaper can answer.


def prefect_api_url() -> str | None:
    """``$PREFECT_API_URL``, else the active Prefect profile's (which costs Prefect's import)."""
    url = os.environ.get("PREFECT_API_URL")
    if url:
        return url.rstrip("/")
    from prefect.settings import get_current_settings

    found = get_current_settings().api.url
    return found.rstrip("/") if found else None


def _require_server() -> None:
    # Without an API URL every process talks to a throwaway local server of its
    # own, where the paused run does not exist.
    if not prefect_api_url():
        raise ApprovalError(
            "PREFECT_API_URL is not set: point it at the Prefect server the release flow runs "
            "on (e.g. export PREFECT_API_URL=http://127.0.0.1:4200/api)"
        )


def find_flow_run(ref: str) -> FlowRun:
    """A flow run by id, or by name (``brave-otter``)."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
    from prefect.exceptions import ObjectNotFound

    _require_server()
    try:
        run_id: UUID | None = UUID(ref)
    except ValueError:
        run_id = None  # not an id: a name
    with get_client(sync_client=True) as client:
        if run_id is not None:
            try:
                return client.read_flow_run(run_id)
            except ObjectNotFound:
                raise ApprovalError(f"no flow run with id {ref}") from None
        found_runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[ref])), limit=2
        )
    if len(found_runs) != 1:
        found = "none" if not found_runs else "several"
        raise ApprovalError(f"{found} flow runs named {ref!r}; give the flow-run id instead")
    return found_runs[0]


def pending_form(run: FlowRun) -> dict[str, Any]:
    """The JSON schema of the form a paused run waits for (its bounds and planned step)."""
    from prefect import get_client
    from prefect.client.schemas.objects import StateType

    state = run.state
    if state is None or state.type != StateType.PAUSED:
        shown = state.name if state else "no state"
        raise ApprovalError(f"flow run {run.name} ({run.id}) is not waiting for approval: {shown}")
    keyset = state.state_details.run_input_keyset
    if not keyset:
        raise ApprovalError(f"flow run {run.name} is paused but asks for no input")
    with get_client(sync_client=True) as client:
        schema: dict[str, Any] = json.loads(client.read_flow_run_input(run.id, keyset["schema"]))
    return schema


def _answer(
    ref: str,
    decision: str,
    approver: str,
    percent: int | None,
    comment: str,
    acknowledge: bool = False,
) -> Answered:
    from prefect.exceptions import FlowPauseTimeout
    from prefect.flow_runs import resume_flow_run

    run = find_flow_run(ref)
    schema = pending_form(run)
    if "decision" not in schema.get("properties", {}):
        # The release waits for its blind review: "the reviewers are done, judge it again".
        if decision != "approve":
            raise ApprovalError(
                f"flow run {run.name} waits for its blind review, not for an approval: answer "
                "`tuneloop approve` when the reviewers are done (a review that fails blocks it)"
            )
        resume_flow_run(run.id, run_input={"approver": approver, "comment": comment})
        return Answered(
            flow_run_id=str(run.id),
            flow_run=run.name,
            decision="review done",
            approver=approver,
            comment=comment,
        )
    field = schema.get("properties", {}).get("next_percent", {})
    planned, lowest = field.get("default"), field.get("minimum", 1)
    run_input: dict[str, Any] = {"decision": decision, "approver": approver, "comment": comment}
    if acknowledge:
        run_input["acknowledge_inconclusive"] = True
    if percent is not None:
        if not lowest <= percent <= 100:
            raise ApprovalError(
                f"--percent {percent} is out of range for this step: [{lowest}, 100] "
                f"(planned: {planned})"
            )
        run_input["next_percent"] = percent
    # The same model the flow validates with, so a bad answer fails here, not in the flow.
    shown = percent if percent is not None else planned
    Approval.model_validate({**run_input, "next_percent": shown if shown is not None else 100})
    try:
        resume_flow_run(run.id, run_input=run_input)
    except FlowPauseTimeout:
        raise ApprovalError(
            f"flow run {run.name} can no longer be resumed (its approval timed out and it "
            "rolled back)"
        ) from None
    except RuntimeError as error:  # the server refused the input or the state changed
        raise ApprovalError(f"flow run {run.name}: {error}") from None
    return Answered(
        flow_run_id=str(run.id),
        flow_run=run.name,
        decision="approve" if decision == "approve" else "reject",
        approver=approver,
        next_percent=shown,
        comment=comment,
    )


def approve(
    ref: str,
    approver: str,
    percent: int | None = None,
    comment: str = "",
    acknowledge_inconclusive: bool = False,
) -> Answered:
    """Approve the next step of a paused release (``percent``: another step than planned;
    ``acknowledge_inconclusive``: the tick the form needs when the gate left rules unsettled)."""
    return _answer(ref, "approve", approver, percent, comment, acknowledge_inconclusive)


def reject(ref: str, approver: str, comment: str) -> Answered:
    """Reject a paused release: the flow rolls the challenger back to 0 %."""
    if not comment.strip():
        raise ApprovalError("a rejection needs a --comment: it is the rollback's recorded reason")
    return _answer(ref, "reject", approver, None, comment)


def wait_rollback(params: Params, approver: str, timeout: float) -> dict[str, Any] | None:
    """The routers' rollback after ``approver``'s rejection, once every replica shows it.

    Returns the first replica's ``last_change`` (``at``, ``reason``), or None
    when not every replica has rolled back within ``timeout`` seconds. The flow
    records a rejection as the reason "rejected by <approver> at ...".
    """
    rp = params.release
    deadline = time.monotonic() + timeout
    with RouterAdmin.for_release(rp) as admin:
        while True:
            try:
                statuses = admin.status()
            except AdminError as error:
                logger.info("waiting for the rollback: %s", error)
                statuses = {}
            changes = [s.get("last_change") or {} for s in statuses.values()]
            if (
                statuses
                and all(s["challenger_percent"] == 0 for s in statuses.values())
                and all(
                    str(c.get("reason", "")).startswith(f"rejected by {approver} ") for c in changes
                )
            ):
                return dict(changes[0])
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.5)


def rollback(params: Params, reason: str, operator: str) -> dict[str, Any]:
    """Challenger to 0 % on every router replica, recording who and why.

    Raises ``ApprovalError`` when the reason is blank or a router did not take it.
    """
    if not reason.strip():
        raise ApprovalError("a rollback needs a --reason: it is what the routers record")
    if not operator.strip():
        raise ApprovalError("a rollback needs an --operator name")
    rp = params.release
    try:
        with RouterAdmin.for_release(rp) as admin:
            seconds = admin.rollback(reason, operator=operator)
    except AdminError as error:
        raise ApprovalError(str(error)) from None
    return {
        "routers": list(rp.routers),
        "seconds": seconds,
        "operator": operator,
        "reason": reason,
        "release_run": _tag_release_run(params, operator, reason),
    }


def _tag_release_run(params: Params, operator: str, reason: str) -> str | None:
    """Tag the running release's MLflow run (the challenger's) with the rollback; its id or None.

    The routers have already rolled back; a registry that cannot be read costs
    only this tag, so it is reported, not raised.
    """
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from tuneloop.tracking import runs
    from tuneloop.tracking.registry import CHALLENGER, find_alias

    client = MlflowClient(runs.tracking_uri())
    try:
        version = find_alias(params.tracking.registered_model, CHALLENGER, client)
        if version is None or not version.run_id:
            return None
        run = client.get_run(version.run_id)
        if run.data.tags.get("release.status") != "running":
            return None
        at = datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
        for key, value in (
            ("release.rollback.operator", operator),
            ("release.rollback.reason", reason[:5000]),
            ("release.rollback.at", at),
        ):
            client.set_tag(version.run_id, key, value)
    except MlflowException as error:
        logger.warning("rolled back, but could not tag the release run: %s", error.message)
        return None
    return str(version.run_id)


def _prefect_headers() -> dict[str, str]:
    # What the Prefect client sends to a server that asks for credentials.
    if key := os.environ.get("PREFECT_API_KEY"):
        return {"Authorization": f"Bearer {key}"}
    if auth := os.environ.get("PREFECT_API_AUTH_STRING"):
        import base64

        return {"Authorization": "Basic " + base64.b64encode(auth.encode()).decode()}
    return {}


def waiting_releases(states: tuple[str, ...] = ("PAUSED",)) -> list[dict[str, str]]:
    """Release runs paused for an answer, or in ``states`` (``POST /flow_runs/filter``)."""
    url = prefect_api_url()
    if not url:
        raise ApprovalError("PREFECT_API_URL is not set")
    query = {
        "flows": {"name": {"any_": [RELEASE_FLOW]}},
        "flow_runs": {"state": {"type": {"any_": list(states)}}},
        "sort": "START_TIME_DESC",
    }
    try:
        reply = httpx.post(
            f"{url}/flow_runs/filter", json=query, headers=_prefect_headers(), timeout=10
        )
        reply.raise_for_status()
    except httpx.HTTPError as error:
        raise ApprovalError(f"the Prefect API at {url}: {error}") from None
    return [
        {
            "id": str(r["id"]),
            "name": str(r["name"]),
            "since": str((r.get("state") or {}).get("timestamp") or ""),
        }
        for r in reply.json()
    ]


def status(params: Params) -> dict[str, Any]:
    """What `tuneloop status` shows: routers, registry aliases, runs waiting for approval."""
    rp = params.release
    result: dict[str, Any] = {}
    try:
        with RouterAdmin.for_release(rp) as admin:
            statuses, stats = admin.status(), admin.stats()
        merged = merge([parse_stats(s) for s in stats.values()])
        result["routers"] = {
            url: {
                "weights": s["weights"],
                "versions": {arm: a["model_version"] for arm, a in s["arms"].items()},
                "last_change": s["last_change"],
                "lease": s.get("lease"),
            }
            for url, s in statuses.items()
        }
        result["arms"] = {
            arm: {
                "requests": f.requests,
                "error_rate": f.error_rate,
                "badcase_rate": f.badcase_rate,
                "latency_p99_ms": f.latency_p99_ms,
                "ttft_p99_ms": f.ttft_p99_ms,
            }
            for arm, f in merged.arms.items()
        }
    except (AdminError, ValueError) as error:
        result["routers_error"] = str(error)
    result["aliases"] = registry_aliases(params.tracking.registered_model)
    aliases = result["aliases"]
    if isinstance(aliases, dict) and "challenger" in aliases:
        result["challenger_tags"] = version_tags(
            params.tracking.registered_model, aliases["challenger"]
        )
    try:
        result["waiting_for_approval"] = waiting_releases()
    except ApprovalError as error:
        result["waiting_for_approval_error"] = str(error)
    return result


def registry_aliases(name: str) -> dict[str, str] | str:
    """``{alias: version}`` of registered model ``name``, or why they cannot be read.

    The store is ``tuneloop.tracking.runs.tracking_uri()``'s: ``$MLFLOW_TRACKING_URI``, else the
    project's ``mlflow.db``, read without MLflow where it can be (``tuneloop.tracking.aliases``).
    """
    try:
        found = _read_registry(
            lambda: aliases.aliases(name), lambda c: c.get_registered_model(name).aliases
        )
    except (aliases.CannotTell, rest.RestError, OSError) as error:
        return f"registered model {name!r}: {error}"
    return {alias: str(version) for alias, version in found.items()} or (
        f"registered model {name!r}: no aliases"
    )


# The version tags `tuneloop status` shows (tuneloop.tracking.registry, tuneloop.release.signoff).
STATUS_TAGS = ("gate.on_inconclusive", "gate.unsettled", "review.result")


def version_tags(name: str, version: str) -> dict[str, str] | str:
    """The ``STATUS_TAGS`` of ``name`` v``version``, or why they cannot be read."""
    try:
        found = _read_registry(
            lambda: aliases.version_tags(name, version),
            lambda c: c.get_model_version(name, version).tags,
        )
    except (aliases.CannotTell, rest.RestError, OSError, ValueError) as error:
        return f"{name} v{version}: cannot read its tags: {error}"
    return {k: str(v) for k, v in found.items() if k in STATUS_TAGS}


def _read_registry(
    directly: Callable[[], dict[str, str]], through_mlflow: Callable[[Any], Mapping[str, Any]]
) -> Mapping[str, Any]:
    """``directly`` (SQLite or REST, no MLflow import), else through ``MlflowClient`` for a
    store only MLflow reads (another database); a store that does not exist yet stays so."""
    try:
        return directly()
    except aliases.NoStore:
        raise
    except aliases.CannotTell:
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        try:
            return through_mlflow(MlflowClient(runs.tracking_uri()))
        except MlflowException as error:
            raise aliases.CannotTell(error.message) from error


def _challenger_lines(tags: dict[str, str] | str) -> list[str]:
    if isinstance(tags, str):
        return [f"          {tags}"]
    lines = [f"          review: {tags.get('review.result', 'none yet')}"]
    unsettled = [line for line in tags.get("gate.unsettled", "").splitlines() if line.strip()]
    if unsettled:
        lines.append(
            f"          unsettled: {len(unsettled)} rule(s) let through "
            "(gate.on_inconclusive: warn); approve with --acknowledge-inconclusive:"
        )
        lines += [f"            - {line}" for line in unsettled]
    return lines


def _cell(value: float | None, spec: str, unit: str = "") -> str:
    return "-" if value is None else format(value, spec) + unit


def format_status(result: dict[str, Any]) -> str:
    """The status as a few lines and one table for a terminal; ``-`` where there is no figure."""
    lines = []
    if "routers_error" in result:
        lines.append(f"routers   unavailable: {result['routers_error']}")
    for url, router in result.get("routers", {}).items():
        w, v = router["weights"], router["versions"]
        lines.append(
            f"router    {url}: champion v{v['champion']} at {w['champion']} %, "
            f"challenger v{v['challenger']} at {w['challenger']} %"
        )
        change = router.get("last_change")
        if change:
            was = "" if change.get("from") is None else f"{change['from']} -> "
            by = f" by {change['operator']}" if change.get("operator") else ""
            lines.append(
                f"          last change: {change['action']} {was}{change['to']} % "
                f"at {change['at']}{by} ({change['reason'] or 'no reason given'})"
            )
        lease = router.get("lease")
        if lease:
            lines.append(
                f"          lease: held by {lease['holder']} until {lease['expires_at']} "
                f"({lease['seconds_left']:.0f} s left)"
            )
        else:
            lines.append("          lease: none (no release holds this router)")
    arms = result.get("arms", {})
    if arms:
        header = ("arm", "requests", "errors", "badcases", "p99 latency", "p99 TTFT")
        rows = [
            (
                arm,
                str(f["requests"]),
                _cell(f["error_rate"], ".2%"),
                _cell(f["badcase_rate"], ".2%"),
                _cell(f["latency_p99_ms"], ".0f", " ms"),
                _cell(f["ttft_p99_ms"], ".0f", " ms"),
            )
            for arm, f in arms.items()
        ]
        widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
        lines.append("")
        for row in (header, *rows):
            cells = [row[0].ljust(widths[0])] + [
                cell.rjust(width) for cell, width in zip(row[1:], widths[1:], strict=True)
            ]
            lines.append("  ".join(cells))
        lines.append("")
    aliases = result.get("aliases")
    if isinstance(aliases, dict):
        shown = ", ".join(f"{a} v{aliases[a]}" for a in ALIASES if a in aliases) or "none"
        lines.append(f"registry  {shown}")
        if "challenger_tags" in result:
            lines += _challenger_lines(result["challenger_tags"])
    else:
        lines.append(f"registry  {aliases}")
    waiting = result.get("waiting_for_approval")
    if waiting:
        for run in waiting:
            lines.append(
                f"waiting   {run['name']} ({run['id']}) since {run['since']}: "
                f"tuneloop approve {run['id']} --approver NAME"
            )
    elif waiting is not None:
        lines.append("waiting   no release is waiting for approval")
    else:
        lines.append(f"waiting   unknown: {result.get('waiting_for_approval_error')}")
    return "\n".join(lines)
