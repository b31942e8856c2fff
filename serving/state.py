"""Routing state of the canary router: sticky buckets, the live weight, who served whom.

Everything here is touched only from the router's event loop, so plain objects
suffice; the weight is read on every request, which is what makes a rollback
take effect for the very next one.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import OrderedDict
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

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


@dataclass(frozen=True)
class Served:
    arm: str
    model_version: str


class ServedLog:
    """Bounded memory of which arm served a key (request id or user), oldest forgotten first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, Served] = OrderedDict()

    def remember(self, key: str, served: Served) -> None:
        self._items[key] = served
        self._items.move_to_end(key)
        if len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def lookup(self, key: str) -> Served | None:
        return self._items.get(key)

    def __len__(self) -> int:
        return len(self._items)


class StateFileError(ValueError):
    """The persisted router state file cannot be read; the message names the file and the fix."""


def load_weight(path: Path) -> int | None:
    """The challenger percent last set through the admin API, or None when never set."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError) as error:
        raise StateFileError(
            f"{path}: cannot read router state ({error}); fix or delete it to start "
            "from the config's challenger_percent"
        ) from None
    percent = data.get("challenger_percent") if isinstance(data, dict) else None
    if not isinstance(percent, int) or isinstance(percent, bool) or not 0 <= percent <= BUCKETS:
        raise StateFileError(
            f"{path}: challenger_percent must be an integer in [0, 100] (got {percent!r}); "
            "fix or delete the file"
        )
    return percent


def save_weight(path: Path, challenger_percent: int, reason: str) -> None:
    """Write the weight atomically (temp, fsync, rename): a crash never leaves half a file."""
    record = {
        "challenger_percent": challenger_percent,
        "reason": reason,
        "updated_at": datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z"),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as out:
        out.write(json.dumps(record) + "\n")
        out.flush()
        os.fsync(out.fileno())
    tmp.replace(path)
