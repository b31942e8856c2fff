"""Answer a paused release from the command line, roll back, and show where a release stands.

- ``approve(flow_run, approver, percent=None)``: resume the paused release flow
  with an approval; without ``percent`` the flow's planned next step applies.
- ``reject(flow_run, approver, comment)``: resume it with a rejection, which
  rolls the challenger back to 0 %.
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
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

from prefect import get_client
from prefect.client.schemas.filters import (
    FlowFilter,
    FlowFilterName,
    FlowRunFilter,
    FlowRunFilterName,
    FlowRunFilterState,
    FlowRunFilterStateType,
)
from prefect.client.schemas.objects import FlowRun, StateType
from prefect.exceptions import FlowPauseTimeout, ObjectNotFound
from prefect.flow_runs import resume_flow_run
from prefect.settings import get_current_settings

from tuneloop.params import Params
from tuneloop.release.admin import AdminError, RouterAdmin
from tuneloop.release.analysis import Approval, merge, parse_stats

logger = logging.getLogger(__name__)

RELEASE_FLOW = "release"
ALIASES = ("champion", "challenger", "previous-champion")


class ApprovalError(RuntimeError):
    """The answer cannot be given; the message says why and what to do."""


def _require_server() -> None:
    # Without an API URL every process talks to a throwaway local server of its
    # own, where the paused run does not exist.
    if not get_current_settings().api.url:
        raise ApprovalError(
            "PREFECT_API_URL is not set: point it at the Prefect server the release flow runs "
            "on (e.g. export PREFECT_API_URL=http://127.0.0.1:4200/api)"
        )


def find_flow_run(ref: str) -> FlowRun:
    """A flow run by id, or by name (``brave-otter``)."""
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
        runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[ref])), limit=2
        )
    if len(runs) != 1:
        found = "none" if not runs else "several"
        raise ApprovalError(f"{found} flow runs named {ref!r}; give the flow-run id instead")
    return runs[0]


def pending_form(run: FlowRun) -> dict[str, Any]:
    """The JSON schema of the form a paused run waits for (its bounds and planned step)."""
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
    ref: str, decision: str, approver: str, percent: int | None, comment: str
) -> dict[str, Any]:
    run = find_flow_run(ref)
    schema = pending_form(run)
    field = schema.get("properties", {}).get("next_percent", {})
    planned, lowest = field.get("default"), field.get("minimum", 1)
    run_input: dict[str, Any] = {"decision": decision, "approver": approver, "comment": comment}
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
    return {
        "flow_run_id": str(run.id),
        "flow_run": run.name,
        "decision": decision,
        "approver": approver,
        "next_percent": shown,
        "comment": comment,
    }


def approve(
    ref: str, approver: str, percent: int | None = None, comment: str = ""
) -> dict[str, Any]:
    """Approve the next step of a paused release (``percent``: another step than planned)."""
    return _answer(ref, "approve", approver, percent, comment)


def reject(ref: str, approver: str, comment: str) -> dict[str, Any]:
    """Reject a paused release: the flow rolls the challenger back to 0 %."""
    if not comment.strip():
        raise ApprovalError("a rejection needs a --comment: it is the rollback's recorded reason")
    return _answer(ref, "reject", approver, None, comment)


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
        with RouterAdmin.from_env(rp.routers, rp.admin_token_env) as admin:
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

    from tuneloop import tracking
    from tuneloop.registry import CHALLENGER, find_alias

    client = MlflowClient(tracking.tracking_uri())
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


def waiting_releases() -> list[dict[str, str]]:
    """Release runs paused for an answer, newest first."""
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            flow_filter=FlowFilter(name=FlowFilterName(any_=[RELEASE_FLOW])),
            flow_run_filter=FlowRunFilter(
                state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.PAUSED]))
            ),
        )
    return [
        {"id": str(r.id), "name": r.name, "since": str(r.state.timestamp if r.state else "")}
        for r in runs
    ]


def status(params: Params) -> dict[str, Any]:
    """What `tuneloop status` shows: routers, registry aliases, runs waiting for approval."""
    rp = params.release
    result: dict[str, Any] = {}
    try:
        with RouterAdmin.from_env(rp.routers, rp.admin_token_env) as admin:
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
    result["aliases"] = _aliases(params)
    if get_current_settings().api.url:
        result["waiting_for_approval"] = waiting_releases()
    else:
        result["waiting_for_approval_error"] = "PREFECT_API_URL is not set"
    return result


def _aliases(params: Params) -> dict[str, str] | str:
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from tuneloop import tracking

    name = params.tracking.registered_model
    try:
        model = MlflowClient(tracking.tracking_uri()).get_registered_model(name)
    except MlflowException as error:
        return f"registered model {name!r}: {error.message}"
    return {alias: str(v) for alias, v in model.aliases.items()}


def format_status(result: dict[str, Any]) -> str:
    """The status as a few lines for a terminal."""
    lines = []
    if "routers_error" in result:
        lines.append(f"routers   unavailable: {result['routers_error']}")
    for url, router in result.get("routers", {}).items():
        w, v = router["weights"], router["versions"]
        lines.append(
            f"router    {url}: champion v{v['champion']} {w['champion']} %, "
            f"challenger v{v['challenger']} {w['challenger']} %"
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
                f"({lease['seconds_left']:g} s left)"
            )
        else:
            lines.append("          lease: none (no release holds this router)")

    def fmt(value: float | None, spec: str) -> str:
        return "n/a" if value is None else format(value, spec)

    for arm, f in result.get("arms", {}).items():
        lines.append(
            f"{arm:<10}{f['requests']} requests, errors {fmt(f['error_rate'], '.2%')}, "
            f"badcases {fmt(f['badcase_rate'], '.2%')}, p99 {fmt(f['latency_p99_ms'], '.0f')} ms, "
            f"TTFT p99 {fmt(f['ttft_p99_ms'], '.0f')} ms"
        )
    aliases = result.get("aliases")
    if isinstance(aliases, dict):
        shown = ", ".join(f"{a} v{aliases[a]}" for a in ALIASES if a in aliases) or "none"
        lines.append(f"registry  {shown}")
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
