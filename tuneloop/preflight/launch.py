"""Checks of a cluster launch, before anything is submitted (``train.launcher`` slurm).

- the ranks the job starts (``cluster.nodes`` x ``cluster.gpus_per_node``) are the shards
  ``pack`` wrote: one rank short or over and a collective waits for ever at the epoch's end;
- the partition exists, is up and has the nodes;
- every path the ranks read or write is on storage the nodes share: the adapter rank 0 writes
  on a node must be where the stage (on the login node) finds it.

Each problem is one sentence naming the key and the fix.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from pathlib import Path

from tuneloop.cluster import slurm
from tuneloop.data.shards import SHARD_GLOB
from tuneloop.judge.verdict import Check
from tuneloop.params import Params

# Filesystems every node of a cluster mounts alike.
SHARED_FILESYSTEMS = frozenset(
    {
        "nfs",
        "nfs4",
        "lustre",
        "gpfs",
        "beegfs",
        "cephfs",
        "ceph",
        "glusterfs",
        "fuse.glusterfs",
        "fuse.juicefs",
        "fuse.cephfs",
        "wekafs",
        "panfs",
        "virtiofs",
    }
)
# The paths the ranks use, by their params key.
RANK_PATHS = ("packed", "clean", "base_model", "init", "checkpoints", "adapter", "metrics", "watch")


def packed_world_size(packed: Path) -> int:
    """The ranks ``pack`` cut the shards for: one ``rank-NNNNN.parquet`` each."""
    return len(list(packed.glob(SHARD_GLOB)))


def world_size_problems(params: Params) -> list[str]:
    cluster = params.cluster
    ranks = cluster.nodes * cluster.gpus_per_node
    shards = packed_world_size(params.paths.packed)
    if ranks == shards:
        return []
    return [
        f"cluster.nodes x cluster.gpus_per_node starts {cluster.nodes} x "
        f"{cluster.gpus_per_node} = {ranks} ranks, but {params.paths.packed} holds {shards} "
        f"rank shards (pack cut them for batch.world_size {shards}): set the cluster to "
        f"{shards} ranks, or batch.world_size to {ranks} and rerun pack and preflight"
    ]


def filesystem_type(path: Path) -> str:
    """The type of the filesystem ``path`` (or its nearest existing folder) lies on."""
    path = path.resolve()
    while not path.exists():
        path = path.parent
    best, kind = "", "unknown"
    with open("/proc/mounts", encoding="utf-8") as mounts:
        for line in mounts:
            _, point, fstype, *_ = line.split()
            point = point.replace("\\040", " ")
            if path.is_relative_to(point) and len(point) > len(best):
                best, kind = point, fstype
    return kind


def is_this_host(address: str) -> bool:
    """A node address that reaches this machine: any loopback address (127.0.0.0/8, not only
    127.0.0.1: nodes on one host may each have their own), or this host's name."""
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address in {"localhost", socket.gethostname(), socket.getfqdn()}


def shared_path_problems(params: Params, node_addresses: list[str], project: Path) -> list[str]:
    """Paths not on shared storage; none when every node is this host (one machine)."""
    if all(is_this_host(address) for address in node_addresses):
        return []
    problems = []
    named = {"project": project, **{f"paths.{k}": getattr(params.paths, k) for k in RANK_PATHS}}
    for key, path in named.items():
        kind = filesystem_type(project / path)
        if kind not in SHARED_FILESYSTEMS:
            problems.append(
                f"{key} ({(project / path).resolve()}) is on a {kind} filesystem, which the "
                "other nodes do not see: put the project on storage every node mounts (NFS, "
                "Lustre, GPFS, CephFS, ...) and run the flow from there"
            )
    return problems


def slurm_problems(params: Params, project: Path) -> list[str]:
    cluster = params.cluster
    try:
        found = slurm.partition(cluster.partition)
        addresses = slurm.node_addresses()
    except slurm.SlurmError as error:
        return [f"train.launcher 'slurm': cannot ask Slurm: {error}"]
    what = f"cluster.partition {cluster.partition!r}" if cluster.partition else "the default"
    if found is None:
        partitions = slurm.call("sinfo", "-h", "-o", "%P").split()
        return [
            f"{what} partition does not exist on this cluster; its partitions: "
            f"{', '.join(partitions) or 'none'}: set cluster.partition to one of them"
        ]
    problems = []
    if found.state != "UP":
        problems.append(f"partition {found.name!r} is {found.state}, not UP: ask for another")
    if len(found.nodes) < cluster.nodes:
        problems.append(
            f"cluster.nodes is {cluster.nodes} but partition {found.name!r} has "
            f"{len(found.nodes)} node(s) ({', '.join(found.nodes)}): lower cluster.nodes or "
            "choose a larger partition"
        )
    node_addresses = [addresses.get(node, node) for node in found.nodes]
    return problems + shared_path_problems(params, node_addresses, project)


def launch_problems(params: Params, project: Path | None = None) -> list[str]:
    """Everything that would make the cluster job fail or hang, before it is submitted."""
    project = project or Path(os.getcwd())
    problems = world_size_problems(params)
    if params.train.launcher == "slurm":
        problems += slurm_problems(params, project)
    return problems


def check_launch(params: Params, project: Path | None = None) -> Check:
    """The preflight stage's view of the launch, so ``dvc repro`` stops there, before train
    submits anything (train checks again at submit time: the cluster may change between)."""
    name = "cluster_launch"
    launcher, cluster = params.train.launcher, params.cluster
    if launcher == "local":
        return Check(name, "skip", "train.launcher local: torchrun on this machine")
    problems = launch_problems(params, project)
    if problems:
        return Check(name, "fail", "; ".join(problems))
    ranks = cluster.nodes * cluster.gpus_per_node
    where = f"partition {cluster.partition!r}" if cluster.partition else "the default partition"
    found = f", {where} up with the nodes" if launcher == "slurm" else ""
    return Check(
        name,
        "pass",
        f"{launcher}: {cluster.nodes} node(s) x {cluster.gpus_per_node} = {ranks} ranks, the "
        f"packed shards'{found}",
    )
