"""What the release flow and operators read and set: ``/admin/*`` and ``/metrics``.

Every ``/admin`` endpoint needs the admin token (``serving.auth``). A change to the
weight or the lease is saved to the state file before it applies, under the admin lock;
a rollback applies first and is saved after, so it holds from the very next request
even while a slow save holds the lock. ``/metrics`` is open, for Prometheus.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from serving.auth import ADMIN
from serving.limits import Body, Refused, read_model
from serving.metrics import render_prometheus
from serving.router_state import Live, RouterState, change, logger
from serving.routing import FastFail, Lease, utc_iso
from serving.samples import MAX_PAGE
from tuneloop.release import ARMS

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

router = APIRouter()


class _Body(BaseModel):
    # Strict: "10" is not a percent; a wrong type is the caller's bug, said at once.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class WeightsRequest(_Body):
    challenger_percent: int = Field(ge=0, le=100)
    reason: str = Field(default="", max_length=1000)
    operator: str | None = Field(default=None, min_length=1, max_length=100)


class RollbackRequest(_Body):
    reason: str = Field(
        min_length=1, max_length=1000, description="why; logged and kept in the state file"
    )
    operator: str | None = Field(
        default=None, min_length=1, max_length=100, description="who; kept beside the reason"
    )


class FastFailRule(_Body):
    window: int = Field(ge=1, le=10_000)
    max_errors: int = Field(ge=1, le=10_000)


class ShadowRequest(_Body):
    percent: int = Field(ge=0, le=100, description="share of users whose requests are mirrored")
    reason: str = Field(default="", max_length=1000)


class LeaseRequest(_Body):
    holder: str = Field(min_length=1, max_length=200, description="the release (flow run) id")
    ttl_s: float = Field(ge=1, le=7 * 24 * 3600, description="lapses this long after the call")
    fast_fail: FastFailRule | None = None


class LeaseEnd(_Body):
    holder: str = Field(min_length=1, max_length=200)
    reason: str = Field(default="", max_length=1000)


async def order_of(state: RouterState, request: Request, model: type[Body]) -> Body:
    """An admin body, under the admin size limit."""
    limits = state.config.limits
    return await read_model(request, model, limits.admin_bytes, limits.json_depth)


def status(state: RouterState) -> dict[str, object]:
    """What ``/admin/status`` and every admin change answer: weights, arms, lease, why."""
    config = state.config
    p = state.challenger_percent
    return {
        "public_model": config.public_model,
        "challenger_percent": p,
        "weights": {"champion": 100 - p, "challenger": p},
        "arms": {
            arm: {
                "base_url": config.arms[arm].base_url,
                "model": config.arms[arm].model,
                "model_version": config.arms[arm].model_version,
            }
            for arm in ARMS
        },
        "shadow_percent": state.shadow_percent,
        "last_change": state.last_change,
        "lease": None if state.lease is None else state.lease.as_json(state.clock.time()),
        "request_ids_signed": state.ids.signing,
        "feedback_producers": [p.name for p in config.feedback_producers],
    }


def not_saved(state: RouterState, what: str, error: OSError) -> JSONResponse:
    state_file = state.config.state_file
    logger.exception("could not save the router state to %s", state_file)
    return JSONResponse({"detail": f"{what}: cannot write {state_file}: {error}"}, status_code=500)


def overtaken() -> JSONResponse:
    # A rollback landed while this change was being saved; it wins (its own
    # save runs after this one, under the same lock).
    return JSONResponse(
        {"detail": "a rollback happened meanwhile; this change was not applied"},
        status_code=409,
    )


@router.get("/metrics")
async def metrics(state: Live) -> PlainTextResponse:
    text = render_prometheus(state.stats, state.versions(), state.challenger_percent, state.refused)
    return PlainTextResponse(text, media_type=PROMETHEUS_CONTENT_TYPE)


@router.get("/admin/status", dependencies=ADMIN)
async def admin_status(state: Live) -> dict[str, object]:
    return status(state)


@router.get("/admin/stats", dependencies=ADMIN)
async def admin_stats(state: Live) -> dict[str, object]:
    config = state.config
    return {
        "challenger_percent": state.challenger_percent,
        "stats_window": config.stats_window,
        "arms": {
            arm: {"model_version": config.arms[arm].model_version, **s.as_json()}
            for arm, s in state.stats.items()
        },
        "refused": [
            {"endpoint": endpoint, "status": code, "count": n}
            for (endpoint, code), n in sorted(state.refused.items())
        ],
    }


@router.get("/admin/samples", dependencies=ADMIN)
async def admin_samples(
    state: Live,
    since: Annotated[int, Query(ge=0)] = 0,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = MAX_PAGE,
) -> dict[str, object]:
    """Finished requests numbered above ``since`` (a cursor), for one analysis interval."""
    page = state.samples.ring.read(since, limit)
    return {"challenger_percent": state.challenger_percent, **page}


@router.get("/admin/shadow", dependencies=ADMIN)
async def admin_shadow_pairs(
    state: Live,
    since: Annotated[int, Query(ge=0)] = 0,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = MAX_PAGE,
) -> dict[str, object]:
    """Mirrored requests' answer pairs numbered above ``since``."""
    page = state.shadow.read(since, limit)
    return {
        "shadow_percent": state.shadow_percent,
        "challenger_percent": state.challenger_percent,
        "skipped": state.shadow_skipped,
        **page,
    }


