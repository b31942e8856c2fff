"""What the tests of the manual's "A release by hand" share: its block, its project.

The fenced block of that page is read from docs/how-to/release-by-hand.md, so the doc cannot
drift from what works. It runs in a temp project folder holding what ``make demo`` leaves for a
release: a registry with champion v1 and challenger v2 (two tiny models of one shape,
registered the way ``tuneloop.tracking.registry`` registers them, without training), and a
``configs/demo.yaml`` with short intervals. Three substitutions, none in what a command does: free
ports instead of
8001/8002/8080 (other tests run beside these), and the test session's Prefect server instead
of starting another (a second server costs half a minute here).
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

import yaml

from tests.helpers import ROOT
from tests.registry_helpers import register_champion_and_challenger
from tuneloop.net import free_port
from tuneloop.tracking import registry

MODEL = "tuneloop-support"
# A release in seconds: one short analysis per step, loose thresholds (two tiny random models
# on a busy 2-core runner; the thresholds' logic is tested in test_release.py).
OVERLAY: dict[str, dict[str, Any]] = {
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
# The block's ports, each replaced by a free one.
PORTS = ("8001", "8002", "8080")


PAGE = ROOT / "docs" / "how-to" / "release-by-hand.md"


def page_block(number: int = 0) -> str:
    """The page's ``number``-th bash block: 0 the release, 1 a second router replica."""
    text = PAGE.read_text(encoding="utf-8")
    found = re.findall(r"```bash\n(.*?)```", text, re.S)
    assert len(found) > number, f"{PAGE.name} has no ```bash block {number}"
    return str(found[number])


def make_project(tmp_path: Path, overlay: dict[str, dict[str, Any]]) -> Path:
    """``tmp_path/project``: champion v1 and challenger v2 registered, ``overlay`` as demo.yaml."""
    from tuneloop.demo.domain import tokenizer_corpus
    from tuneloop.demo.tiny import save_tiny
    from tuneloop.params import TinyModel

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
    (project / "configs" / "demo.yaml").write_text(yaml.safe_dump(overlay))
    register_champion_and_challenger(
        project,
        MODEL,
        [{registry.MERGED: str(folders[v])} for v in ("1", "2")],
        registry.CandidateModel(),
        registry.MODEL_NAME,
    )
    return project


def localised_block() -> tuple[str, dict[str, str]]:
    """The page's block for this test session, and the free port that replaces each port."""
    from prefect.settings import PREFECT_API_URL

    api = str(PREFECT_API_URL.value()).rstrip("/")
    ports = {port: str(free_port()) for port in PORTS}
    script = "\n".join(
        line for line in page_block().splitlines() if not line.startswith("prefect server start")
    )
    script = script.replace("http://127.0.0.1:4200/api", api)
    for old, new in ports.items():
        script = re.sub(rf"(?<=[:\s]){old}\b", new, script)
    return script, ports


def block_env() -> dict[str, str]:
    """The shell's environment: this venv first on PATH, this checkout's code, no hub."""
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_"))},
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(ROOT),
        "HF_HUB_OFFLINE": "1",
    }
