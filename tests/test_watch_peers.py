"""The watchdogs of a job's nodes: a hang found on one node has every node's stacks written
before any rank is ended (tuneloop/telemetry/peers.py).

Two ``tuneloop watch`` processes stand for two nodes sharing a folder of peers: node ``a``'s
job stops stepping, node ``b``'s keeps going (a real peer would be blocked in a collective;
either way it must be ended once ``a`` found the hang). The two-node Slurm test runs the same
over real torchrun ranks (tests/test_cluster_slurm.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.router_helpers import ManualClock
from tuneloop.telemetry.peers import Peers
from tuneloop.telemetry.watch import WATCHDOG_EXIT_CODE

pytestmark = pytest.mark.fast

STOPS = (
    "import time; from tuneloop.telemetry.heartbeat import beat\n"
    "for i in range(3): beat(i); time.sleep(0.6)\n"
    "def stopped_stepping():\n"
    "    time.sleep(120)\n"
    "stopped_stepping()\n"
)
STEPS = (
    "import time; from tuneloop.telemetry.heartbeat import beat\n"
    "def waiting_for_a_peer(i):\n"
    "    beat(i); time.sleep(0.6)\n"
    "for i in range(200): waiting_for_a_peer(i)\n"
)


def watch_node(peers: Path, node: str, out: Path, script: str) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "tuneloop.cli", "watch", "--heartbeat-only"]
    command += ["--deadlock-after=3", "--kill-grace=3", f"--out-dir={out}"]
    command += [f"--peers={peers}", f"--node={node}", "--", sys.executable, "-c", script]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def test_a_hang_on_one_node_has_every_node_write_its_stacks_then_end(tmp_path: Path) -> None:
    peers = tmp_path / "peers"
    nodes = {
        "a": watch_node(peers, "a", tmp_path / "a", STOPS),
        "b": watch_node(peers, "b", tmp_path / "b", STEPS),
    }
    try:
        outputs = {n: p.communicate(timeout=120)[0].decode() for n, p in nodes.items()}
    finally:
        for process in nodes.values():
            process.kill()
    for node, process in nodes.items():
        assert process.returncode == WATCHDOG_EXIT_CODE, outputs[node]
    found = {n: json.loads((tmp_path / n / "watch.json").read_text()) for n in nodes}
    assert found["a"]["alarm"]["kind"] == "deadlock"
    assert found["b"]["alarm"]["kind"] == "peer"
    assert "the watchdog on a found a hang" in found["b"]["alarm"]["reason"]
    # a waited for b's stacks before it ended its own ranks.
    assert found["a"]["actions"]["peers"] == "stacks from ['b']"
    assert (peers / "stacked-b").stat().st_mtime <= found["a"]["job_ended_at"]
    # Each node's stacks show where its own ranks were.
    assert "stopped_stepping" in (tmp_path / "a" / "stacks.txt").read_text()
    assert "waiting_for_a_peer" in (tmp_path / "b" / "stacks.txt").read_text()


def test_a_node_that_never_writes_its_stacks_delays_the_end_by_the_grace_only(
    tmp_path: Path,
) -> None:
    a, b = Peers(tmp_path, "a"), Peers(tmp_path, "b")
    a.join()
    b.join()
    a.raise_alarm("no step for 3 s", 7)
    assert a.raised() is None  # its own alarm is not a peer's
    raised = b.raised()
    assert raised is not None and (raised.node, raised.last_step) == ("a", 7)
    a.stacked()
    clock = ManualClock()
    start = clock.monotonic()
    assert a.wait_for_stacks(10.0, clock=clock.monotonic, sleep=clock.advance) == ["b"]
    assert 10.0 <= clock.monotonic() - start <= 10.5
    b.stacked()
    assert a.wait_for_stacks(10.0, clock=clock.monotonic, sleep=clock.advance) == []


def test_an_alarm_being_written_is_read_at_the_next_look(tmp_path: Path) -> None:
    (tmp_path / "alarm-a.json").write_text('{"node": "a", "rea')  # not a whole file yet
    assert Peers(tmp_path, "b").raised() is None
