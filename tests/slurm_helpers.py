"""A real two-node Slurm cluster on this one host, for the tests that submit training to it.

Two ``slurmd`` (node1, node2), each on its own port with ``NodeAddr=127.0.0.1``, and one
``slurmctld``, all from Debian's ``slurm-wlm`` and reading a ``slurm.conf`` in a temp folder
that ``SLURM_CONF`` points every client at. No system service is touched but munge, which
must run already (``.ci/run`` starts it). No slurmdbd: ``jobcomp/filetxt`` keeps one line per
finished job, which ``tuneloop.cluster.slurm`` reads where a real cluster has ``sacct``.
The daemons are this process's children, ended by their pids, never by name.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import free_port

DAEMONS = ("slurmctld", "slurmd", "sbatch", "squeue", "scancel", "scontrol", "sinfo", "srun")
NODES = ("node1", "node2")
PARTITION = "debug"


@dataclass(frozen=True)
class SlurmCluster:
    conf: Path
    folder: Path
    jobcomp: Path
    env: dict[str, str]
    """``os.environ`` with ``SLURM_CONF``: what a client of this cluster runs with."""

    def run(self, *argv: str) -> str:
        done = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")
        return done.stdout

    def queue(self) -> list[str]:
        """Ids of the jobs Slurm still holds (pending, running, completing)."""
        return self.run("squeue", "-h", "-o", "%i").split()


def missing_binaries() -> list[str]:
    return [name for name in DAEMONS if shutil.which(name) is None]


def munge_runs() -> bool:
    if shutil.which("munge") is None:
        return False
    done = subprocess.run("munge -n | unmunge", shell=True, capture_output=True, timeout=10)
    return done.returncode == 0


def require_slurm() -> None:
    """Skip without Slurm or munge here; in CI (``CI`` set) a missing one is a failure."""
    problem = None
    if missing := missing_binaries():
        problem = (
            f"Slurm is not installed ({', '.join(missing)} missing): apt-get install slurm-wlm"
        )
    elif not munge_runs():
        problem = "munge is not running (`munge -n | unmunge` fails): run munged as root"
    if problem is None:
        return
    if os.environ.get("CI"):
        pytest.fail(problem)
    pytest.skip(problem)


def slurm_conf(folder: Path, ctld_port: int, node_ports: dict[str, int]) -> str:
    lines = [
        "ClusterName=tuneloop-test",
        "SlurmctldHost=localhost",
        f"SlurmctldPort={ctld_port}",
        f"SlurmdPort={next(iter(node_ports.values()))}",
        "SlurmUser=root",
        "AuthType=auth/munge",
        f"StateSaveLocation={folder}/state",
        f"SlurmdSpoolDir={folder}/spool-%n",
        f"SlurmctldPidFile={folder}/slurmctld.pid",
        f"SlurmdPidFile={folder}/slurmd-%n.pid",
        f"SlurmctldLogFile={folder}/slurmctld.log",
        f"SlurmdLogFile={folder}/slurmd-%n.log",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "MpiDefault=none",
        "ReturnToService=2",
        "SchedulerType=sched/builtin",
        "JobCompType=jobcomp/filetxt",
        f"JobCompLoc={folder}/jobcomp.txt",
        "MinJobAge=300",
        # A job the scheduler ends (cancel, time limit) gets its signal, then this long.
        "KillWait=5",
        "InactiveLimit=0",
        "SlurmctldTimeout=30",
        "SlurmdTimeout=60",
    ]
    for name, port in node_ports.items():
        lines.append(
            f"NodeName={name} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} "
            "CPUs=1 RealMemory=4000 State=UNKNOWN"
        )
    lines.append(f"PartitionName={PARTITION} Nodes={','.join(node_ports)} Default=YES State=UP")
    return "\n".join(lines) + "\n"


def _wait_idle(cluster: SlurmCluster, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        done = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%N %t"], env=cluster.env, capture_output=True, text=True
        )
        last = done.stdout.strip() or done.stderr.strip()
        states = dict(line.split() for line in done.stdout.splitlines() if line.strip())
        up = all(s in ("idle", "mix", "alloc") for s in states.values())
        if done.returncode == 0 and set(states) == set(NODES) and up:
            return
        time.sleep(0.5)
    logs = "\n".join(p.read_text()[-1500:] for p in cluster.folder.glob("*.log"))
    raise RuntimeError(f"the test cluster's nodes did not come up: {last}\n{logs}")


def _stop(daemons: list[subprocess.Popen[bytes]]) -> None:
    for daemon in daemons:
        daemon.terminate()
    for daemon in daemons:
        try:
            daemon.wait(timeout=15)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()


@contextlib.contextmanager
def running_cluster(folder: Path) -> Iterator[SlurmCluster]:
    """The two-node cluster, its config and state in ``folder``; its daemons stopped after."""
    (folder / "state").mkdir(parents=True)
    ports = {name: free_port() for name in NODES}
    conf = folder / "slurm.conf"
    conf.write_text(slurm_conf(folder, free_port(), ports))
    env = os.environ | {"SLURM_CONF": str(conf)}
    cluster = SlurmCluster(conf, folder, folder / "jobcomp.txt", env)
    logs = []
    daemons: list[subprocess.Popen[bytes]] = []
    try:
        # -D: in the foreground, as children of this process; -c: no state from a past cluster.
        commands = {"slurmctld": ["slurmctld", "-D", "-c", "-f", str(conf)]}
        commands |= {name: ["slurmd", "-D", "-f", str(conf), "-N", name] for name in NODES}
        for name, argv in commands.items():
            log = (folder / f"{name}.out").open("w")
            logs.append(log)
            daemons.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT))
        _wait_idle(cluster, 60)
        yield cluster
    finally:
        _stop(daemons)
        for log in logs:
            log.close()


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """Start the two-node cluster for the session; stop its daemons by their pids."""
    require_slurm()
    with running_cluster(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster
