"""The few MLflow REST calls a stage makes, without importing MLflow.

``import mlflow`` and its SQLite store cost a stage process more CPU than a month's ingest
(measured on 2 cores: 4.5 s for the import, 3 s more for SQLAlchemy and the store's
migrations check). Against an MLflow server (``MLFLOW_TRACKING_URI=http://...``: the one
``tuneloop.tracking.server`` starts for the flows and the demo, or a team's own) the data
stages log through these calls instead: the documented REST API 2.0
(``/api/2.0/mlflow/...``) and the server's artifact proxy (``/api/2.0/mlflow-artifacts``).
Every other use of MLflow goes through the ``mlflow`` package.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

# What the server accepts in one log-batch call (MLflow's documented limits).
MAX_METRICS, MAX_PARAMS, MAX_TAGS, MAX_ENTITIES = 1000, 100, 100, 1000
TIMEOUT_S = 60


class RestError(RuntimeError):
    """The MLflow server answered with an error (its error code and message are in the text)."""

    def __init__(self, message: str, code: str = "") -> None:
        super().__init__(message)
        self.code = code


def is_server(uri: str) -> bool:
    return uri.startswith(("http://", "https://"))


class Client:
    """One MLflow server, at ``uri`` (``http(s)://host:port``, as ``MLFLOW_TRACKING_URI``)."""

    def __init__(self, uri: str) -> None:
        self.uri = uri.rstrip("/")
        # The same credentials the mlflow package would send.
        self.headers = {"Content-Type": "application/json"}
        if token := os.environ.get("MLFLOW_TRACKING_TOKEN"):
            self.headers["Authorization"] = f"Bearer {token}"

    def call(self, method: str, endpoint: str, body: dict[str, Any] | None = None) -> Any:
        url = f"{self.uri}/api/2.0/mlflow/{endpoint}"
        data = None
        if method == "GET" and body:
            url += "?" + urllib.parse.urlencode(body)
        elif body is not None:
            data = json.dumps(body).encode()
        request = urllib.request.Request(url, data=data, method=method, headers=self.headers)
        return self._send(request)

    def _send(self, request: urllib.request.Request) -> Any:
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT_S) as answer:
                text = answer.read()
        except urllib.error.HTTPError as error:
            detail = error.read()[:2000].decode(errors="replace")
            try:
                code = str(json.loads(detail).get("error_code", ""))
            except ValueError:
                code = ""
            raise RestError(
                f"MLflow server {self.uri}: {request.get_method()} {request.full_url} -> "
                f"{error.code}: {detail}",
                code,
            ) from None
        return json.loads(text) if text else {}

    # --- experiments and runs ---------------------------------------------------------------

    def experiment_id(self, name: str) -> str:
        """The id of experiment ``name``, created (with the server's artifact root) if needed."""
        try:
            found = self.call("GET", "experiments/get-by-name", {"experiment_name": name})
            return str(found["experiment"]["experiment_id"])
        except RestError as error:
            if error.code != "RESOURCE_DOES_NOT_EXIST":
                raise
        return str(self.call("POST", "experiments/create", {"name": name})["experiment_id"])

    def create_run(self, experiment_id: str, name: str, tags: dict[str, str]) -> dict[str, Any]:
        """A new RUNNING run; its ``info`` (``run_id``, ``artifact_uri``)."""
        body = {
            "experiment_id": experiment_id,
            "run_name": name,
            "start_time": _now_ms(),
            "tags": _pairs(tags | {"mlflow.runName": name}),
        }
        return dict(self.call("POST", "runs/create", body)["run"]["info"])

    def get_run(self, run_id: str) -> dict[str, Any]:
        return dict(self.call("GET", "runs/get", {"run_id": run_id})["run"])

    def set_status(self, run_id: str, status: str) -> None:
        body: dict[str, Any] = {"run_id": run_id, "status": status}
        if status != "RUNNING":
            body["end_time"] = _now_ms()
        self.call("POST", "runs/update", body)

    def log_batch(
        self,
        run_id: str,
        metrics: dict[str, float] | None = None,
        params: dict[str, str] | None = None,
        tags: dict[str, str] | None = None,
    ) -> None:
        """Log everything, split into batches the server accepts."""
        now = _now_ms()
        queue: list[tuple[str, dict[str, Any], int]] = [
            *(
                ("metrics", {"key": k, "value": v, "timestamp": now, "step": 0}, MAX_METRICS)
                for k, v in (metrics or {}).items()
            ),
            *(("params", {"key": k, "value": v}, MAX_PARAMS) for k, v in (params or {}).items()),
            *(("tags", {"key": k, "value": v}, MAX_TAGS) for k, v in (tags or {}).items()),
        ]
        batch: dict[str, list[dict[str, Any]]] = {"metrics": [], "params": [], "tags": []}
        for kind, entry, limit in queue:
            if len(batch[kind]) >= limit or sum(map(len, batch.values())) >= MAX_ENTITIES:
                self.call("POST", "runs/log-batch", {"run_id": run_id, **batch})
                batch = {"metrics": [], "params": [], "tags": []}
            batch[kind].append(entry)
        if any(batch.values()):
            self.call("POST", "runs/log-batch", {"run_id": run_id, **batch})

    def log_inputs(self, run_id: str, datasets: list[dict[str, Any]]) -> None:
        """``datasets``: ``{"dataset": {name, digest, source_type, source}, "tags": [...]}``."""
        self.call("POST", "runs/log-inputs", {"run_id": run_id, "datasets": datasets})

    def log_artifact(self, artifact_uri: str, name: str, data: bytes) -> None:
        """Store ``data`` as artifact ``name`` of the run whose artifact root is ``artifact_uri``.

        ``mlflow-artifacts:/...``: through the server's artifact proxy. ``file:...`` (a store
        created without the proxy, e.g. by a process on this machine): into that folder.
        """
        scheme = urllib.parse.urlsplit(artifact_uri).scheme
        if scheme == "mlflow-artifacts":
            path = urllib.parse.urlsplit(artifact_uri).path.lstrip("/")
            url = f"{self.uri}/api/2.0/mlflow-artifacts/artifacts/{path}/{name}"
            headers = self.headers | {"Content-Type": "application/octet-stream"}
            request = urllib.request.Request(url, data=data, method="PUT", headers=headers)
            self._send(request)
        elif scheme in ("file", ""):
            folder = Path(urllib.request.url2pathname(urllib.parse.urlsplit(artifact_uri).path))
            target = folder / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        else:
            raise RestError(
                f"artifact root {artifact_uri!r}: the stage logs artifacts through the MLflow "
                "server's proxy (mlflow-artifacts:) or to a local folder; start the server with "
                "--serve-artifacts, or unset MLFLOW_TRACKING_URI's server for this stage"
            )

    # --- the registry -------------------------------------------------------------------------

    def alias_version(self, name: str, alias: str) -> dict[str, Any] | None:
        """The model version holding ``alias`` (``version``, ``run_id``, ``tags`` as a dict);
        None when the model or the alias does not exist."""
        try:
            found = self.call("GET", "registered-models/alias", {"name": name, "alias": alias})
        except RestError as error:
            if error.code in ("RESOURCE_DOES_NOT_EXIST", "NOT_FOUND", "INVALID_PARAMETER_VALUE"):
                return None
            raise
        version = found["model_version"]
        return {
            "version": str(version["version"]),
            "run_id": version.get("run_id") or None,
            "tags": {t["key"]: t["value"] for t in version.get("tags", [])},
        }


def _now_ms() -> int:
    return int(time.time() * 1000)


def _pairs(tags: dict[str, str]) -> list[dict[str, str]]:
    return [{"key": key, "value": value} for key, value in tags.items()]
