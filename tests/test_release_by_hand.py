"""The README's "Try a release on one machine", run as written, start to finish, on CPU backends.

The fenced block of that section is read from README.md, so the doc cannot drift from what
works. It runs in one ``bash -e`` in a temp project folder holding what ``make demo`` leaves
for a release: a registry with champion v1 and challenger v2 (two tiny models of one shape,
registered the way ``tuneloop.registry`` registers them, without training), and a
``configs/demo.yaml`` with short intervals. Three substitutions, none in what a command does:
free ports instead of 8001/8002/8080 (other tests run beside this one), and the test session's
Prefect server instead of starting another (a second server costs half a minute here).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from tests.helpers import ROOT, free_port, write_params
from tests.registry_helpers import register_champion_and_challenger
from tuneloop import registry

pytestmark = pytest.mark.slow

MODEL = "tuneloop-support"
# A release in seconds: one short analysis per step, loose thresholds (two tiny random models
# on a busy 2-core runner; the thresholds' logic is tested in test_release.py).
OVERLAY = {
    "release": {
        "steps": [10, 50, 100],
        # 10 % of the demo customers' 4-5 requests a second: a few challenger requests each.
        "analysis_interval": 6.0,
        "analyses_per_step": 1,
        "failure_limit": 10,
        "min_requests": 1,
        "min_latency_samples": 1,
        "min_ttft_samples": 1,
        "max_badcase_rate_increase": 1.0,
        "max_latency_p99_ratio": 100.0,
        "max_ttft_p99_ratio": 100.0,
        "approval_timeout": 300,
        "loadtest": {
            "enabled": True,
            "requests": 4,
            "concurrency": 2,
            "max_tokens": 8,
            "max_ttft_ratio": 100.0,
            "max_tpot_ratio": 100.0,
        },
    }
}


def readme_block() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Try a release on one machine", 1)[1].split("\n## ", 1)[0]
    found = re.search(r"```bash\n(.*?)```", section, re.S)
    assert found, "the README's release section has no ```bash block"
    return found.group(1)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    from tuneloop.demo import tokenizer_corpus
    from tuneloop.params import TinyModel
    from tuneloop.tiny import save_tiny

    shape = TinyModel(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=128, vocab_size=600, max_position_embeddings=512,
    )  # fmt: skip
    corpus = list(tokenizer_corpus(0))
    folders = {"1": tmp_path / "models" / "v1", "2": tmp_path / "models" / "v2"}
    for seed, path in enumerate(folders.values()):
        save_tiny(path, shape, corpus, seed=seed)
    project = tmp_path / "project"
    (project / "configs").mkdir(parents=True)
    (project / "configs" / "demo.yaml").write_text(yaml.safe_dump(OVERLAY))
    register_champion_and_challenger(
        project,
        MODEL,
        [{registry.MERGED: str(folders[v])} for v in ("1", "2")],
        registry.CandidateModel(),
        registry.MODEL_NAME,
    )
    return project


def test_the_readme_release_runs_as_written(
    prefect_harness: None, repo: Path, tmp_path: Path
) -> None:
    from prefect.settings import PREFECT_API_URL

    api = str(PREFECT_API_URL.value()).rstrip("/")
    ports = {port: str(free_port()) for port in ("8001", "8002", "8080")}
    script = readme_block()
    script = "\n".join(
        line for line in script.splitlines() if not line.startswith("prefect server start")
    )
    script = script.replace("http://127.0.0.1:4200/api", api)
    for old, new in ports.items():
        script = re.sub(rf"(?<=[:\s]){old}\b", new, script)
    write_params(repo, {"release": {"routers": [f"http://127.0.0.1:{ports['8080']}"]}})
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_"))},
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(ROOT),
        "HF_HUB_OFFLINE": "1",
    }
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
