"""Preflight on a real packed project: the stage, the DDP hang it prevents, dvc repro stopping.

One small project (a tiny model, demo chats, pack's own shards for two ranks) is built per
module; tests that tamper with it work on a copy. The torchrun tests run
``fixtures/ddp_train_shards.py``, a DDP loop over the shards on gloo, so the hang is the real
one: rank 1, one micro-batch short, waits at the epoch-end barrier while rank 0 waits in the
gradient all-reduce of its last batch.
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
from pathlib import Path
from typing import Any

import psutil
import pyarrow.parquet as pq
import pytest
from mlflow.tracking import MlflowClient

from stages import pack, preflight
from tests.helpers import ROOT, chat_messages, copy_project, dvc_name, write_params
from tuneloop.data.shards import shard_name
from tuneloop.demo import domain, tiny
from tuneloop.judge import suites
from tuneloop.params import load_params
from tuneloop.pipeline import stage_order
from tuneloop.preflight import run as pf_run
from tuneloop.telemetry.actions import find_py_spy, py_spy_dump

# The whole suite (`make test`): torchrun ranks, dvc repro
pytestmark = pytest.mark.slow

# Small enough that two ranks step through an epoch in well under a second.
SMALL_MODEL = {
    "hidden_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "intermediate_size": 64,
    "vocab_size": 512,
    "max_position_embeddings": 256,
}
OVERRIDES: dict[str, dict[str, Any]] = {
    "model": {"tiny": SMALL_MODEL},
    "batch": {"world_size": 2, "micro_batch_size": 1, "effective_batch": 2},
    "pack": {"seq_len": 128},
    "train": {"distributed": "ddp"},
}
DDP_TRAIN = Path(__file__).parent / "fixtures" / "ddp_train_shards.py"
# torchrun starting two ranks that import torch and transformers on two shared cores.
EPOCH_END_WITHIN_S = 60.0
# A micro-batch takes ~10 ms here, so 10 s without progress is a thousand steps' worth.
HANG_WINDOW_S = 10.0
# Balanced shards must finish: a bound only against a hang, not a measure of speed. In the
# whole suite, beside the other worker's tests, the two ranks once took over 70 s.
FINISH_WITHIN_S = 240.0


def build_packed_project(folder: Path, n_chats: int = 70) -> None:
    """Params, the tiny model, clean chats (none an eval item) and pack's shards in ``folder``."""
    if not (folder / "eval").exists():
        shutil.copytree(ROOT / "eval", folder / "eval")
    write_params(folder, OVERRIDES)
    with contextlib.chdir(folder):
        params = load_params()
        tiny.save_tiny(params.paths.base_model, params.model.tiny, domain.tokenizer_corpus(0), 0)
        eval_questions = {q for _, q in suites.questions(params.paths.eval_suites)}
        chats: list[dict[str, Any]] = []
        for record in domain.support_records(3, n_chats):
            messages = chat_messages(record)
            if not any(m["content"] in eval_questions for m in messages):
                chats.append({"id": f"chat-{len(chats)}", "messages": messages})
        params.paths.clean.mkdir(parents=True)
        lines = [json.dumps(c, ensure_ascii=False) + "\n" for c in chats]
        (params.paths.clean / "train.jsonl").write_text("".join(lines[:-4]))
        (params.paths.clean / "val.jsonl").write_text("".join(lines[-4:]))
        pack.main()


def drop_last_bin(packed: Path, rank: int) -> None:
    """Bad packing: one micro-batch fewer on ``rank``."""
    path = packed / shard_name(rank)
    table = pq.read_table(path)
    pq.write_table(table.slice(0, table.num_rows - 1), path)


def bins(packed: Path, rank: int) -> int:
    return pq.read_metadata(packed / shard_name(rank)).num_rows


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("preflight-project")
    build_packed_project(folder)
    return folder


@pytest.fixture
def unbalanced(project: Path, tmp_path: Path) -> Path:
    copy = shutil.copytree(project, tmp_path / "project")
    drop_last_bin(copy / "data/packed", rank=1)
    return copy


def subprocess_env() -> dict[str, str]:
    return os.environ | {
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",  # two ranks on two cores
        # dvc.yaml runs `python -m stages.<name>`: this environment's python must come first.
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }


