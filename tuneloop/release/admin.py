"""The release's hands on the router replicas: their admin API, called together.

``RouterAdmin`` drives the admin API of every router replica at once: status,
stats, weights, shadow, rollback, the lease. Each replica holds its own weight in
memory, so every change goes to all of them. ``Cursor`` reads each replica's
per-request samples (or shadow answer pairs) from where the last read stopped.

``LeaseKeeper`` holds a running release's lease on the canary weight: it takes
it on every replica, renews it from a background thread every third of its
time to live (also while the flow is paused for a person), and ends it when the
release ends. A release process that dies stops renewing, and every replica
then rolls the challenger back by itself when its lease lapses.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:
    from tuneloop.params import ReleaseParams

logger = logging.getLogger(__name__)
# Seconds between renewal attempts after a failed one.
RETRY_S = 1.0
# Items per page of /admin/samples and /admin/shadow (the router's most), and a cursor
# beyond any router's last item (it answers with its last, to start after it).
PAGE = 10_000
SKIP_ALL = 2**62

# --- the routers' admin API --------------------------------------------------------------------


class AdminError(RuntimeError):
    """A router replica refused or failed an admin call; the message names it and the fix."""


class RouterAdmin:
    """The admin API of every router replica, called together.

    Each replica holds its own weight in memory, so every change goes to all of
    them; a change that fails on any replica raises, naming the replicas.
    """

    def __init__(self, urls: Sequence[str], token: str, timeout: float = 5.0) -> None:
        if not urls:
            raise AdminError("no router URLs given (params: release.routers)")
        self.urls = tuple(u.rstrip("/") for u in urls)
        self._token = token
        self._timeout = timeout
        self._client = httpx.Client(
            timeout=timeout,
            headers={"Authorization": f"Bearer {token}"},
            trust_env=False,
        )

    @classmethod
    def from_env(cls, urls: Sequence[str], token_env: str, timeout: float = 5.0) -> RouterAdmin:
        token = os.environ.get(token_env, "")
        if not token:
            raise AdminError(
                f"${token_env} is not set; the routers' admin API needs it "
                "(the same value the routers were started with)"
            )
        return cls(urls, token, timeout)

    @classmethod
    def for_release(cls, params: ReleaseParams) -> RouterAdmin:
        """The routers of ``params.routers``, with its token variable and timeout."""
        return cls.from_env(params.routers, params.admin_token_env, params.admin_timeout_s)

    def copy(self) -> RouterAdmin:
        """The same routers and token over a client of its own (one per thread)."""
        return RouterAdmin(self.urls, self._token, self._timeout)

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> RouterAdmin:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _call(self, url: str, method: str, path: str, body: Mapping[str, Any] | None) -> Any:
        try:
            response = self._client.request(method, url + path, json=body)
        except httpx.HTTPError as error:
            raise AdminError(f"{method} {url}{path}: {type(error).__name__}: {error}") from None
        if response.status_code == 401:
            raise AdminError(
                f"{url} refused the admin token (401): the token in the environment is not "
                "the router's"
            )
        if response.status_code != 200:
            raise AdminError(
                f"{method} {url}{path}: HTTP {response.status_code}: {response.text[:300]}"
            )
        return response.json()

    def _each(
        self, method: str, path: str, body: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """Call every replica at once; raise with all failures if any failed."""
        if len(self.urls) == 1:
            return {self.urls[0]: self._call(self.urls[0], method, path, body)}
        with ThreadPoolExecutor(max_workers=len(self.urls)) as pool:
            futures = {url: pool.submit(self._call, url, method, path, body) for url in self.urls}
        results: dict[str, Any] = {}
        failures: list[str] = []
        for url, future in futures.items():
            error = future.exception()
            if error is None:
                results[url] = future.result()
            else:
                failures.append(str(error))
        if failures:
            raise AdminError("; ".join(failures))
        return results

    def status(self) -> dict[str, Any]:
        return self._each("GET", "/admin/status")

    def stats(self) -> dict[str, Any]:
        return self._each("GET", "/admin/stats")

    def page(self, url: str, path: str, since: int, limit: int) -> dict[str, Any]:
        """One page of numbered items (``/admin/samples``, ``/admin/shadow``) of one replica."""
        page: dict[str, Any] = self._call(url, "GET", f"{path}?since={since}&limit={limit}", None)
        return page

    def set_shadow(self, percent: int, reason: str) -> None:
        """Mirror ``percent`` of users' requests to the challenger on every replica (0: stop)."""
        self._each("POST", "/admin/shadow", {"percent": percent, "reason": reason})

    def set_weight(self, percent: int, reason: str) -> None:
        """Move every replica to ``percent``. Not retried: a person or the flow decides again."""
        self._each("POST", "/admin/weights", {"challenger_percent": percent, "reason": reason})

    def take_lease(
        self, holder: str, ttl_s: float, fast_fail: Mapping[str, int] | None = None
    ) -> None:
        """Take or renew ``holder``'s lease on every replica, lapsing ``ttl_s`` from now."""
        body = {"holder": holder, "ttl_s": ttl_s, "fast_fail": fast_fail}
        self._each("POST", "/admin/lease", body)

    def end_lease(self, holder: str, reason: str) -> None:
        """End ``holder``'s lease on every replica; the weight stays as it is."""
        self._each("POST", "/admin/lease/release", {"holder": holder, "reason": reason})

    def rollback(self, reason: str, attempts: int = 3, operator: str | None = None) -> float:
        """Challenger to 0 on every replica; returns the seconds it took.

        Retried (a rollback is idempotent and must land); replicas that already
        took it are not called again. ``operator`` (who) is recorded beside the reason.
        """
        start = time.perf_counter()
        body: dict[str, str] = {"reason": reason}
        if operator:
            body["operator"] = operator
        pending = list(self.urls)
        errors: list[str] = []
        for _ in range(attempts):
            # All replicas at once: one slow or dead replica must not delay the others.
            with ThreadPoolExecutor(max_workers=len(pending)) as pool:
                futures = {
                    url: pool.submit(self._call, url, "POST", "/admin/rollback", body)
                    for url in pending
                }
            errors = [str(f.exception()) for f in futures.values() if f.exception()]
            pending = [url for url, f in futures.items() if f.exception()]
            if not pending:
                return time.perf_counter() - start
        raise AdminError(
            f"ROLLBACK DID NOT LAND on {pending}: {'; '.join(errors)}. Roll back by hand: "
            "curl -X POST -H 'Authorization: Bearer $TOKEN' -H 'content-type: application/json' "
            '-d \'{"reason": "manual"}\' <router>/admin/rollback'
        )


