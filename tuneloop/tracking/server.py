"""A local MLflow server over the project's own store, for the length of a flow or the demo.

A stage that opens the SQLite store itself pays for MLflow's import and its SQLAlchemy store
(about 7 s of CPU on 2 cores) in every process; against a server the data stages log over
REST without importing MLflow (``tuneloop.tracking.rest``). So the flows and the demo start
one, as they start Prefect's: ``mlflow server`` on a free loopback port with the project's
``mlflow.db`` and ``mlartifacts/``, one worker, no job runner (ready in about 9 s, against
30 s and seven job processes by default). A user's own ``MLFLOW_TRACKING_URI`` is used as it is.

The store is the same file, and stays usable without the server: a plain ``dvc repro`` after
the demo opens it directly. So this server does not proxy artifacts. With ``--serve-artifacts``
(MLflow's default) every experiment it creates would record its artifact root as
``mlflow-artifacts:/...``, a URI only a server resolves, and the next stage run without one
fails. Here the root is the plain folder ``mlartifacts/``, which every process on this machine
reads and writes directly, as it does without the server.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from tuneloop.net import free_port
from tuneloop.tracking import runs

log = logging.getLogger(__name__)

START_TIMEOUT_S = 300  # about 9 s on an idle machine; minutes on a busy one


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as answer:
            return bool(answer.status == 200)
    except (urllib.error.URLError, OSError):
        return False


@contextlib.contextmanager
def local_server(root: Path, logs: Path) -> Iterator[str]:
    """The tracking URI to use inside the block: the user's ``MLFLOW_TRACKING_URI`` or a
    server already in use (a flow inside the demo), else a server started here over
    ``root``'s store, stopped when the block ends; its output goes to ``logs``."""
    current = runs.tracking_uri()
    if not current.startswith("sqlite:"):
        yield current
        return
    root = root.resolve()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    logs.mkdir(parents=True, exist_ok=True)
    command = [
        str(Path(sys.executable).with_name("mlflow")),
        "server",
        *("--host", "127.0.0.1", "--port", str(port), "--workers", "1"),
        *("--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}"),
        *("--no-serve-artifacts", "--default-artifact-root", (root / "mlartifacts").as_uri()),
    ]
    env = os.environ | {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    with (logs / "mlflow-server.log").open("ab") as out:
        # Its own process group: `mlflow server` runs uvicorn as a child, stopped with it.
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _healthy(url):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"mlflow server did not start (see {logs / 'mlflow-server.log'}); start one "
                    "yourself and set MLFLOW_TRACKING_URI"
                )
            time.sleep(0.5)
        log.info("MLflow server %s over %s", url, root / "mlflow.db")
        with runs.use_tracking_uri(url):
            yield url
    finally:
        _stop(process)


def _stop(process: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
