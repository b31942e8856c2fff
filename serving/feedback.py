"""``POST /v1/feedback``: a producer flags an answer, and it becomes next month's badcase.

In this order: the producer's token (401), its rate (429), the body's size and shape
(413, 400), the request id's signature (an id another task of the same router signed: 409,
nothing written, so a flag only ever trains the task that answered it), then the scrubbed
line is written (``serving.badcases``) and, when the id attributes it to an arm's current
model version, counted against that arm for the release analysis.
"""

from __future__ import annotations

from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse

from serving.attribution import Attribution
from serving.auth import Producer
from serving.badcases import FeedbackRequest, badcase_record, check_sizes, encode_line
from serving.limits import Refused, read_model
from serving.router_state import Live, RouterState, logger
from tuneloop.data.records import InvalidRecord
from tuneloop.release import ARMS

FEEDBACK = "/v1/feedback"

router = APIRouter()


@router.post(FEEDBACK, status_code=201)
async def feedback(request: Request, state: Live, producer: Producer) -> JSONResponse:
    config, limits = state.config, state.config.limits
    state.buckets[producer].spend(state.clock.monotonic())
    flag = await read_model(request, FeedbackRequest, limits.feedback_bytes, limits.json_depth)
    check_sizes(flag, limits)
    attribution: Attribution | None = None
    why = "no request_id given"
    if flag.request_id is not None:
        attribution, why = state.ids.verify(flag.request_id)
        if attribution is None:
            refuse_another_tasks(state, flag.request_id)
    if attribution is not None and attribution.arm not in ARMS:
        why = f"request id names no arm of this router ({attribution.arm})"
        attribution = None
    # Claimed before any await, so two concurrent flags of one id cannot both count.
    if attribution is not None and not state.flagged_ids.add(attribution.nonce):
        attribution, why = None, "this request id was already flagged; it counts once"
    created_at = datetime.now(UTC)
    arm, version = (attribution.arm, attribution.model_version) if attribution else (None, None)

    def scrub_and_write() -> tuple[dict[str, object], Counter[str], Path]:
        # Off the event loop: scrubbing a flag at the size limits takes tens of ms.
        record, found = badcase_record(flag, producer, arm, version, created_at)
        return record, found, state.writer.append(encode_line(record, limits), created_at)

    written = False
    try:
        record, found, path = await run_in_threadpool(scrub_and_write)
        written = True
    except InvalidRecord as error:
        # Ingest would quarantine it next month; say why now, while it can be fixed.
        raise Refused(422, str(error), error.kind) from None
    finally:
        if attribution is not None and not written:
            state.flagged_ids.discard(attribution.nonce)  # not written: it may come again
    counted = False
    if attribution is not None:
        arm = attribution.arm
        # A flag on an older model version is still its training data, but
        # not evidence against the version this arm serves now.
        if attribution.model_version == config.arms[arm].model_version:
            counted = True
            state.stats[arm].badcases += 1
            if state.flagged_users[arm].add(attribution.user_key):
                state.stats[arm].badcase_users += 1
            # The request's own sample too, so its interval's analysis sees it. The
            # analysis counts flagged users among the interval's users, per arm: a user
            # counted once "ever" instead made the champion's users, flagged before the
            # canary began, count for nothing in it, and a challenger as wrong as the
            # champion looked three times worse (the demo's first release rolled back).
            state.samples.flag(str(flag.request_id))
    else:
        logger.info("feedback from %s written unattributed: %s", producer, why)
    return JSONResponse(
        {
            "arm": record["arm"],
            "model_version": record["model_version"],
            "attributed": attribution is not None,
            "counted": counted,
            "why_not": None if attribution is not None else why,
            "source": producer,
            "pii_scrubbed": dict(found),
            "file": path.name,
        },
        status_code=201,
    )


def refuse_another_tasks(state: RouterState, request_id: str) -> None:
    """Refuse (409) a flag whose request id another task's router signed: that task answered
    it, so it is that task's badcase, and written here it would train this task on it."""
    for task, ids in state.sibling_ids.items():
        if ids.signed(request_id):
            raise Refused(
                409,
                f"request id was issued for task {task!r}, not this one: nothing was written; "
                f"send the flag to /tasks/{task}{FEEDBACK}",
                "wrong_task",
            )