@dataclass
class Batch:
    """What a ``Cursor`` read: the new items of every replica, and what it could not get."""

    items: list[dict[str, Any]] = field(default_factory=list)
    dropped: int = 0  # items a replica's ring no longer held
    restarted: list[str] = field(default_factory=list)  # replicas read again from their start
    percents: set[int] = field(default_factory=set)  # challenger_percent each replica reported
    shadows: set[int] = field(default_factory=set)  # shadow_percent, where the page says it


class Cursor:
    """Where the release stopped reading the routers' numbered items, per replica.

    ``path`` is ``/admin/samples`` (every finished request) or ``/admin/shadow``
    (mirrored answer pairs). Each read fetches only what came since the last one,
    a page at a time, so an analysis holds its own interval and nothing more. A
    replica that restarted (it reports another ``boot``) is read from its start.
    """

    def __init__(self, admin: RouterAdmin, path: str) -> None:
        self.admin = admin
        self.path = path
        self._at: dict[str, tuple[str, int]] = {}

    def skip(self) -> None:
        """Start after everything the replicas hold now (the items before a shift are not its)."""
        for url in self.admin.urls:
            page = self.admin.page(url, self.path, SKIP_ALL, 1)
            self._at[url] = (str(page["boot"]), int(page["next"]))

    def read(self) -> Batch:
        """Every replica's new items; a replica that fails raises and moves no cursor, so
        what the others served is read next time instead of lost with this batch."""
        batch = Batch()
        read_to: dict[str, tuple[str, int]] = {}
        for url in self.admin.urls:
            boot, since = self._at.get(url, ("", 0))
            while True:
                page = self.admin.page(url, self.path, since, PAGE)
                try:
                    if boot and page["boot"] != boot:
                        batch.restarted.append(url)
                        boot, since = str(page["boot"]), 0
                        continue
                    boot = str(page["boot"])
                    items = page["items"]
                    if not isinstance(items, list):
                        raise TypeError("items is not a list")
                    batch.items.extend(items)
                    batch.dropped += int(page["dropped"])
                    batch.percents.add(int(page["challenger_percent"]))
                    if "shadow_percent" in page:
                        batch.shadows.add(int(page["shadow_percent"]))
                    since = int(page["next"])
                    done = not items or since >= int(page["last"])
                except (KeyError, TypeError, ValueError) as error:
                    raise AdminError(
                        f"{url}{self.path} answered an unreadable page ({error!r}); is it a "
                        "tuneloop router of this version?"
                    ) from None
                if done:
                    break
            read_to[url] = (boot, since)
        self._at.update(read_to)
        return batch


class LeaseKeeper:
    """A release's lease on every replica, renewed in the background while the release runs.

    Use as a context manager: entering takes the lease (all replicas, or
    ``AdminError``); leaving stops the renewals and ends the lease. A renewal
    that fails is logged and tried again at the next tick: the lease is three
    renewals long, so a brief outage costs nothing, and a long one lets the
    routers roll back by themselves, which is what an unwatched canary needs.
    """

    def __init__(
        self,
        admin: RouterAdmin,
        holder: str,
        ttl_s: float,
        fast_fail: Mapping[str, int] | None,
        log: logging.Logger | logging.LoggerAdapter[Any] = logger,
    ) -> None:
        # Its own HTTP client: the flow's analysis thread uses the other one meanwhile.
        self.admin = admin.copy()
        self.holder = holder
        self.ttl_s = ttl_s
        self.fast_fail = dict(fast_fail) if fast_fail is not None else None
        self.log = log
        self.renewals = 0
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, name="release-lease", daemon=True)

    @property
    def interval(self) -> float:
        """Seconds between renewals: a third of the lease."""
        return self.ttl_s / 3

    def __enter__(self) -> LeaseKeeper:
        self.admin.take_lease(self.holder, self.ttl_s, self.fast_fail)
        self._thread.start()
        return self

    def _renew(self) -> None:
        wait = self.interval
        while not self._stop.wait(wait):
            try:
                self.admin.take_lease(self.holder, self.ttl_s, self.fast_fail)
            except AdminError as error:
                self.failures += 1
                # Try again soon, not a third of the lease later: a replica that
                # restarts must get its lease back before the one it restored lapses.
                wait = min(self.interval, RETRY_S)
                self.log.warning(
                    "lease renewal failed (%s); trying again in %g s. A router that stays "
                    "unreachable rolls back by itself when its lease lapses (%g s)",
                    error,
                    wait,
                    self.ttl_s,
                )
            else:
                self.renewals += 1
                wait = self.interval

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        try:
            self.admin.end_lease(self.holder, "the release ended")
        except AdminError as error:
            self.log.warning(
                "could not end the lease (%s); where it stays, it lapses in %g s and that router "
                "sets the challenger to 0",
                error,
                self.ttl_s,
            )
        finally:
            self.admin.close()
