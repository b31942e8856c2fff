"""Routing state of the canary router: sticky buckets, the saved weight, the release's lease.

Everything here is touched only from the router's event loop, so plain objects
suffice; the weight is read on every request, which is what makes a rollback
take effect for the very next one.

The state file keeps what the admin API last set, so that a restart neither
undoes a rollback nor forgets a canary: the weight, the arms' model versions it
was set for (a weight never carries over to other models), and the lease a
running release holds on it (a release that stops renewing it is rolled back).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import deque
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

BUCKETS = 100


def bucket(key: str) -> int:
    """A stable bucket in [0, 100) for a user id.

    A fixed cryptographic hash, not ``hash()``: Python salts ``hash`` per
    process, and every router replica and restart must put a user in the same
    bucket. The modulo bias of a 64-bit digest over 100 buckets is < 1e-17.
    """
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % BUCKETS


def arm_for_bucket(user_bucket: int, challenger_percent: int) -> str:
    # Buckets [0, p) are the challenger's: ramping p from 10 to 25 only adds
    # users to the challenger, so nobody flips between models during a ramp.
    return "challenger" if user_bucket < challenger_percent else "champion"


class StateFileError(ValueError):
    """The persisted router state file cannot be read; the message names the file and the fix."""


def utc_iso(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


@dataclass(frozen=True)
class FastFail:
    """Roll back when ``max_errors`` of the last ``window`` challenger requests failed."""

    window: int
    max_errors: int


@dataclass(frozen=True)
class Lease:
    """A release's claim on the canary weight: it lapses at ``expires_at`` unless renewed.

    ``expires_at`` is wall-clock time (Unix seconds), not a monotonic clock: it
    must mean the same after a restart, when it is read back from the state file.
    """

    holder: str
    ttl_s: float
    expires_at: float
    fast_fail: FastFail | None = None

    def as_json(self, now: float) -> dict[str, object]:
        return {
            "holder": self.holder,
            "ttl_s": self.ttl_s,
            "expires_at": utc_iso(self.expires_at),
            "seconds_left": round(max(0.0, self.expires_at - now), 1),
            "fast_fail": None if self.fast_fail is None else asdict(self.fast_fail),
        }


@dataclass(frozen=True)
class SavedState:
    """What the state file holds: the weight, for which arms, why, and the lease on it.

    ``changed_at`` and ``changed_from`` are the weight's last change; ``updated_at`` is the
    file's last write, which a lease renewal moves too.
    """

    challenger_percent: int
    arms: Mapping[str, str]  # arm -> model version the weight was set for
    action: str
    reason: str
    operator: str | None = None
    lease: Lease | None = None
    updated_at: str = field(default_factory=lambda: utc_iso(datetime.now(UTC).timestamp()))
    changed_at: str = ""  # "": not recorded (a file from before it was), read as updated_at
    changed_from: int | None = None


def load_state(path: Path) -> SavedState | None:
    """The state the admin API last saved, or None when there is none."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        raise StateFileError(
            f"{path}: cannot read router state ({error}); fix or delete it to start "
            "from the config's challenger_percent"
        ) from None
    if not isinstance(data, dict):
        raise StateFileError(f"{path}: not a JSON object; fix or delete the file")
    percent = data.get("challenger_percent")
    if not isinstance(percent, int) or isinstance(percent, bool) or not 0 <= percent <= BUCKETS:
        raise StateFileError(
            f"{path}: challenger_percent must be an integer in [0, 100] (got {percent!r}); "
            "fix or delete the file"
        )
    arms = data.get("arms")
    before = data.get("changed_from")
    try:
        lease = _lease(data.get("lease"))
    except (KeyError, TypeError, ValueError) as error:
        raise StateFileError(
            f"{path}: unreadable lease ({error!r}); fix or delete the file"
        ) from None
    return SavedState(
        challenger_percent=percent,
        # A file from before arms were recorded binds to no arms: it never carries over.
        arms={str(k): str(v) for k, v in arms.items()} if isinstance(arms, dict) else {},
        action=str(data.get("action", "weights")),
        reason=str(data.get("reason", "")),
        operator=data.get("operator") if isinstance(data.get("operator"), str) else None,
        lease=lease,
        updated_at=str(data.get("updated_at", "")),
        changed_at=str(data.get("changed_at") or data.get("updated_at", "")),
        changed_from=before if isinstance(before, int) and not isinstance(before, bool) else None,
    )


