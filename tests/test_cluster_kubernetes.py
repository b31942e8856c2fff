"""The Kubernetes launcher: the TrainJob it writes, and its status, logs and cancellation through
the kubernetes client, over API responses replayed by a local HTTP server
(tests/fixtures/kubernetes/; no cluster runs here)."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest

from tests.helpers import ROOT, loopback_server, write_params
from tuneloop.cli.rollout import training_job_line
from tuneloop.cluster import kubernetes
from tuneloop.cluster.job import JOB_FILE, Submitted
from tuneloop.cluster.submit import cancel, wait_for
from tuneloop.params import load_params

# The whole suite (`make test`): a local HTTP server replaying Kubernetes API responses
pytestmark = pytest.mark.slow

RESPONSES = ROOT / "tests/fixtures/kubernetes"
NAME = "tuneloop-train-20261205-010000"
JOBS = "/apis/trainer.kubeflow.org/v1alpha1/namespaces/ml/trainjobs"
PODS = "/api/v1/namespaces/ml/pods"


@dataclass
class Replay:
    """Answers each (method, path) with the next of its recorded responses (the last repeats)."""

    routes: dict[tuple[str, str], list[tuple[int, str]]]
    requests: list[tuple[str, str, dict[str, list[str]], Any]] = field(default_factory=list)

    def answer(self, method: str, url: str, body: Any) -> tuple[int, str, str]:
        parsed = urlparse(url)
        self.requests.append((method, parsed.path, parse_qs(parsed.query), body))
        queue = self.routes.get((method, parsed.path))
        if not queue:
            return 404, "application/json", (RESPONSES / "trainjob-not-found.json").read_text()
        code, name = queue.pop(0) if len(queue) > 1 else queue[0]
        kind = "text/plain" if name.endswith(".log") else "application/json"
        text = name.removesuffix(".log") if kind == "text/plain" else (RESPONSES / name).read_text()
        return code, kind, text


@pytest.fixture
def api(request: pytest.FixtureRequest) -> Iterator[tuple[Replay, Any]]:
    replay = Replay(routes={})

    class Handler(BaseHTTPRequestHandler):
        def _serve(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length)) if length else None
            code, kind, text = replay.answer(self.command, self.path, body)
            data = text.encode()
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_DELETE = _serve

        def log_message(self, *args: Any) -> None:
            pass

    from kubernetes import client

    with loopback_server(Handler) as url:
        yield replay, client.ApiClient(client.Configuration(host=url))


def kube_params(tmp_path: Path) -> Any:
    return load_params(
        write_params(
            tmp_path,
            {
                "batch": {"world_size": 16, "micro_batch_size": 1, "effective_batch": 16},
                "train": {"method": "lora", "distributed": "zero3", "launcher": "kubernetes"},
                "cluster": {
                    "nodes": 2,
                    "gpus_per_node": 8,
                    "image": "registry.example.com/tuneloop:1",
                    "namespace": "ml",
                    "queue": "gpu-queue",
                    "env": {"NCCL_IB_HCA": "mlx5"},
                },
            },
        )
    )


def test_the_trainjob_runs_every_nodes_watchdog_around_the_same_torchrun(tmp_path: Path) -> None:
    params = kube_params(tmp_path)
    job = kubernetes.trainjob(params, NAME, Path("/shared/project"))
    assert job["apiVersion"] == "trainer.kubeflow.org/v1alpha1" and job["kind"] == "TrainJob"
    assert job["metadata"]["labels"] == {"kueue.x-k8s.io/queue-name": "gpu-queue"}
    spec = job["spec"]
    assert spec["suspend"] is True  # Kueue admits it whole
    assert spec["runtimeRef"] == {
        "name": "torch-distributed",
        "apiGroup": "trainer.kubeflow.org",
        "kind": "ClusterTrainingRuntime",
    }
    trainer = spec["trainer"]
    assert trainer["numNodes"] == 2 and trainer["numProcPerNode"] == 8
    assert trainer["resourcesPerNode"] == {"limits": {"nvidia.com/gpu": 8}}
    assert trainer["env"] == [{"name": "NCCL_IB_HCA", "value": "mlx5"}]
    bash, flag, line = trainer["command"]
    assert (bash, flag) == ("bash", "-c")
    assert line.startswith("cd /shared/project && exec python -m tuneloop.cli watch ")
    assert '"--out-dir=/shared/project/reports/watch/' in line
    assert f"--peers=/shared/project/reports/watch/{NAME}/peers " in line
    assert '"--node=node-$PET_NODE_RANK"' in line
    assert (
        '-- python -m torch.distributed.run --nnodes=2 "--node-rank=$PET_NODE_RANK" '
        '--rdzv-backend=c10d "--rdzv-endpoint=$PET_MASTER_ADDR:$PET_MASTER_PORT" '
        f"--rdzv-id={NAME} --nproc-per-node=8 -m stages.train"
    ) in line


def test_status_follows_the_trainjob_from_kueue_to_complete(api: tuple[Replay, Any]) -> None:
    replay, client = api
    replay.routes = {
        ("POST", JOBS): [(201, "trainjob-created.json")],
        ("GET", f"{JOBS}/{NAME}"): [
            (200, "trainjob-suspended.json"),
            (200, "trainjob-running.json"),
            (200, "trainjob-complete.json"),
        ],
        ("GET", PODS): [(200, "pods.json")],
        ("GET", f"{PODS}/{NAME}-node-0-0-x7k2p/log"): [(200, "step 1\nstep 2\n.log")],
        ("GET", f"{PODS}/{NAME}-node-0-1-q9m4d/log"): [(200, "step 1\n.log")],
    }
    jobs = kubernetes.TrainJobs("ml", client)
    assert jobs.create(json.loads((RESPONSES / "trainjob-created.json").read_text())) == NAME
    seen = []

    def status(name: str) -> Any:
        now = jobs.status(name, now=dt.datetime(2026, 12, 5, 2, 30, tzinfo=dt.UTC))
        seen.append(now.state if now else None)
        return now

    ended = wait_for(NAME, status, lambda: None, poll_s=0.01)
    assert seen == ["PENDING", "RUNNING", "COMPLETED"]
    assert ended.nodes == ("gpu-a", "gpu-b")
    assert ended.elapsed_s == 3600  # creation to the Complete condition
    assert jobs.logs(NAME)[f"{NAME}-node-0-0-x7k2p"] == "step 1\nstep 2\n"
    (pods,) = [q for m, p, q, _ in replay.requests if p == PODS][:1]
    assert pods["labelSelector"] == [f"jobset.sigs.k8s.io/jobset-name={NAME}"]


def test_a_failed_trainjob_names_its_reason(api: tuple[Replay, Any]) -> None:
    replay, client = api
    replay.routes = {
        ("GET", f"{JOBS}/{NAME}"): [(200, "trainjob-failed.json")],
        ("GET", PODS): [(200, "pods.json")],
    }
    now = kubernetes.TrainJobs("ml", client).status(NAME)
    assert now is not None and now.state == "FAILED" and now.ended
    assert "BackoffLimitExceeded" in now.reason


def test_cancelling_deletes_the_trainjob_and_waits_until_it_is_gone(
    api: tuple[Replay, Any],
) -> None:
    replay, client = api
    replay.routes = {
        ("GET", f"{JOBS}/{NAME}"): [
            (200, "trainjob-running.json"),
            (404, "trainjob-not-found.json"),
        ],
        ("GET", PODS): [(200, "pods.json")],
        ("DELETE", f"{JOBS}/{NAME}"): [(200, "trainjob-deleted.json")],
    }
    jobs = kubernetes.TrainJobs("ml", client)
    last = cancel(NAME, jobs.status, jobs.delete, poll_s=0.01)
    assert last is not None and last.state == "RUNNING"  # the last state seen before it went
    (deleted,) = [query for m, _, query, _ in replay.requests if m == "DELETE"]
    assert deleted["propagationPolicy"] == ["Foreground"]
    assert jobs.status(NAME) is None


def test_status_shows_the_running_trainjob_with_its_nodes_and_elapsed_time(
    api: tuple[Replay, Any], tmp_path: Path
) -> None:
    replay, client = api
    params = kube_params(tmp_path)
    jobs = kubernetes.TrainJobs("ml", client)
    watch = tmp_path / params.paths.watch
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path)
        assert (
            training_job_line(params, jobs) == "no Kubernetes job submitted from this project yet"
        )
        (watch / "20261205-010000").mkdir(parents=True)
        submitted = Submitted(launcher="kubernetes", job_id=NAME, submitted_at="2026-12-05T01:00Z")
        (watch / "20261205-010000" / JOB_FILE).write_text(submitted.model_dump_json())
        replay.routes = {
            ("GET", f"{JOBS}/{NAME}"): [
                (200, "trainjob-running.json"),
                (404, "trainjob-not-found.json"),
            ],
            ("GET", PODS): [(200, "pods.json")],
        }
        line = training_job_line(params, jobs)
        assert line is not None and line.startswith(f"Kubernetes job {NAME} RUNNING on gpu-a,gpu-b")
        assert "elapsed " in line
        assert training_job_line(params, jobs) == (
            f"Kubernetes job {NAME} has ended (Kubernetes no longer lists it)"
        )
