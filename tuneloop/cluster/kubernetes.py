"""Kubernetes: a Kubeflow Trainer v2 ``TrainJob``, gang-scheduled by Kueue, through the API.

The kubernetes client's ``CustomObjectsApi`` rather than the ``kubeflow`` SDK: the SDK builds a
TrainJob from a Python function or its own trainer types, while every node here must run the
project's own line (its watchdog around torchrun), exactly what Slurm runs; the client writes
the TrainJob as the Trainer API documents it, reads its conditions and the pods' logs, and
deletes it, with nothing between this code and the API server.

The Trainer's torch runtime gives each node ``PET_NNODES``, ``PET_NODE_RANK``,
``PET_MASTER_ADDR`` and ``PET_MASTER_PORT``; the node's torchrun meets the others at the first
node's c10d store there. The project folder must be mounted at the same path in every pod
(the runtime's volume, on storage the nodes share), as on a Slurm cluster.

Not run against a cluster here: tests replay API responses written from the Trainer v2 API
(tests/fixtures/kubernetes/); docs/how-to/cluster.md says how to try it.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

from tuneloop.cluster.job import JobStatus, node_argv, shell_words
from tuneloop.params import Params
from tuneloop.training.plan import Rendezvous

GROUP = "trainer.kubeflow.org"
VERSION = "v1alpha1"
PLURAL = "trainjobs"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
# JobSet labels every pod of the TrainJob with the TrainJob's name.
POD_SELECTOR = "jobset.sigs.k8s.io/jobset-name={name}"


def trainjob(params: Params, name: str, project: Path) -> dict[str, Any]:
    """The TrainJob: ``cluster.nodes`` nodes, each running the node line of every launcher."""
    cluster = params.cluster
    rendezvous = Rendezvous(
        nodes=cluster.nodes,
        node_rank="$PET_NODE_RANK",
        endpoint="$PET_MASTER_ADDR:$PET_MASTER_PORT",
        run_id=name,
    )
    # The image's python; the watchdog's evidence beside Slurm's, one folder per pod's node.
    folder = f"{project / params.paths.watch}/{name}"
    out_dir = f"{folder}/node-$PET_NODE_RANK"
    argv = node_argv(
        params, rendezvous, out_dir, "python", peers=f"{folder}/peers", node="node-$PET_NODE_RANK"
    )
    line = "exec " + shell_words(argv)
    labels = {QUEUE_LABEL: cluster.queue} if cluster.queue else {}
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "TrainJob",
        "metadata": {"name": name, "namespace": cluster.namespace, "labels": labels},
        "spec": {
            "runtimeRef": {
                "name": cluster.runtime,
                "apiGroup": GROUP,
                "kind": "ClusterTrainingRuntime",
            },
            # Kueue admits the whole job or nothing: it unsuspends it when every node fits.
            **({"suspend": True} if cluster.queue else {}),
            "trainer": {
                "image": cluster.image,
                "numNodes": cluster.nodes,
                "numProcPerNode": cluster.gpus_per_node,
                "command": ["bash", "-c", f"cd {shell_words([str(project)])} && {line}"],
                "env": [{"name": k, "value": v} for k, v in sorted(cluster.env.items())],
                "resourcesPerNode": {"limits": {"nvidia.com/gpu": cluster.gpus_per_node}},
            },
        },
    }


def _time(value: str | None) -> dt.datetime | None:
    return dt.datetime.fromisoformat(value.replace("Z", "+00:00")) if value else None


def state_of(job: dict[str, Any]) -> str:
    """The TrainJob's conditions in Slurm's words (COMPLETED, FAILED, PENDING, RUNNING)."""
    conditions = {
        c["type"]: c for c in job.get("status", {}).get("conditions", []) if c["status"] == "True"
    }
    if "Complete" in conditions:
        return "COMPLETED"
    if "Failed" in conditions:
        return "FAILED"
    if job.get("spec", {}).get("suspend") or "Suspended" in conditions:
        return "PENDING"  # waiting for Kueue to admit it
    return "RUNNING"


def status_of(job: dict[str, Any], pods: list[Any], now: dt.datetime) -> JobStatus:
    """The TrainJob and its pods as a ``JobStatus``: state, nodes, elapsed since creation."""
    meta = job["metadata"]
    state = state_of(job)
    started = _time(meta.get("creationTimestamp")) or now
    ended = now
    for condition in job.get("status", {}).get("conditions", []):
        if condition["type"] in ("Complete", "Failed") and condition["status"] == "True":
            ended = _time(condition.get("lastTransitionTime")) or now
    reason = next(
        (c.get("message", "") for c in job.get("status", {}).get("conditions", [])),
        "",
    )
    nodes = sorted({pod.spec.node_name for pod in pods if pod.spec.node_name})
    return JobStatus(
        job_id=meta["name"],
        state=state,
        nodes=tuple(nodes),
        elapsed_s=max(0.0, (ended - started).total_seconds()),
        reason=reason,
    )


class TrainJobs:
    """The TrainJob API of one namespace, through the kubernetes client."""

    def __init__(self, namespace: str, api_client: Any = None) -> None:
        from kubernetes import client, config

        if api_client is None:
            try:
                config.load_incluster_config()  # the flow runs in a pod
            except config.ConfigException:
                config.load_kube_config()  # a login machine with kubectl set up
            api_client = client.ApiClient()
        self.namespace = namespace
        self.objects = client.CustomObjectsApi(api_client)
        self.core = client.CoreV1Api(api_client)

    def create(self, manifest: dict[str, Any]) -> str:
        created = self.objects.create_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, manifest
        )
        return str(created["metadata"]["name"])

    def pods(self, name: str) -> list[Any]:
        found = self.core.list_namespaced_pod(
            self.namespace, label_selector=POD_SELECTOR.format(name=name)
        )
        return list(found.items)

    def status(self, name: str, now: dt.datetime | None = None) -> JobStatus | None:
        from kubernetes.client.exceptions import ApiException

        try:
            job = self.objects.get_namespaced_custom_object(
                GROUP, VERSION, self.namespace, PLURAL, name
            )
        except ApiException as error:
            if error.status == 404:
                return None
            raise
        return status_of(job, self.pods(name), now or dt.datetime.now(dt.UTC))

    def logs(self, name: str) -> dict[str, str]:
        """Each pod's log so far, by pod name."""
        # Raw bytes: the client's own decoding of a text/plain body returns repr(bytes).
        return {
            pod.metadata.name: self.core.read_namespaced_pod_log(
                pod.metadata.name, self.namespace, _preload_content=False
            ).data.decode("utf-8", "replace")
            for pod in self.pods(name)
        }

    def delete(self, name: str) -> None:
        """Cancel: the TrainJob and, in the background, its JobSet and pods."""
        self.objects.delete_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, name, propagation_policy="Foreground"
        )
