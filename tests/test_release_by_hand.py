"""The manual's "A release by hand" (docs/how-to/release-by-hand.md), run as written, start
to finish, on CPU backends.

The block, the project it runs in and the substitutions it gets (free ports, the test
session's Prefect server) are in ``tests/byhand_helpers.py``; it runs here in one
``bash -e``. ``test_release_replicas.py`` runs it again with a second router replica.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from tests.byhand_helpers import MODEL, OVERLAY, block_env, localised_block, make_project
from tests.helpers import write_params

# The whole suite (`make test`): the release flow in a subprocess
pytestmark = pytest.mark.slow


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    return make_project(tmp_path, OVERLAY)


def test_the_readme_release_runs_as_written(
    prefect_harness: None, repo: Path, tmp_path: Path
) -> None:
    script, ports = localised_block()
    write_params(repo, {"release": {"routers": [f"http://127.0.0.1:{ports['8080']}"]}})
    env = block_env()
    process = subprocess.Popen(
        ["bash", "-e", "-c", script],
        cwd=repo,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        text=True,
    )
    out = ""
    try:
        out, _ = process.communicate(timeout=360)
    except subprocess.TimeoutExpired as timeout:
        out = str(timeout.output or "") + "\n(timed out)"
    finally:
        # Whatever the script left running (a failed step stops it before its `kill`).
        if process.poll() is None:
            process.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    logs = {p.name: p.read_text(errors="replace")[-3000:] for p in (repo / "logs").glob("*.log")}
    shown = out[-6000:] + "".join(f"\n--- {k}\n{v}" for k, v in logs.items())
    assert process.returncode == 0, shown

    release_log = logs["release.log"]
    assert "release promoted: v2 promoted at 100 %" in release_log, shown
    assert "TypeError" not in release_log
    assert "approved" in out and "by alice" in out and "by bob" in out, out
    aliases = MlflowClient(f"sqlite:///{repo / 'mlflow.db'}").get_registered_model(MODEL).aliases
    assert {k: str(v) for k, v in aliases.items()} == {"champion": "2", "previous-champion": "1"}
    # `tuneloop status` at 10 % and after: a table, figures or "-", never "n/a ms".
    assert re.search(r"^arm\s+requests\s+errors\s+badcases\s+p99 latency\s+p99 TTFT$", out, re.M)
    assert "n/a" not in out and "challenger0" not in out
    assert "registry  champion v2, previous-champion v1" in out
    # The backends served the registry's versions from run/serve/, and customers were flagged.
    served = {
        a: yaml.safe_load((repo / "run/serve" / f"{a}.json").read_text())
        for a in ("champion", "challenger")
    }
    assert (served["champion"]["version"], served["challenger"]["version"]) == ("1", "2")
    assert list((repo / "data/badcases/incoming").glob("router-feedback-*.jsonl"))
