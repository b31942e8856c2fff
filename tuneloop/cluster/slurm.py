"""Slurm through its own commands: ``sbatch``, ``scontrol``, ``scancel``, ``sacct``.

sbatch rather than submitit: the job is a shell script a person can read, rerun and debug
(``scontrol show job``, the script beside its log), whose tasks are the node's ``tuneloop
watch`` around torchrun, not a pickled Python function; its ``--signal``/``--requeue``
behaviour is Slurm's own, and the login node needs nothing but the Slurm client. submitit
would add a dependency that pickles callables, which is not what runs on the nodes here.

The job's record: ``scontrol show job`` while Slurm keeps it (``MinJobAge`` after its end);
the accounting of each run of it from ``sacct`` where the cluster keeps accounting, else
from ``jobcomp/filetxt``'s file (what ``scontrol show config`` names).
"""

from __future__ import annotations

import datetime as dt
import re
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from tuneloop.cluster.job import SAVE_REQUEST_ENV, SAVED_SUFFIX, JobStatus, node_argv, shell_words
from tuneloop.params import Params
from tuneloop.training.plan import Rendezvous

COMMAND_TIMEOUT_S = 60
JOB_NAME = "tuneloop-train"
# Which run of the job this is: 0, then 1 after a requeue.
RUN = "${SLURM_RESTART_COUNT:-0}"
_PAIR = re.compile(r"(\w[\w/:.]*)=(\S*)")


class SlurmError(RuntimeError):
    """A Slurm command failed or is missing; the message names it and what it said."""


def call(*argv: str, env: Mapping[str, str] | None = None) -> str:
    try:
        done = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT_S,
            env=dict(env) if env is not None else None,
        )
    except FileNotFoundError:
        raise SlurmError(
            f"{argv[0]} not found: train.launcher 'slurm' runs on a machine with the Slurm "
            "client (a login node); install it or set train.launcher: local"
        ) from None
    except subprocess.TimeoutExpired:
        raise SlurmError(f"{' '.join(argv)} did not answer in {COMMAND_TIMEOUT_S} s") from None
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip()
        raise SlurmError(f"{' '.join(argv)} failed (exit {done.returncode}): {said}")
    return done.stdout


def pairs(line: str) -> dict[str, str]:
    """``Key=Value`` words of one ``scontrol show -o`` line."""
    return dict(_PAIR.findall(line))


def hostnames(nodelist: str) -> tuple[str, ...]:
    """``node[1-2]`` -> (node1, node2), as Slurm expands it."""
    if not nodelist or nodelist in ("(null)", "None"):
        return ()
    return tuple(call("scontrol", "show", "hostnames", nodelist).split())


def seconds(duration: str) -> float:
    """Slurm's ``[D-]HH:MM:SS`` (or MM:SS) as seconds."""
    days, _, clock = duration.rpartition("-")
    parts = [int(p) for p in clock.split(":")]
    while len(parts) < 3:
        parts.insert(0, 0)
    hours, minutes, secs = parts
    return (int(days) if days else 0) * 86400 + hours * 3600 + minutes * 60 + secs


@dataclass(frozen=True)
class Partition:
    name: str
    nodes: tuple[str, ...]
    state: str


def partition(name: str | None) -> Partition | None:
    """The named partition, or the cluster's default one for None; None when there is none."""
    for line in call("scontrol", "show", "partition", "-o").splitlines():
        fields = pairs(line)
        if (name is None and fields.get("Default") == "YES") or fields.get("PartitionName") == name:
            return Partition(
                fields["PartitionName"], hostnames(fields.get("Nodes", "")), fields.get("State", "")
            )
    return None


def node_addresses() -> dict[str, str]:
    """Every node's ``NodeAddr``: where its processes are reached."""
    found = {}
    for line in call("scontrol", "show", "node", "-o").splitlines():
        fields = pairs(line)
        if "NodeName" in fields:
            found[fields["NodeName"]] = fields.get("NodeAddr", fields["NodeName"])
    return found