def _lease(data: Any) -> Lease | None:
    if data is None:
        return None
    fast_fail = data.get("fast_fail")
    return Lease(
        holder=str(data["holder"]),
        ttl_s=float(data["ttl_s"]),
        expires_at=float(data["expires_at_unix"]),
        fast_fail=None
        if fast_fail is None
        else FastFail(int(fast_fail["window"]), int(fast_fail["max_errors"])),
    )


def save_state(path: Path, state: SavedState) -> None:
    """Write the state atomically (temp, fsync, rename): a crash never leaves half a file."""
    record: dict[str, Any] = {
        "challenger_percent": state.challenger_percent,
        "arms": dict(state.arms),
        "action": state.action,
        "reason": state.reason,
        "operator": state.operator,
        "updated_at": state.updated_at,
        "changed_at": state.changed_at or state.updated_at,
        "changed_from": state.changed_from,
        "lease": None,
    }
    if state.lease is not None:
        lease = state.lease
        record["lease"] = {
            "holder": lease.holder,
            "ttl_s": lease.ttl_s,
            "expires_at_unix": lease.expires_at,
            "expires_at": utc_iso(lease.expires_at),
            "fast_fail": None if lease.fast_fail is None else asdict(lease.fast_fail),
        }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o640)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.write(json.dumps(record) + "\n")
        out.flush()
        os.fsync(out.fileno())
    tmp.replace(path)
    # The rename is durable only once the folder's entry is on disk too.
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


@dataclass(frozen=True)
class Start:
    """Where a starting router puts the weight, and why (None: nothing worth saying)."""

    challenger_percent: int
    lease: Lease | None
    note: str | None
    save: bool  # the decision changed what the file says: write it back


def starting_state(
    config_percent: int, versions: Mapping[str, str], saved: SavedState | None, now: float
) -> Start:
    """The weight a router starts with, from its config and the state file it finds.

    The file wins (a restart must not undo a rollback nor drop a canary) only
    when it was saved for the very arms this router serves; new arms start at
    the config's weight. A lease that lapsed while the router was down rolls
    the challenger back now, as it would have had the router been up.
    """
    if saved is None:
        return Start(config_percent, None, None, save=False)
    if dict(saved.arms) != dict(versions):
        return Start(
            config_percent,
            None,
            f"the state file's weight {saved.challenger_percent} % was set for arms "
            f"{dict(saved.arms) or 'not recorded'}; this router serves {dict(versions)}: "
            f"starting at the config's challenger_percent {config_percent} %",
            save=False,
        )
    lease = saved.lease
    if lease is not None and lease.expires_at <= now:
        return Start(
            0,
            None,
            f"the lease held by {lease.holder} lapsed at {utc_iso(lease.expires_at)} while the "
            f"router was down: challenger {saved.challenger_percent} -> 0 %",
            save=True,
        )
    if saved.challenger_percent != config_percent or lease is not None:
        held = f", lease held by {lease.holder} until {utc_iso(lease.expires_at)}" if lease else ""
        return Start(
            saved.challenger_percent,
            lease,
            f"challenger_percent {saved.challenger_percent} from the state file "
            f"({saved.action}: {saved.reason or 'no reason given'}{held}) overrides "
            f"{config_percent} from the config",
            save=False,
        )
    return Start(saved.challenger_percent, None, None, save=False)


class ErrorBurst:
    """Outcomes of the last ``window`` challenger requests, to catch a burst of errors."""

    def __init__(self, rule: FastFail) -> None:
        self.rule = rule
        self.recent: deque[bool] = deque(maxlen=rule.window)

    def observe(self, failed: bool) -> bool:
        """Record one outcome; True when the burst is over the rule's limit."""
        self.recent.append(failed)
        return sum(self.recent) >= self.rule.max_errors

    def describe(self) -> str:
        return (
            f"{sum(self.recent)} of the last {len(self.recent)} challenger requests failed "
            f"(fast fail: {self.rule.max_errors} of {self.rule.window})"
        )