@router.post("/admin/shadow", dependencies=ADMIN)
async def set_shadow(request: Request, state: Live) -> JSONResponse:
    """Mirror a share of users' requests to the challenger (0: stop). Not saved: a
    restarted router mirrors nothing until the release sets it again."""
    order = await order_of(state, request, ShadowRequest)
    before = state.shadow_percent
    state.shadow_percent = order.percent
    logger.info("shadow_percent %d -> %d (%s)", before, order.percent, order.reason)
    return JSONResponse(status(state))


@router.post("/admin/weights", dependencies=ADMIN)
async def set_weights(request: Request, state: Live) -> JSONResponse:
    update = await order_of(state, request, WeightsRequest)
    async with state.admin_lock:
        before = state.challenger_percent
        rollbacks = state.rollbacks
        done = change(
            "weights",
            before,
            update.challenger_percent,
            update.reason,
            update.operator,
            state.clock.time(),
        )
        # Saved before it applies: a weight the router could not keep across
        # a restart is refused now rather than silently lost later.
        try:
            await state.persist(state.saved(update.challenger_percent, state.lease, done))
        except OSError as error:
            return not_saved(state, "weight unchanged", error)
        if state.rollbacks != rollbacks:
            return overtaken()
        state.challenger_percent = update.challenger_percent
        state.last_change = done
        logger.info(
            "challenger_percent %d -> %d (%s)", before, update.challenger_percent, update.reason
        )
        return JSONResponse(status(state))


@router.post("/admin/rollback", dependencies=ADMIN)
async def rollback(request: Request, state: Live) -> JSONResponse:
    order = await order_of(state, request, RollbackRequest)
    # Applied first and without waiting for the admin lock: the next request
    # must reach the champion even while a weight change or a slow disk holds it.
    state.roll_back_now("rollback", order.reason, order.operator)
    async with state.admin_lock:
        try:
            await state.persist(state.saved(0, None))
        except OSError as error:
            state_file = state.config.state_file
            logger.exception("rollback is in effect but not saved to %s", state_file)
            return JSONResponse(
                {
                    "detail": f"rolled back (in effect now) but cannot write "
                    f"{state_file}: {error}; fix it before the router restarts",
                    **status(state),
                },
                status_code=500,
            )
    return JSONResponse(status(state))


@router.post("/admin/lease", dependencies=ADMIN)
async def take_lease(request: Request, state: Live) -> JSONResponse:
    """Take or renew the release's lease on the canary weight."""
    claim = await order_of(state, request, LeaseRequest)
    rule = claim.fast_fail
    if rule is not None and rule.max_errors > rule.window:
        raise Refused(400, "fast_fail.max_errors is more than fast_fail.window", "invalid_body")
    async with state.admin_lock:
        now = state.clock.time()
        held = state.lease
        if held is not None and held.holder != claim.holder and held.expires_at > now:
            raise Refused(
                409,
                f"the lease is held by {held.holder} until {utc_iso(held.expires_at)}: one "
                "release at a time (roll back, or wait for it to end or lapse)",
                "lease_held",
            )
        lease = Lease(
            claim.holder,
            claim.ttl_s,
            now + claim.ttl_s,
            None if rule is None else FastFail(rule.window, rule.max_errors),
        )
        rollbacks = state.rollbacks
        try:
            await state.persist(state.saved(state.challenger_percent, lease))
        except OSError as error:
            return not_saved(state, "lease not taken", error)
        if state.rollbacks != rollbacks:
            return overtaken()
        if held is None or held.holder != lease.holder:
            logger.info(
                "lease taken by %s for %g s (fast fail: %s)", lease.holder, lease.ttl_s, rule
            )
        state.set_lease(lease)
        return JSONResponse(status(state))


@router.post("/admin/lease/release", dependencies=ADMIN)
async def end_lease(request: Request, state: Live) -> JSONResponse:
    """The holder ends its lease; the weight stays where it is (e.g. 100 % after a promote)."""
    end = await order_of(state, request, LeaseEnd)
    async with state.admin_lock:
        held = state.lease
        if held is None:
            return JSONResponse(status(state))
        if held.holder != end.holder:
            raise Refused(
                409, f"the lease is held by {held.holder}, not {end.holder}", "lease_held"
            )
        try:
            await state.persist(state.saved(state.challenger_percent, None))
        except OSError as error:
            return not_saved(state, "lease kept", error)
        state.set_lease(None)
        logger.info("lease of %s ended: %s", held.holder, end.reason or "no reason given")
        return JSONResponse(status(state))