# --- the stage -------------------------------------------------------------------------------


def test_packed_project_passes_and_the_report_reaches_mlflow(project: Path) -> None:
    with contextlib.chdir(project):
        preflight.main()  # raises SystemExit on a failed check
    report = json.loads((project / "reports/preflight.json").read_text())
    statuses = {c["name"]: c["status"] for c in report["checks"]}
    assert report["ok"] and "fail" not in statuses.values()
    assert statuses["ranks_balanced"] == statuses["template_roundtrip"] == "pass"
    assert statuses["no_eval_contamination"] == "pass"
    assert statuses["learning_rate"] == "warn"  # the demo's 3e-3, for a random-init model
    assert "| ranks_balanced | pass |" in (project / "reports/preflight.md").read_text()

    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("tuneloop")
    assert experiment is not None
    run = client.search_runs(
        [experiment.experiment_id], "tags.`tuneloop.stage` = 'preflight@support'"
    )[0]
    assert run.data.tags["preflight.ranks_balanced"] == "pass"
    assert run.data.metrics["failed"] == 0
    logged = {a.path for a in client.list_artifacts(run.info.run_id, "preflight")}
    assert logged == {"preflight/preflight.json", "preflight/preflight.md"}


def test_stage_refuses_a_tampered_shard_naming_check_rank_and_counts(unbalanced: Path) -> None:
    packed = unbalanced / "data/packed"
    result = subprocess.run(
        [sys.executable, "-m", "stages.preflight"],
        cwd=unbalanced,
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=120,
    )
    assert result.returncode != 0
    refusal = result.stderr[result.stderr.index("preflight refused the run") :]
    assert "ranks_balanced" in refusal
    assert f"rank 0: {bins(packed, 0)}, rank 1: {bins(packed, 1)}" in refusal
    assert bins(packed, 0) == bins(packed, 1) + 1
    report = json.loads((unbalanced / "reports/preflight.json").read_text())
    assert not report["ok"]
    assert [c["name"] for c in report["checks"] if c["status"] == "fail"] == ["ranks_balanced"]


# --- the hang it prevents --------------------------------------------------------------------


