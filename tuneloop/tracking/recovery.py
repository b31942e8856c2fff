"""Closing the MLflow runs a killed flow left open.

A flow whose process was killed (its worker stopped, its machine lost: Prefect marks the
flow run Crashed, see tuneloop/orchestration/schedule.py) cannot end its MLflow runs;
they stay RUNNING in the experiment and look alive forever. At the next start of the same pipeline,
:func:`close_killed_runs` finds its RUNNING runs whose Prefect flow run is over (or unknown
to the server) and ends each, with its RUNNING child runs, as KILLED, tagged with the
reason. A run whose flow run is still going (a pilot beside a sweep, a run on another
worker) is left alone.

A stage that resumes in a new run (the train stage continues from the killed run's
checkpoint) names the run it continues: ``tracking.TAG_RESUMES``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from uuid import UUID

from mlflow.entities import Run
from mlflow.tracking import MlflowClient

from tuneloop.tracking import runs

log = logging.getLogger(__name__)

# Prefect state types of a flow run that may still write to its MLflow runs.
LIVE_STATES = frozenset({"SCHEDULED", "PENDING", "RUNNING", "PAUSED", "CANCELLING"})


def flow_run_state(flow_run_id: str) -> str | None:
    """The Prefect flow run's state type (``RUNNING``, ``CRASHED``...); None when unknown."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    try:
        key = UUID(flow_run_id)
    except ValueError:
        return None
    with get_client(sync_client=True) as client:
        try:
            found = client.read_flow_run(key)
        except ObjectNotFound:
            return None
    return found.state.type.value if found.state else None


def _running_children(client: MlflowClient, run: Run) -> list[Run]:
    """Every RUNNING run below ``run`` (stage runs; a sweep's experiment runs and theirs)."""
    below: list[Run] = []
    parents = [run.info.run_id]
    while parents:
        parent = parents.pop()
        found = client.search_runs(
            [run.info.experiment_id],
            filter_string=(
                f"tags.`{runs.TAG_PARENT}` = '{parent}' and attributes.status = 'RUNNING'"
            ),
        )
        below.extend(found)
        parents.extend(child.info.run_id for child in found)
    return below


def close_killed_runs(
    experiment_id: str,
    pipeline: str,
    current_flow_run: str,
    state_of: Callable[[str], str | None] = flow_run_state,
    client: MlflowClient | None = None,
) -> list[str]:
    """End as KILLED the RUNNING runs of ``pipeline`` whose flow run is over; say which.

    ``state_of`` looks a flow run's state type up (Prefect's server by default).
    """
    client = client or MlflowClient()
    found = client.search_runs(
        [experiment_id],
        filter_string=(
            f"attributes.status = 'RUNNING' and tags.`{runs.TAG_PIPELINE}` = '{pipeline}'"
        ),
    )
    said: list[str] = []
    for run in found:
        flow_run_id = run.data.tags.get(runs.TAG_FLOW_RUN, "")
        if not flow_run_id or flow_run_id == current_flow_run:
            continue
        state = state_of(flow_run_id)
        if state in LIVE_STATES:
            continue
        where = f"is {state}" if state else "is unknown to the Prefect server"
        reason = (
            f"its Prefect flow run {flow_run_id} {where}; closed when {pipeline} flow run "
            f"{current_flow_run or '(none)'} started"
        )
        ended = [run, *_running_children(client, run)]
        for each in ended:
            client.set_tag(each.info.run_id, runs.TAG_KILLED, reason)
            client.set_terminated(each.info.run_id, status="KILLED")
        said.append(
            f"marked {len(ended)} MLflow run(s) KILLED, {run.info.run_name or run.info.run_id} "
            f"({run.info.run_id}) and its stages still RUNNING: {reason}"
        )
        log.warning(said[-1])
    return said
