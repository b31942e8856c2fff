"""The live state of one router process, and the changes to its weight.

``RouterState`` holds what the endpoints share: the weight, the lease, the counters,
the request-id keys, the backend pools. ``create_app`` keeps it on ``app.state.router``;
an endpoint reaches it by taking a parameter ``state: Live``, or, on the proxied path,
with ``state_of(request)``.

Everything here runs on the router's event loop, so plain objects suffice. A rollback
(by an operator, a lapsed lease, a burst of challenger errors) sets the challenger to 0
before anything else, so the very next request reaches the champion; saving it to the
state file comes after, under ``admin_lock``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import Counter
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import httpx
from fastapi import Depends, Request
from fastapi.concurrency import run_in_threadpool

from serving.attribution import RequestIds, SeenKeys
from serving.badcases import FeedbackWriter
from serving.clock import SYSTEM, Clock
from serving.config import RouterConfig
from serving.limits import TokenBucket
from serving.metrics import ArmStats, new_stats
from serving.routing import (
    ErrorBurst,
    Lease,
    SavedState,
    load_state,
    save_state,
    starting_state,
    utc_iso,
)
from serving.samples import Ring, SampleLog, ShadowPair
from tuneloop.release import ARMS

# One logger for the whole router, whichever module writes: operators and tests
# filter on this name, as they did when the router was one module.
logger = logging.getLogger("serving.router")

# How often the router looks at its lease when none is about to lapse.
LEASE_TICK_S = 0.5


def change(
    action: str,
    before: int | None,
    after: int,
    reason: str,
    operator: str | None = None,
    at: float | None = None,
) -> dict[str, Any]:
    """A weight change as ``/admin/status`` shows it and the state file keeps it; ``at``, the
    router's clock (None: now)."""
    return {
        "action": action,
        "from": before,
        "to": after,
        "reason": reason,
        "operator": operator,
        "at": utc_iso(time.time() if at is None else at),
    }


@dataclass
class RouterState:
    """The live objects of one router process."""

    config: RouterConfig
    challenger_percent: int
    stats: dict[str, ArmStats]
    samples: SampleLog
    shadow: Ring[ShadowPair]
    writer: FeedbackWriter
    ids: RequestIds
    flagged_ids: SeenKeys
    flagged_users: dict[str, SeenKeys]
    buckets: dict[str, TokenBucket]
    # The backends: their pools exist while the app runs (its lifespan opens and closes them).
    clients: dict[str, httpx.AsyncClient] = field(default_factory=dict)
    urls: dict[tuple[str, str], httpx.URL] = field(default_factory=dict)
    last_change: dict[str, Any] | None = None
    lease: Lease | None = None
    burst: ErrorBurst | None = None
    rollbacks: int = 0
    shadow_percent: int = 0
    shadow_skipped: int = 0  # requests not mirrored because `shadow.concurrency` were in flight
    mirrors: set[asyncio.Task[None]] = field(default_factory=set)
    backend_failures: Counter[tuple[str, str]] = field(default_factory=Counter)
    backend_warned: dict[tuple[str, str], float] = field(default_factory=dict)
    refused: Counter[tuple[str, int]] = field(default_factory=Counter)
    admin_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    background: set[asyncio.Task[None]] = field(default_factory=set)
    # The request-id keys of the other tasks one router serves (serving.tasks), by task: a
    # flag whose id one of them signed is that task's, never this one's training data.
    sibling_ids: dict[str, RequestIds] = field(default_factory=dict)
    clock: Clock = SYSTEM
    # Times the lease watch has looked at the lease: a test waits for a look, not a while.
    lease_looks: int = 0

    def versions(self) -> dict[str, str]:
        return {arm: self.config.arms[arm].model_version for arm in ARMS}

    def saved(
        self, percent: int, lease: Lease | None, why: dict[str, Any] | None = None
    ) -> SavedState:
        """The state file's content for this weight and lease, with the (last) change's why."""
        why = why or self.last_change or {}
        return SavedState(
            challenger_percent=percent,
            arms=self.versions(),
            action=str(why.get("action", "config")),
            reason=str(why.get("reason", "")),
            operator=why.get("operator"),
            lease=lease,
            changed_at=str(why.get("at") or ""),
            changed_from=why.get("from"),
            updated_at=utc_iso(self.clock.time()),
        )

    def record_change(
        self, action: str, before: int | None, after: int, reason: str, operator: str | None = None
    ) -> None:
        self.last_change = change(action, before, after, reason, operator, self.clock.time())

    def set_lease(self, lease: Lease | None) -> None:
        """The lease, and a fresh fast-fail window whenever its holder or rule changes."""
        held = self.lease
        self.lease = lease
        if lease is None or lease.fast_fail is None:
            self.burst = None
        elif held is None or held.holder != lease.holder or held.fast_fail != lease.fast_fail:
            self.burst = ErrorBurst(lease.fast_fail)

    def roll_back_now(self, action: str, reason: str, operator: str | None = None) -> None:
        """Challenger to 0 at once, lease and burst watch dropped; the caller saves it."""
        before = self.challenger_percent
        self.challenger_percent = 0
        self.shadow_percent = 0
        self.rollbacks += 1
        self.set_lease(None)
        self.record_change(action, before, 0, reason, operator)
        by = f" (by {operator})" if operator else ""
        logger.warning("ROLLBACK [%s] challenger_percent %d -> 0: %s%s", action, before, reason, by)

    async def persist(self, content: SavedState) -> None:
        if self.config.state_file is not None:
            await run_in_threadpool(save_state, self.config.state_file, content)

    async def save_rollback(self) -> None:
        async with self.admin_lock:
            try:
                await self.persist(self.saved(0, None))
            except OSError:
                logger.exception(
                    "the rollback is in effect but not saved to %s; fix it before the router "
                    "restarts",
                    self.config.state_file,
                )

    def spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        """Run a save started from the request path; shutdown waits for it."""
        task = asyncio.get_running_loop().create_task(coroutine)
        self.background.add(task)  # keep a reference until it is done
        task.add_done_callback(self.background.discard)

    def observe_challenger(self, failed: bool) -> None:
        """One challenger outcome into the fast-fail window; a burst rolls back here and now."""
        burst = self.burst
        if burst is None or self.challenger_percent == 0:
            return
        if burst.observe(failed):
            self.roll_back_now("fast_fail", burst.describe())
            self.spawn(self.save_rollback())

    async def watch_lease(self) -> None:
        """Roll back when the lease lapses: the release that held it stopped renewing it."""
        while True:
            lease = self.lease
            now = self.clock.time()
            self.lease_looks += 1
            if lease is not None and now >= lease.expires_at:
                self.roll_back_now(
                    "lease_lapsed",
                    f"the lease held by {lease.holder} lapsed at {utc_iso(lease.expires_at)}: "
                    f"not renewed within {lease.ttl_s:g} s (the release stopped or lost the "
                    "router)",
                )
                await self.save_rollback()
                continue
            wait = LEASE_TICK_S if lease is None else min(LEASE_TICK_S, lease.expires_at - now)
            await asyncio.sleep(max(0.01, wait))


