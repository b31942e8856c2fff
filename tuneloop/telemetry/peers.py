"""The watchdogs of one job's nodes, telling each other of a hang through a shared folder.

A hang on one node stops every rank of the job: the others wait at their next collective.
Each node's watchdog sees only its own ranks, and the first one to end its ranks closes the
connections the others are blocked on, so they die ("connection closed by peer") before their
own watchdog finds them silent, and the stacks that show where they waited are lost.

So the node that finds a hang writes ``alarm-<node>.json`` into the job's folder of peers,
dumps its own ranks' stacks, and waits until every node that joined the folder has written
``stacked-<node>`` (or ``grace_s`` has passed) before it ends its ranks. Every other node's
watchdog sees the alarm at its next look, dumps its ranks' stacks while they are still
blocked, writes its marker and ends them. Files, not a network call: the folder is on the
storage every node shares (the launch checks refuse a project that is not), and it needs no
port or address. One folder per run of the job, so a requeued run never finds the last one's
alarm.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tuneloop.io import write_json

# How long the node that found the hang waits for the others' stacks. py-spy takes about a
# second per process; a peer looks at the folder every 1/hz s (default 1 s).
GRACE_S = 30.0


@dataclass(frozen=True)
class PeerAlarm:
    """Another node's watchdog found a hang."""

    node: str
    reason: str
    last_step: int | None


@dataclass(frozen=True)
class Peers:
    """This node's place in the job's folder of peers."""

    folder: Path
    node: str

    def join(self) -> None:
        """Announce this node, so the node that finds a hang waits for its stacks."""
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / f"node-{self.node}").touch()

    def joined(self) -> list[str]:
        return sorted(p.name.removeprefix("node-") for p in self.folder.glob("node-*"))

    def raised(self) -> PeerAlarm | None:
        """The first alarm another node wrote, if any."""
        for path in sorted(self.folder.glob("alarm-*.json")):
            node = path.stem.removeprefix("alarm-")
            if node == self.node:
                continue
            try:
                found = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue  # being written (write_json renames into place; a foreign file)
            return PeerAlarm(node, str(found.get("reason", "")), found.get("last_step"))
        return None

    def raise_alarm(self, reason: str, last_step: int | None) -> None:
        write_json(
            self.folder / f"alarm-{self.node}.json",
            {"node": self.node, "reason": reason, "last_step": last_step},
        )

    def stacked(self) -> None:
        """This node's stacks are written; its ranks may now be ended."""
        (self.folder / f"stacked-{self.node}").touch()

    def wait_for_stacks(
        self,
        grace_s: float = GRACE_S,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> list[str]:
        """Wait until every joined node has written its stacks; the nodes that had not when
        ``grace_s`` ran out."""
        deadline = clock() + grace_s
        while True:
            done = {p.name.removeprefix("stacked-") for p in self.folder.glob("stacked-*")}
            missing = [node for node in self.joined() if node not in done]
            if not missing or clock() >= deadline:
                return missing
            sleep(0.2)