def batch_script(params: Params, folder: Path, project: Path, python: str) -> str:
    """The job: one task per node, each that node's watchdog around its torchrun."""
    cluster = params.cluster
    directives = [
        f"--job-name={JOB_NAME}",
        f"--nodes={cluster.nodes}",
        "--ntasks-per-node=1",
        f"--output={folder}/slurm-%j.out",
        # A requeued run appends to the same log rather than replacing it.
        "--open-mode=append",
        f"--chdir={project}",
        f"--time={cluster.time_limit}",
        "--requeue",
        # B: the batch shell gets it; its trap has the ranks save, then requeues the job.
        f"--signal=B:USR1@{cluster.signal_before_end_s}",
    ]
    if cluster.partition:
        directives.append(f"--partition={cluster.partition}")
    if cluster.account:
        directives.append(f"--account={cluster.account}")
    directives += cluster.extra_args
    rendezvous = Rendezvous(
        nodes=cluster.nodes,
        node_rank="$SLURM_NODEID",
        endpoint=f"$TUNELOOP_RDZV_HOST:{cluster.rendezvous_port}",
        run_id="$SLURM_JOB_ID-${SLURM_RESTART_COUNT:-0}",
    )
    # Nodes may share a host name (containers): the watchdogs know each other by Slurm's.
    node = node_argv(
        params,
        rendezvous,
        f"{folder}/$SLURMD_NODENAME",
        python,
        peers=f"{folder}/peers-$SLURM_JOB_ID-{RUN}",
        node="$SLURMD_NODENAME",
    )
    exports = [f"export {name}={shell_words([value])}" for name, value in cluster.env.items()]
    lines = [
        "#!/bin/bash",
        *(f"#SBATCH {d}" for d in directives),
        "# Written by tuneloop's train stage (tuneloop/cluster/slurm.py) for this run.",
        "set -u",
        *exports,
        'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        # Node names need not resolve; the node's NodeAddr does.
        'TUNELOOP_RDZV_HOST=$(scontrol show node "$head" -o'
        " | sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p')",
        "export TUNELOOP_RDZV_HOST",
        'echo "tuneloop: job $SLURM_JOB_ID run ${SLURM_RESTART_COUNT:-0} on $SLURM_JOB_NODELIST,'
        ' rendezvous $TUNELOOP_RDZV_HOST"',
        # One file per run of the job: a requeued run must not find its predecessor's.
        f'export {SAVE_REQUEST_ENV}="{folder}/save-request-$SLURM_JOB_ID-{RUN}"',
        *save_and_requeue_lines(params),
        "trap save_and_requeue USR1",
        # In the background: bash runs a trap only between commands, so wait, not srun itself.
        # When one node's task ends, the others get a while to end on their own: a hung
        # node's peers stop stepping too, and their own watchdogs dump their stacks.
        f"srun --kill-on-bad-exit=0 --wait={peer_wait_s(params)} --ntasks-per-node=1 "
        f"bash -c {shell_words([node_line(node)])} &",
        "step=$!",
        'wait "$step"',
        "code=$?",
        # A trap ends the first wait early; the step is still running.
        'while kill -0 "$step" 2>/dev/null; do wait "$step"; code=$?; done',
        'exit "$code"',
    ]
    return "\n".join(lines) + "\n"


