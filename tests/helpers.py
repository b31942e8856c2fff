"""What the tests share that is not a fixture: the tiny project and its params.

Test modules import from here (never from each other); ``conftest.py`` holds the fixtures.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import httpx
import yaml

# CHROMIUM: Debian's headless Chromium, for the browser tests (each skips without it).
from docs.devtools import CHROMIUM as CHROMIUM
from docs.devtools import headless
from tuneloop.net import free_port
from tuneloop.pipeline import SHARED_STAGES

if TYPE_CHECKING:
    from tuneloop.orchestration.flow_results import PipelineRun, TasksRun

ROOT = Path(__file__).resolve().parents[1]
# params.yaml's one task, in the project's root.
TASK = "support"


def task_entry(name: str, suite: str = "support_demo") -> dict[str, Any]:
    """A task of a project of several, as params.yaml lists it: its folder, model and suite."""
    return {"folder": f"tasks/{name}", "registered_model": f"tuneloop-{name}", "suites": [suite]}


def dvc_name(stage: str, task: str = TASK) -> str:
    """What DVC (and a stage's MLflow run) calls ``stage`` of ``task``: ``train@support``."""
    return stage if stage in SHARED_STAGES or "@" in stage else f"{stage}@{task}"


# Small enough for a test, big enough that every stage does real work.
TINY_OVERRIDES: dict[str, dict[str, Any]] = {
    # A few steps of the base's general-skill pre-training: the code path, not the skill.
    "model": {"tiny": {"pretrain_steps": 10}},
    # One single-question replay chat in five: the small loops' 30-step LoRA learns the reply
    # format from the domain chats (the demo's two-question replay, one in three, left it less).
    # The small loops' asserts were measured on the share of refusals the demo had before its
    # month 2 needed more of them (demo.unknown_rate), and they keep it.
    "demo": {
        "n_support": 500,
        "n_badcases": 40,
        "replay_every": 5,
        "replay_turns": 1,
        "unknown_rate": 0.12,
    },
    "pack": {"seq_len": 128},
    # LoRA, the method real models train with (the demo's default trains the tiny one in full).
    "train": {
        "method": "lora",
        "learning_rate": 3.0e-3,
        "max_steps": 30,
        "logging_steps": 5,
        "loss_spike_factor": 5.0,
    },
    # The general suite's first 24 of its 163 items: the forgetting budget's code path. Where a
    # test judges forgetting itself (tests/test_evaluate.py), it scores them all.
    "evaluate": {"limit": 12, "batch_size": 12, "general_limit": 24},
    "gate": {"min_gain": 0.0, "max_forgetting": 0.05, "fp8_max_drop": 0.02},
}


# Full training under which the tiny candidate learns the reply format and passes the gate on
# format_compliance (the small loops in tests/test_loop.py and tests/test_team_stack.py). Since
# each Chinese character is a token, 40 steps scored format 0.000 in month 1; 100 steps (5 s)
# scored 1.000 on month 2's data.
PASSING_TRAIN: dict[str, Any] = {
    "method": "full",
    "max_steps": 100,
    "learning_rate": 3.0e-3,
    "logging_steps": 10,
}


@contextlib.contextmanager
def loopback_server(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """``handler`` served on a free loopback port in a thread; its root URL, closed on exit."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


def wait_until(
    check: Callable[[], object],
    timeout: float,
    what: str = "the condition",
    step: float = 0.1,
    retry_on: tuple[type[BaseException], ...] = (),
) -> float:
    """Seconds until ``check()`` is true, polled every ``step``; fails the test after
    ``timeout``. A check that raises one of ``retry_on`` (a server restarting) counts as false.

    Waits on a condition, not on the wall clock: a test is as fast as the thing it waits for.
    """
    start = time.monotonic()
    while True:
        with contextlib.suppress(*retry_on):
            if check():
                return time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(step)


def write_params(folder: Path, overrides: dict[str, dict[str, Any]] | None = None) -> Path:
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    for source in (TINY_OVERRIDES, overrides or {}):
        for group, values in source.items():
            if group == "tasks":  # the project's tasks, not more of them
                params[group] = values
                continue
            for key, value in values.items():
                # One level deeper for sub-groups (model.tiny): override keys, keep the rest.
                if isinstance(value, dict) and isinstance(params[group].get(key), dict):
                    params[group][key].update(value)
                else:
                    params[group][key] = value
    path = folder / "params.yaml"
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    return path


def stage_runs(found: list[Any], retrain_run_id: str) -> dict[str, Any]:
    """Of ``found`` (MLflow runs), the stage runs of retrain run ``retrain_run_id``, by stage:
    the shared stages' are its children, each task's the children of the task's run in it."""
    below = {retrain_run_id} | {
        r.info.run_id
        for r in found
        if r.data.tags.get("mlflow.parentRunId") == retrain_run_id and "task" in r.data.tags
    }
    return {
        r.data.tags["tuneloop.stage"]: r
        for r in found
        if r.data.tags.get("mlflow.parentRunId") in below and "tuneloop.stage" in r.data.tags
    }


def flow_runs(repo: Path) -> tuple[Any, dict[str, Any]]:
    """The first retrain run in ``repo``'s MLflow store and its stage runs, by stage."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{repo / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("tuneloop")
    assert experiment is not None
    found = client.search_runs([experiment.experiment_id], order_by=["attributes.start_time ASC"])
    parent = next(r for r in found if "mlflow.parentRunId" not in r.data.tags)
    return parent, stage_runs(found, parent.info.run_id)


def ran(result: TasksRun, task: str = TASK) -> PipelineRun:
    """Task ``task``'s pipeline in a retrain's result: it ran (not skipped, not failed)."""
    from tuneloop.orchestration.flow_results import PipelineRun

    outcome = result.tasks[task]
    assert isinstance(outcome, PipelineRun), outcome
    return outcome


def seed_demo_month(repo: Path) -> None:
    """The demo's month 1 in ``repo``'s incoming folder, sized by its own params.yaml."""
    from tuneloop.demo import domain
    from tuneloop.params import load_params

    params = load_params(repo / "params.yaml")
    domain.seed_month(repo / params.paths.incoming, params.demo)


def copy_project(target: Path) -> Path:
    """A git + DVC checkout of this project's code in ``target``, with tiny params."""
    for name in ("dvc.yaml", ".dvcignore", "pyproject.toml"):
        shutil.copy(ROOT / name, target / name)
    for name in ("stages", "tuneloop", "flows", "eval"):
        shutil.copytree(ROOT / name, target / name, ignore=shutil.ignore_patterns("__pycache__"))
    (target / ".dvc").mkdir()
    shutil.copy(ROOT / ".dvc" / "config", target / ".dvc" / "config")
    shutil.copy(ROOT / ".dvc" / ".gitignore", target / ".dvc" / ".gitignore")
    shutil.copy(ROOT / ".gitignore", target / ".gitignore")
    write_params(target)
    git = ["git", "-c", "user.name=test", "-c", "user.email=test@example.com"]
    subprocess.run([*git, "init", "-q"], cwd=target, check=True)
    subprocess.run([*git, "add", "-A"], cwd=target, check=True)
    subprocess.run([*git, "commit", "-qm", "tiny project"], cwd=target, check=True)
    return target


def chat_messages(record: dict[str, object]) -> list[dict[str, str]]:
    """A demo support record as chat messages (what clean makes of it)."""
    if "messages" in record:
        return cast(list[dict[str, str]], record["messages"])
    return [
        {"role": "user", "content": str(record["prompt"])},
        {"role": "assistant", "content": str(record["response"])},
    ]


def chat_lines(seed: int, n: int) -> list[str]:
    """``n`` demo support records as clean's training lines (``{"id", "messages"}``)."""
    from tuneloop.demo import domain

    return [
        json.dumps({"id": f"{seed}-{i}", "messages": chat_messages(r)}, ensure_ascii=False)
        for i, r in enumerate(domain.support_records(seed, n))
    ]


def chromium(url: str, profile: Path, *extra: str) -> str:
    """Load ``url`` in headless Chromium (``--dump-dom``, ``--screenshot=...`` in ``extra``)."""
    command = [*headless(profile), "--virtual-time-budget=20000", *extra, url]
    return subprocess.run(command, capture_output=True, text=True, timeout=120).stdout


@contextlib.contextmanager
def mlflow_server(store_uri: str) -> Iterator[str]:
    """``mlflow server`` (the UI) on a free loopback port over ``store_uri``; its base URL."""
    port = free_port()
    env = os.environ | {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    command = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1"]
    command += ["--port", str(port), "--workers", "1", "--backend-store-uri", store_uri]
    server = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert server.poll() is None, "mlflow server exited"
            assert time.monotonic() < deadline, "mlflow server did not start in 90 s"
            time.sleep(0.5)
        yield base
    finally:
        server.terminate()
        server.wait(timeout=30)


def tokens_of(path: Path, cache: Path | None, tokenizer: Any) -> Any:
    """The tokens of every line of a chats file, as pack gets them (``tokencache``)."""
    from tuneloop.data import token_cache

    return token_cache.tokens_of_lines(token_cache.split_lines(path.read_bytes()), cache, tokenizer)


# PostgreSQL for the team stack and the review store: Debian's binaries, as the postgres user.
INITDB = ["-U", "postgres", "-A", "trust", "-E", "UTF8", "--locale=C", "--no-sync"]


def postgres_bin() -> Path | None:
    """The PostgreSQL server binaries: on PATH, else Debian's versioned folder."""
    found = shutil.which("pg_ctl")
    if found:
        return Path(found).resolve().parent
    versions = sorted(
        Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"),
        key=lambda path: int(path.parts[-3]) if path.parts[-3].isdigit() else 0,
    )
    return versions[-1].parent if versions else None


# --- changing one thing a cache's value depends on --------------------------------------------


def demo_tokenizer(folder: Path, change: str = "nothing") -> Path:
    """The data tests' tokenizer saved in ``folder``, with one change: ``tokenizer.json``
    (another vocabulary, the same template) or ``chat template`` (another template)."""
    from tuneloop.demo import domain, tiny

    tokenizer = tiny.build_tokenizer(
        domain.tokenizer_corpus(0), 400 if change == "tokenizer.json" else 512
    )
    if change == "chat template":
        tokenizer.chat_template = tiny.CHAT_TEMPLATE.replace("'\\n'", "'\\n\\n'")
    tokenizer.save_pretrained(folder)
    return folder


def edited_code(folder: Path, source: Path, names: tuple[str, ...], edited: str) -> Path:
    """A copy of modules ``names`` of ``source`` in ``folder``, ``edited`` one comment longer:
    point a module's ``__file__`` into it, and what it hashes of its package's code changes."""
    folder.mkdir(parents=True)
    for name in names:
        shutil.copy(source / name, folder / name)
    with (folder / edited).open("a", encoding="utf-8") as out:
        out.write("# edited\n")
    return folder


def changed_tokenizer(change: str, tokenizer: Any, folder: Path, monkeypatch: Any) -> Any | None:
    """The tokenizer after ``change`` to what its token ids depend on (its files, the
    tokenizers or jinja2 version), or None when ``change`` is none of those."""
    from tuneloop.data import chat
    from tuneloop.data.chat import ChatTokenizer

    if change in ("tokenizer.json", "chat template"):
        return ChatTokenizer.from_folder(demo_tokenizer(folder / "other", change))
    if change == "tokenizers version":
        import tokenizers

        monkeypatch.setattr(tokenizers, "__version__", "0.0.0")
    elif change == "jinja2 version":
        monkeypatch.setattr(chat, "version", lambda name: "0.0.0")
    else:
        return None
    return ChatTokenizer.from_folder(tokenizer.folder or folder)
