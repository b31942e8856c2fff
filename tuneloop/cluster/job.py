"""What every cluster launcher shares: the node's command, the job's state, its accounting.

Every node runs the same line: the node's watchdog (``tuneloop watch``) around the node's
torchrun, which meets the other nodes at a c10d rendezvous on the first node and starts
``cluster.gpus_per_node`` ranks of ``stages.train``. The ranks train exactly as torchrun on
one machine would; only where they run differs, so the stage's outputs do not.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from tuneloop.params import Params
from tuneloop.training.metrics import NodeUsage
from tuneloop.training.plan import Rendezvous, torchrun_argv

# The scheduler's words for a job that ended; only COMPLETED yields the adapter.
SUCCEEDED = "COMPLETED"
FAILED_STATES = frozenset(
    {
        "FAILED",
        "TIMEOUT",
        "OUT_OF_MEMORY",
        "NODE_FAIL",
        "CANCELLED",
        "PREEMPTED",
        "BOOT_FAIL",
        "DEADLINE",
    }
)
ENDED_STATES = FAILED_STATES | {SUCCEEDED}

# MLflow tags on the stage's run.
TAG_LAUNCHER = "tuneloop.cluster.launcher"
TAG_JOB_ID = "tuneloop.cluster.job_id"
TAG_NODES = "tuneloop.cluster.nodes"
TAG_STATE = "tuneloop.cluster.state"
TAG_LOGS = "tuneloop.cluster.logs"

# The file whose appearance asks the ranks to save and stop (tuneloop.training.preemption);
# rank 0 writes the same name + SAVED_SUFFIX once the checkpoint is complete.
SAVE_REQUEST_ENV = "TUNELOOP_SAVE_REQUEST"
SAVED_SUFFIX = ".saved"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class JobStatus(_Model):
    """The job as the scheduler reports it now (or, once ended, last)."""

    job_id: str
    state: str
    nodes: tuple[str, ...] = ()
    elapsed_s: float = 0.0
    reason: str = ""
    restarts: int = 0

    @property
    def ended(self) -> bool:
        return self.state in ENDED_STATES


def usage_by_node(runs: list[tuple[tuple[str, ...], float]], gpus_per_node: int) -> list[NodeUsage]:
    """GPU-hours per node from the scheduler's runs of the job: (nodes, elapsed seconds) each.

    Elapsed x the GPUs the job held on the node, summed over the job's runs (a requeued job
    runs again, maybe elsewhere).
    """
    seconds: dict[str, float] = {}
    for nodes, elapsed in runs:
        for node in nodes:
            seconds[node] = seconds.get(node, 0.0) + elapsed
    return [
        NodeUsage(
            node=node,
            seconds=round(held, 3),
            gpus=gpus_per_node,
            gpu_hours=round(held * gpus_per_node / 3600, 6),
        )
        for node, held in sorted(seconds.items())
    ]


def watch_argv(
    params: Params, out_dir: str, python: str, peers: str | None = None, node: str | None = None
) -> list[str]:
    """``tuneloop watch`` with the params' watchdog knobs, up to and with ``--``. ``peers``
    (the run's folder every node's watchdog shares) and ``node`` (this node's name in it): a
    hang found on one node has every node's ranks' stacks written (telemetry/peers.py)."""
    wd = params.watchdog
    argv = [
        python,
        "-m",
        "tuneloop.cli",
        "watch",
        f"--deadlock-after={wd.deadlock_after_s}",
        f"--window={wd.window_s}",
        f"--hz={wd.hz}",
        f"--kill-grace={wd.kill_grace_s}",
        f"--section-max-factor={wd.section_max_factor}",
        f"--out-dir={out_dir}",
    ]
    if wd.calibration is not None:
        argv.append(f"--calibration={wd.calibration.resolve()}")
    if peers is not None:
        argv.append(f"--peers={peers}")
    if node is not None:
        argv.append(f"--node={node}")
    return [*argv, "--"]


def node_argv(
    params: Params,
    rendezvous: Rendezvous,
    out_dir: str,
    python: str,
    peers: str | None = None,
    node: str | None = None,
) -> list[str]:
    """The line every node runs: its watchdog (when enabled) around its torchrun."""
    torchrun = torchrun_argv(params.cluster.gpus_per_node, rendezvous, python)
    if not params.watchdog.enabled:
        return torchrun
    return [*watch_argv(params, out_dir, python, peers, node), *torchrun]


def shell_words(argv: list[str]) -> str:
    """``argv`` as a shell line; words holding ``$`` are double-quoted so the node expands them."""
    words = []
    for word in argv:
        if "$" in word and not any(c in word for c in '"`\\'):
            words.append(f'"{word}"')
        else:
            words.append(shlex.quote(word))
    return " ".join(words)


def read_exit_codes(folder: Path, nodes: tuple[str, ...]) -> dict[str, int]:
    """Each node watchdog's exit code from its watch.json, where it wrote one."""
    return {node: int(found["exit_code"]) for node, found in _manifests(folder, nodes).items()}


def read_alarms(folder: Path, nodes: tuple[str, ...]) -> dict[str, str]:
    """The kind of each node watchdog's alarm ("peer": another node found the hang)."""
    return {
        node: str(found["alarm"]["kind"])
        for node, found in _manifests(folder, nodes).items()
        if found.get("alarm")
    }


def _manifests(folder: Path, nodes: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    found = {}
    for node in nodes:
        manifest = folder / node / "watch.json"
        if manifest.is_file():
            found[node] = json.loads(manifest.read_text())
    return found


JOB_FILE = "job.json"


class Submitted(_Model):
    """``<paths.watch>/<time>/job.json``: which job a stage submitted, for ``tuneloop status``."""

    launcher: str
    job_id: str
    submitted_at: str


def latest_submitted(watch_root: Path) -> Submitted | None:
    """The newest job a train stage of this project submitted, if any."""
    found = sorted(watch_root.glob(f"*/{JOB_FILE}"), key=lambda p: p.stat().st_mtime)
    if not found:
        return None
    return Submitted.model_validate_json(found[-1].read_text())


def describe(status: JobStatus) -> str:
    """One line for a person: ``slurm job 12 RUNNING on node1,node2, elapsed 0:05:12``."""
    minutes, secs = divmod(int(status.elapsed_s), 60)
    hours, minutes = divmod(minutes, 60)
    where = ",".join(status.nodes) or "no node yet"
    restarts = f", requeued {status.restarts}x" if status.restarts else ""
    return (
        f"job {status.job_id} {status.state} on {where}, elapsed "
        f"{hours}:{minutes:02d}:{secs:02d}{restarts}"
    )