def new_state(config: RouterConfig, clock: Clock = SYSTEM) -> RouterState:
    """The state a router starts with: the config's, or the state file's for these arms."""
    secret = os.environ.get(config.request_id_secret_env, "")
    if not secret:
        logger.warning(
            "$%s is not set: request ids are unsigned and no feedback is attributed to an arm "
            "(the canary analysis sees no badcases); set it, the same on every replica",
            config.request_id_secret_env,
        )
    ticking = clock.monotonic()
    state = RouterState(
        config=config,
        challenger_percent=config.challenger_percent,
        stats=new_stats(ARMS, config.stats_window),
        samples=SampleLog(config.sample_memory),
        shadow=Ring(config.shadow.memory),
        writer=FeedbackWriter(config.feedback_dir),
        ids=RequestIds(_scoped(secret, config.request_id_scope), config.request_id_max_age_s),
        flagged_ids=SeenKeys(config.flag_memory),
        flagged_users={arm: SeenKeys(config.flag_memory) for arm in ARMS},
        buckets={p.name: TokenBucket.full(p, ticking) for p in config.feedback_producers},
        clock=clock,
    )
    if config.state_file is not None:
        _restore(state, config.state_file, clock.time())
    return state


def _scoped(secret: str, scope: str) -> str | None:
    """The request-id key of one task's router; None without a secret (ids then attribute
    nothing, never signed by the scope alone)."""
    if not secret:
        return None
    return f"{secret}\x00{scope}" if scope else secret


def _restore(state: RouterState, state_file: Path, now: float) -> None:
    """The weight and lease from the state file, when it was saved for these arms."""
    found = load_state(state_file)
    start = starting_state(state.config.challenger_percent, state.versions(), found, now)
    state.challenger_percent = start.challenger_percent
    state.set_lease(start.lease)
    if found is not None:
        state.last_change = change(
            found.action,
            found.changed_from,
            found.challenger_percent,
            found.reason,
            found.operator,
        )
        state.last_change["at"] = found.changed_at
    if start.note is not None and not start.save:
        logger.warning("%s (%s)", start.note, state_file)
    if found is not None and dict(found.arms) != state.versions():
        state.record_change(
            "arms_changed", found.challenger_percent, start.challenger_percent, start.note or ""
        )
    if start.save and found is not None:
        state.record_change("lease_lapsed", found.challenger_percent, 0, start.note or "")
        logger.warning("ROLLBACK [lease_lapsed] %s (%s)", start.note, state_file)
        try:
            save_state(state_file, state.saved(0, None))
        except OSError:
            logger.exception("rolled back, but cannot record it in %s", state_file)


def state_of(request: Request) -> RouterState:
    """The state ``create_app`` put on the app that serves this request."""
    state: RouterState = request.app.state.router
    return state


async def _live(request: Request) -> RouterState:
    # Async: FastAPI runs a plain-function dependency in a worker thread, per request.
    return state_of(request)


# An endpoint's parameter ``state: Live`` is this router's state.
Live = Annotated[RouterState, Depends(_live)]