class Torchrun:
    """The DDP fixture under torchrun with two ranks, in its own process group."""

    def __init__(self, project: Path) -> None:
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(DDP_TRAIN),
            "--packed",
            "data/packed",
            "--model",
            "models/base",
        ]
        self.process = subprocess.Popen(
            command,
            cwd=project,
            env=subprocess_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, text: str, timeout: float) -> bool:
        """Whether ``text`` appears in the output within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in self.output:
                return True
            if self.process.poll() is not None:
                self._reader.join(5)
                return text in self.output
            time.sleep(0.1)
        return False

    def stacks(self) -> str:
        """Each process of the job still there, its state and its stack (``py-spy dump``)."""
        try:
            launcher = psutil.Process(self.process.pid)
            processes = [launcher, *launcher.children(recursive=True)]
        except psutil.NoSuchProcess:
            return "torchrun has ended"
        py_spy = find_py_spy()
        shown = []
        for process in processes:
            with contextlib.suppress(psutil.NoSuchProcess):
                shown.append(f"--- pid {process.pid} {process.status()}: {process.cmdline()[:4]}")
                if py_spy and process.status() != psutil.STATUS_ZOMBIE:
                    # Native frames too: a deadlock at exit sits in C++ destructors.
                    shown.append(py_spy_dump(py_spy, process.pid, native=True))
        return "\n".join(shown)

    def kill(self) -> list[psutil.Process]:
        """End torchrun and every rank; returns the processes that were running."""
        processes = []
        with contextlib.suppress(psutil.NoSuchProcess):
            launcher = psutil.Process(self.process.pid)
            # Children first, each by pid: torchrun starts every rank in a session of its own,
            # so signalling torchrun's process group alone would orphan them.
            processes = [*launcher.children(recursive=True), launcher]
        for process in processes:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        psutil.wait_procs(processes, timeout=10)
        self.process.wait(10)
        self._reader.join(5)
        return processes


def test_unbalanced_shards_fail_preflight_and_really_hang_ddp(unbalanced: Path) -> None:
    with contextlib.chdir(unbalanced):
        report = pf_run.run_preflight(load_params())
    assert [c.name for c in report.failed] == ["ranks_balanced"]

    job = Torchrun(unbalanced)
    try:
        short = bins(unbalanced / "data/packed", 1)
        assert job.wait_for(
            f"rank 1: epoch done after {short} micro-batches", EPOCH_END_WITHIN_S
        ), job.output
        # Rank 1 waits at the epoch-end barrier; rank 0 never leaves its extra batch.
        assert not job.wait_for("rank 0: epoch done", HANG_WINDOW_S), job.output
        assert job.process.poll() is None, "the job ended instead of hanging"
        assert "finished" not in job.output
    finally:
        ended = job.kill()
    assert len(ended) >= 3 and not any(p.is_running() for p in ended)  # torchrun and both ranks


def test_balanced_shards_from_pack_finish_ddp(project: Path) -> None:
    job = Torchrun(project)
    try:
        try:
            code = job.process.wait(FINISH_WITHIN_S)
        except subprocess.TimeoutExpired:
            # What the ranks said is the evidence (rendezvous, epoch, barrier): keep it.
            pytest.fail(
                f"balanced DDP still running after {FINISH_WITHIN_S:g} s:\n{job.output}\n"
                f"{job.stacks()}"
            )
        assert code == 0, job.output
    finally:
        job.kill()
    per_rank = bins(project / "data/packed", 0)
    for rank in (0, 1):
        assert f"rank {rank}: epoch done after {per_rank} micro-batches" in job.output
        assert f"rank {rank}: finished" in job.output


# --- dvc repro ---------------------------------------------------------------------------------


def dvc(repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dvc", *args],
        cwd=repo,
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=300,
    )


def test_dvc_repro_stops_at_a_failed_preflight_and_never_trains(
    project: Path, tmp_path: Path
) -> None:
    repo = copy_project(tmp_path)
    write_params(repo, OVERRIDES)
    # The upstream stages' outputs come from the module's project and are recorded in dvc.lock
    # as they are (`dvc commit`), so `dvc repro` runs preflight, not the whole pipeline.
    params = load_params(repo / "params.yaml")
    paths = params.paths
    for name in (paths.base_model, paths.clean, paths.packed):
        shutil.copytree(project / name, repo / name)
    for cache in (paths.clean_cache, paths.pack_cache):  # outs too; empty is a valid cache
        (repo / cache).mkdir(parents=True)
    shutil.copy(project / "mlflow.db", repo / "mlflow.db")
    for folder in (params.paths.incoming, params.paths.pool / "records" / "support"):
        (repo / folder).mkdir(parents=True)
        (repo / folder / "empty.jsonl").write_text("")
    (repo / "metrics").mkdir()
    # champions runs at every repro (the registry is outside DVC's view), and what it and init
    # write feeds the fixed-badcase suite: all three run for real here, so the repro finds
    # their outs as they leave them (no champion: start from the base, an empty suite).
    real_stages = ("champions", "init", "fixed_badcases")
    for real in real_stages:
        ran = subprocess.run(
            [sys.executable, "-m", f"stages.{real}"],
            cwd=repo,
            capture_output=True,
            text=True,
            env=subprocess_env(),
            timeout=300,
        )
        assert ran.returncode == 0, ran.stderr[-3000:]
    order = stage_order(repo)
    upstream = order[: order.index("preflight")]
    for stage in upstream:
        if stage not in real_stages:
            (repo / "metrics" / f"{stage}.json").write_text("{}")
    drop_last_bin(repo / params.paths.packed, rank=1)
    committed = dvc(repo, "commit", "--force", *(dvc_name(stage) for stage in upstream))
    assert committed.returncode == 0, committed.stderr

    result = dvc(repo, "repro", "train")

    assert result.returncode != 0
    assert "Running stage 'preflight@support'" in result.stdout
    assert "failed to reproduce 'preflight@support'" in result.stderr
    assert "Running stage 'train@support'" not in result.stdout
    assert not (repo / params.paths.adapter).exists()
    report = json.loads((repo / "reports/preflight.json").read_text())
    assert [c["name"] for c in report["checks"] if c["status"] == "fail"] == ["ranks_balanced"]