def save_wait_s(params: Params) -> int:
    """Seconds the batch shell gives the ranks to save before it requeues the job regardless:
    the requeue must come before the time limit, or the job ends TIMEOUT instead."""
    before = params.cluster.signal_before_end_s
    return max(before - 30, before // 2)


def save_and_requeue_lines(params: Params) -> list[str]:
    """The batch shell's trap for Slurm's signal before the time limit.

    It asks the ranks to save (tuneloop.training.preemption), waits until the step has ended
    or ``save_wait_s`` has passed, and requeues the job; the requeue ends any rank still
    running. A step that ended 0 without a save had finished training: the job completes.
    Once per run: a second USR1 (Slurm's own beside an operator's ``scancel --signal``) is
    ignored, or the trap would run again and requeue the job a second time.
    """
    request, saved = f'"${SAVE_REQUEST_ENV}"', f'"${SAVE_REQUEST_ENV}{SAVED_SUFFIX}"'
    return [
        "save_and_requeue() {",
        "  trap '' USR1",
        '  echo "tuneloop: the time limit nears; the ranks save a checkpoint at their next step"',
        f"  touch {request}",
        "  waited=0",
        f'  while kill -0 "$step" 2>/dev/null && [ "$waited" -lt {save_wait_s(params)} ]; do',
        "    sleep 1; waited=$((waited + 1))",
        "  done",
        f'  if ! kill -0 "$step" 2>/dev/null && [ ! -e {saved} ]; then',
        '    wait "$step" && { echo "tuneloop: training had ended; no requeue"; exit 0; }',
        "  fi",
        f'  [ -e {saved} ] && echo "tuneloop: saved $(cat {saved})"',
        '  echo "tuneloop: requeueing; the next run resumes from the newest checkpoint"',
        '  scontrol requeue "$SLURM_JOB_ID"',
        "}",
    ]


def peer_wait_s(params: Params) -> int:
    """Seconds srun lets the other tasks run once one has ended, before ending them."""
    wd = params.watchdog
    return int(2 * wd.deadlock_after_s + wd.kill_grace_s + 60)


def node_line(argv: list[str]) -> str:
    # The words are expanded on the node, inside srun's bash -c, not in the batch shell.
    return "exec " + shell_words(argv)


def submit(script: Path, env: Mapping[str, str]) -> str:
    """sbatch the script; the job id. ``env`` is the job's environment (--export=ALL)."""
    out = call("sbatch", "--parsable", str(script), env=env).strip()
    return out.split(";")[0]  # "<id>;<cluster>" on a federated cluster


def status(job_id: str) -> JobStatus | None:
    """The job as Slurm holds it now; None once Slurm no longer knows it (MinJobAge)."""
    try:
        out = call("scontrol", "show", "job", "-o", job_id)
    except SlurmError as error:
        if "Invalid job id" in str(error):
            return None
        raise
    fields = pairs(out.splitlines()[0])
    return JobStatus(
        job_id=job_id,
        state=fields.get("JobState", "UNKNOWN"),
        nodes=hostnames(fields.get("NodeList", "")),
        elapsed_s=seconds(fields.get("RunTime", "0:0:0")),
        reason=fields.get("Reason", ""),
        restarts=int(fields.get("Restarts", "0")),
    )


def cancel(job_id: str) -> None:
    call("scancel", job_id)


def runs(job_id: str) -> list[tuple[tuple[str, ...], float]]:
    """Each run of the job (a requeue runs it again): its nodes and elapsed seconds.

    ``sacct`` where the cluster keeps accounting; else jobcomp/filetxt's file; else none.
    """
    config = slurm_config()
    if config.get("AccountingStorageType", "accounting_storage/none") != "accounting_storage/none":
        found = []
        out = call("sacct", "-j", job_id, "-X", "-D", "-n", "-P", "-o", "ElapsedRaw,NodeList")
        for line in out.splitlines():
            elapsed, nodelist = line.split("|")
            found.append((hostnames(nodelist), float(elapsed or 0)))
        return found
    if config.get("JobCompType") == "jobcomp/filetxt" and config.get("JobCompLoc"):
        return _jobcomp_runs(Path(config["JobCompLoc"]), job_id)
    return []


def slurm_config() -> dict[str, str]:
    """``scontrol show config``: ``Key = Value`` a line."""
    found = {}
    for line in call("scontrol", "show", "config").splitlines():
        key, sep, value = line.partition("=")
        if sep:
            found[key.strip()] = value.strip()
    return found


def _jobcomp_runs(path: Path, job_id: str) -> list[tuple[tuple[str, ...], float]]:
    if not path.is_file():
        return []
    found = []
    for line in path.read_text().splitlines():
        fields = pairs(line)
        if fields.get("JobId") != job_id or "StartTime" not in fields:
            continue
        start = dt.datetime.fromisoformat(fields["StartTime"])
        end = dt.datetime.fromisoformat(fields["EndTime"])
        found.append((hostnames(fields.get("NodeList", "")), (end - start).total_seconds()))
    return found
