"""The demo on another model: its config file is an override of params.yaml, and it runs in a
checkout of its own (``tuneloop/demo/workspace.py``).

The shipped configs are loaded as the pipeline loads params (every key checked); a key
params.yaml does not have is refused, naming it; ``prepare`` makes ``demos/<model>/`` a clean
commit of the project's code with the merged params, the environment's folders shared with
the project, and takes the project's newer commits on the next run.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helpers import ROOT, copy_project, loopback_server
from tuneloop.demo import customers, workspace
from tuneloop.params import Params, parse_params

# The fast tier: no pipeline, server or rank.
pytestmark = pytest.mark.fast


def git(cwd: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", *args], cwd=cwd, check=True, capture_output=True, text=True, encoding="utf-8"
    )
    return done.stdout.strip()


def merged_config(name: str) -> tuple[dict[str, Any], Params]:
    config = ROOT / str(workspace.MODELS[name].config)
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    return params, parse_params(
        workspace.merged(params, yaml.safe_load(config.read_text()), config), config
    )


@pytest.mark.parametrize("name", [n for n, m in workspace.MODELS.items() if m.config])
def test_each_demo_config_merged_into_params_yaml_is_valid_params(name: str) -> None:
    params, loaded = merged_config(name)
    # Keys it does not name keep params.yaml's values; every demo trains a LoRA.
    assert loaded.clean == parse_params(params).clean
    assert loaded.train.method == "lora"


def test_the_two_task_demo_adds_its_tasks_on_the_embedded_base() -> None:
    params, loaded = merged_config("tasks")
    # `tasks` is the one group a config adds keys to: the project names its tasks.
    assert loaded.task_names() == ("support", "orders")
    assert tuple(loaded.for_task("orders").evaluate.suites) == ("orders_demo",)
    assert loaded.for_task("orders").tracking.registered_model == "tuneloop-orders"
    # The embedded base, taught to repeat the shop's text so that a LoRA can learn on it.
    assert loaded.model.base == parse_params(params).model.base == "builtin:tiny"
    assert loaded.model.tiny.copy_share > 0 == parse_params(params).model.tiny.copy_share
    # Its release is the tiny demo's: short intervals, the same checks.
    demo = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())["release"]
    assert loaded.release.model_dump(include=set(demo)) == parse_params(
        workspace.merged(params, {"release": demo}, Path("demo.yaml"))
    ).release.model_dump(include=set(demo))


def test_the_smollm2_demo_is_judged_and_served_by_vllm() -> None:
    params, loaded = merged_config("smollm2")
    assert loaded.model.base == "builtin:smollm2-135m-instruct"
    assert loaded.train.method == "lora"
    # Judged and released as served: the engine is named, not left to auto.
    assert (loaded.evaluate.backend, loaded.serve.engine) == ("vllm", "vllm")
    # Its adapter must fit the vLLM that serves it.
    assert loaded.train.lora_r <= loaded.serve.max_lora_rank
    # Keys it does not name keep params.yaml's values.
    assert loaded.tracking == parse_params(params).tracking


def test_a_configs_tasks_are_the_projects_but_a_key_of_another_group_is_checked() -> None:
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    assert params["tasks"] == {"support": {"folder": "."}}
    merged = workspace.merged(params, {"tasks": {"copy": {"folder": "c"}}}, Path("x.yaml"))
    assert merged["tasks"] == {"copy": {"folder": "c"}}
    with pytest.raises(workspace.BadConfig, match=r"x\.yaml: demo\.n_copies is not in params"):
        workspace.merged(params, {"demo": {"n_copies": 1}}, Path("x.yaml"))


def test_a_key_params_yaml_does_not_have_is_refused_by_name() -> None:
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    with pytest.raises(workspace.BadConfig, match=r"x\.yaml: train\.lora_rank is not in params"):
        workspace.merged(params, {"train": {"lora_rank": 8}}, Path("x.yaml"))
    with pytest.raises(workspace.BadConfig, match=r"x\.yaml: trainer is not in params"):
        workspace.merged(params, {"trainer": {}}, Path("x.yaml"))


def test_prepare_makes_a_clean_checkout_with_the_merged_params(tmp_path: Path) -> None:
    (tmp_path / "project").mkdir()
    repo = copy_project(tmp_path / "project")
    config = repo / "configs" / "demo-smollm2.yaml"
    config.parent.mkdir()
    shutil.copy(ROOT / "configs" / "demo-smollm2.yaml", config)
    git(repo, "add", "configs")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-qm", "config")

    target = workspace.prepare(repo, "smollm2")

    assert target == repo.resolve() / "demos" / "smollm2"
    params = yaml.safe_load((target / "params.yaml").read_text())
    assert params["model"]["base"] == "builtin:smollm2-135m-instruct"
    assert params["train"]["method"] == "lora"
    # The project's own params where the config says nothing (copy_project's tiny ones).
    assert params["gate"]["min_gain"] == 0.0 and params["demo"]["replay_turns"] == 1
    # The environment's folders are the project's: one wheel download, one vLLM build.
    assert params["paths"]["downloads"] == str(repo.resolve() / ".hf" / "downloads")
    assert params["serve"]["venv"] == str(repo.resolve() / ".venv-serve")
    assert params["paths"]["pool"] == "data/pool"  # the pipeline's own stay the checkout's
    # A clean commit on top of the project's: lineage names it and says not dirty.
    assert git(target, "status", "--porcelain", "--untracked-files=no") == ""
    assert git(target, "rev-parse", "HEAD~1") == git(repo, "rev-parse", "HEAD")

    # A later commit of the project is taken up by the next run, the params written again.
    (repo / "NOTES.md").write_text("a later commit\n")
    git(repo, "add", "NOTES.md")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-qm", "notes")
    workspace.prepare(repo, "smollm2")
    assert (target / "NOTES.md").exists()
    assert git(target, "rev-parse", "HEAD~1") == git(repo, "rev-parse", "HEAD")
    assert git(target, "status", "--porcelain", "--untracked-files=no") == ""
    assert yaml.safe_load((target / "params.yaml").read_text())["train"]["method"] == "lora"


def test_a_config_refused_by_the_checkouts_params_stops_before_any_stage(tmp_path: Path) -> None:
    (tmp_path / "project").mkdir()
    repo = copy_project(tmp_path / "project")
    config = repo / "configs" / "demo-smollm2.yaml"
    config.parent.mkdir()
    config.write_text(yaml.safe_dump({"train": {"learning_rate": -1.0}}))
    with pytest.raises(workspace.BadConfig, match=r"demo-smollm2\.yaml merged into params\.yaml"):
        workspace.prepare(repo, "smollm2")


def test_a_streamed_answer_is_read_from_its_events() -> None:
    events = [
        {"choices": [{"delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"delta": {"content": "[warranty] The Orbit"}}]},
        {"choices": [{"delta": {"content": " watch has a 24-month warranty."}}]},
        {"choices": [], "usage": {"completion_tokens": 12}},
    ]
    payload = "".join(f"data: {json.dumps(e)}\n\n" for e in events)
    assert customers.streamed_text(payload + "data: [DONE]\n\n") == (
        "[warranty] The Orbit watch has a 24-month warranty."
    )


def test_the_default_demo_runs_in_its_checkout_and_the_checkout_runs_it_there(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from tuneloop import cli

    prepared: list[str] = []
    started: list[list[str]] = []
    monkeypatch.setattr(workspace, "prepare", lambda repo, name: prepared.append(name) or tmp_path)
    monkeypatch.setattr(
        subprocess,
        "run",
        lambda command, **_: started.append(command) or subprocess.CompletedProcess(command, 0),
    )
    assert cli.main(["demo"]) == 0
    # make demo's: two tasks, in demos/tasks/; the checkout's process runs it where it is
    # (else it would prepare a checkout inside the checkout, and so on).
    assert prepared == ["tasks"]
    assert started[0][3:] == [
        "demo", "--repo", ".", "--here", "--months", "2", "--approval-wait", "5.0",
        "--release-overrides", "configs/demo-tasks.yaml",
    ]  # fmt: skip


@pytest.fixture
def answering_router() -> Iterator[tuple[str, list[float]]]:
    """A router stand-in that answers every chat request at once; when each arrived."""
    arrived: list[float] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            arrived.append(time.monotonic())
            self.rfile.read(int(self.headers["Content-Length"]))
            body = json.dumps({"choices": [{"message": {"content": "[shipping] soon"}}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    with loopback_server(Handler) as url:
        yield url, arrived


def test_customers_at_a_rate_arrive_evenly_and_none_after_stop(
    answering_router: tuple[str, list[float]],
) -> None:
    url, arrived = answering_router
    started = time.monotonic()
    report = customers.run(url, requests=6, concurrency=4, rate=10.0)
    assert report.tally("unknown").requests == 6  # the stand-in names no arm
    # Six requests at 10 a second: the sixth no sooner than 0.5 s after the start, where an
    # answer that comes at once would have let all six go within milliseconds.
    assert arrived[-1] - started >= 0.5
    stop = threading.Event()
    stop.set()
    before = len(arrived)
    customers.run(url, requests=6, concurrency=4, rate=10.0, stop=stop)
    assert len(arrived) == before


def test_a_rate_that_is_not_above_zero_is_refused() -> None:
    from tuneloop.cli import main

    with pytest.raises(ValueError, match="positive number of requests a second"):
        customers.run("http://127.0.0.1:9", requests=1, rate=0.0)
    assert main(["traffic", "--router", "http://127.0.0.1:9", "--rate", "-1"]) == 2
