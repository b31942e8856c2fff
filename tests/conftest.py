"""Shared fixtures: a tiny tuneloop project in a temp dir, one Prefect test server, and the
tiny project trained once by the retrain flow for every module that reads it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import (  # noqa: F401
    ROOT,
    TINY_OVERRIDES,
    copy_project,
    seed_demo_month,
    write_params,
)
from tests.vllm_helpers import vllm_shared, vllm_tiny  # noqa: F401

if "PYTEST_XDIST_WORKER" in os.environ:
    # Workers keep every core busy: a second torch thread in a worker or in the stages it
    # starts spin-waits for a core another worker holds (a tiny forward pass took 1.5 s with
    # two threads and 16 ms with one). Read by torch at import, and inherited by subprocesses.
    os.environ.setdefault("OMP_NUM_THREADS", "1")

TRACKING_ENV = (
    "MLFLOW_TRACKING_URI",
    "MLFLOW_RUN_ID",
    "MLFLOW_EXPERIMENT_NAME",
    "MLFLOW_EXPERIMENT_ID",
    "TUNELOOP_FLOW_RUN_ID",
)


def _drop_tracking_env() -> None:
    for name in TRACKING_ENV:
        os.environ.pop(name, None)


# Modules that share the session's trained tiny project: one xdist worker builds it for all.
TINY_PROJECT_MODULES = {"test_flow", "test_stages"}
# Modules that share the session's one vLLM server (tests/vllm_helpers.py): 2-5 minutes to start.
VLLM_MODULES = {"test_release_vllm", "test_vllm_serving"}
# The longest groups (whole months of the loop, the team stack, the tiny project's flows)
# start first, so no worker is left with one of them while the other has gone idle.
LONG_FIRST = (
    "tiny-project",
    "test_loop",
    "test_team_stack",
    "test_real_lora",
    "test_evaluate",
    "test_train_stage",
)


# The two tiers, by module: `make test-fast` runs FAST_MODULES (marked `fast` at collection),
# `make test` runs both. A fast module starts no pipeline (`dvc repro`, a flow), no server
# (uvicorn, `transformers serve`, vLLM, MLflow, Prefect, PostgreSQL, Chromium), no training
# rank and no stage in a subprocess; a short `python -c` process or a git command is allowed.
# A module of stage runs alone (`main()` in a temp dir) is a stage test, in the whole suite;
# one that also holds unit or property tests is fast. Every tests/test_*.py is in exactly one
# of the two sets (tests/test_tiers.py).
FAST_MODULES = {
    "test_cards",
    "test_chat",
    "test_cluster_units",
    "test_clean_cache",
    "test_clean_dpo",
    "test_demo_tasks",
    "test_demo_workspace",
    "test_orders_demo",
    "test_doctor",
    "test_dvc_yaml",
    "test_eval_engine",
    "test_experiment",
    "test_fixed_badcases",
    "test_gate",
    "test_general",
    "test_ingest",
    "test_io",
    "test_layout",
    "test_merge_units",
    "test_neardup",
    "test_pack_cache",
    "test_packing",
    "test_params",
    "test_params_tasks",
    "test_pii",
    "test_preflight",
    "test_results",
    "test_review_store",
    "test_review_tally",
    "test_suite_cpu",
    "test_tiers",
    "test_tokencache",
    "test_train_units",
    "test_watchdog",
}
# In `make test` only, each for what it starts.
WHOLE_SUITE_MODULES = {
    "test_approval",  # the Prefect test server
    "test_cluster_kubernetes",  # a local HTTP server replaying Kubernetes API responses
    "test_cluster_slurm",  # a two-node Slurm cluster, training ranks on it
    "test_data_stages",  # the data stages imported in subprocesses; MLflow runs
    "test_dvcrun",  # dvc repro
    "test_eval_vllm",  # a vLLM server of its own where .venv-serve is built, lm_eval
    "test_evaluate",  # the evaluate stage on trained models, lm_eval
    "test_flow",  # the retrain flow under dvc (the tiny project)
    "test_ingest_safety",  # the ingest stage on hostile files, nothing but stage runs
    "test_ingest_tasks",  # the ingest stage on files for several tasks
    "test_lineage",  # dvc repro
    "test_loop",  # months of the loop, transformers serve, Chromium
    "test_merge",  # pre-trains the tiny base, merges and exports it
    "test_mlflow_ui",  # the MLflow UI in Chromium
    "test_pool",  # ingest in child processes killed mid-commit
    "test_preflight_stage",  # torchrun ranks, dvc repro
    "test_pretrained",  # a real base fetched and converted
    "test_real_lora",  # a real base converted, trained with LoRA, merged, exported
    "test_recovery",  # the Prefect test server
    "test_registry",  # dvc repro, the base stage
    "test_release",  # release on transformers serve backends
    "test_release_by_hand",  # the release flow in a subprocess
    "test_release_flow",  # the Prefect test server, transformers serve
    "test_release_lease",  # routers and releases in subprocesses
    "test_release_replicas",  # router replicas, transformers serve
    "test_release_shadow",  # the Prefect test server, routers
    "test_release_vllm",  # a vLLM server (shared with test_vllm_serving), routers
    "test_review_live",  # the review page on uvicorn, restarted; Chromium; PostgreSQL
    "test_router",  # routers on uvicorn
    "test_router_abuse",  # a running router, attacked
    "test_router_backends",  # transformers serve
    "test_router_feedback",  # routers on uvicorn
    "test_router_guards",  # routers on uvicorn
    "test_router_samples",  # routers on uvicorn
    "test_router_tasks",  # a router of two tasks on uvicorn, the CLI against it
    "test_schedule",  # the Prefect test server
    "test_stages",  # the tiny project (the retrain flow)
    "test_stage_overhead",  # a local MLflow server, stages as processes
    "test_tasks_pipeline",  # two tasks' pipelines under the retrain flow, dvc repro
    "test_team_stack",  # PostgreSQL, MLflow and Prefect servers
    "test_train_stage",  # training, torchrun ranks, dvc repro
    "test_vllm_serving",  # a vLLM server where .venv-serve is built
    "test_watchdog_hang",  # torchrun ranks that hang
}


def pytest_itemcollected(item: pytest.Item) -> None:
    """Mark the fast tier's tests before ``-m fast`` selects (at the end of collection)."""
    if Path(item.nodeid.split("::", 1)[0]).stem in FAST_MODULES:
        item.add_marker(pytest.mark.fast)


def group_of(nodeid: str) -> str:
    """The worker's unit of a test under ``pytest -n``: its module, the tiny project's, or
    the shared vLLM's."""
    module = Path(nodeid.split("::", 1)[0]).stem
    if module in VLLM_MODULES:
        return "vllm"
    return "tiny-project" if module in TINY_PROJECT_MODULES else module


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under ``pytest -n`` (``make test``), one worker runs a whole group (``group_of``).

    A module's fixtures (a trained project, a release, a team stack) are module-scoped and
    are built by the worker that runs it; a module spread over two workers would build them
    twice, and the tiny project is session-scoped across two modules. (xdist's own
    ``--dist loadgroup`` renames node ids, which pytest 9 no longer honours.)
    """
    from xdist.scheduler import LoadScopeScheduling

    # In collection order (``LONG_FIRST``), not xdist's default of the most tests first.
    config.option.loadscopereorder = False

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    return GroupScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest groups first (xdist hands out groups in collection order)."""

    def rank(item: pytest.Item) -> int:
        group = group_of(item.nodeid)
        return LONG_FIRST.index(group) if group in LONG_FIRST else len(LONG_FIRST)

    items.sort(key=rank)  # stable: a module's tests keep their order


@pytest.fixture(autouse=True)
def _no_inherited_tracking() -> Iterator[None]:
    """Each test writes MLflow runs to its own project folder, never a user's server.

    Cleared after the test too: `mlflow.set_tracking_uri()` writes MLFLOW_TRACKING_URI into
    the process's environment, and the next module's fixtures (set up before any
    function-scoped fixture) would otherwise hand it to their `dvc repro` subprocesses.
    """
    _drop_tracking_env()
    yield
    _drop_tracking_env()


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """One torch thread for a module's tiny models.

    On a shared 2-core machine, torch's second thread spin-waits for a busy core:
    a tiny forward pass took 1.5 s with two threads and 16 ms with one.
    """
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def prefect_harness() -> Iterator[None]:
    from prefect.testing.utilities import prefect_test_harness

    # 30 s (the default) is tight for the server start on two cores.
    with prefect_test_harness(server_startup_timeout=90):
        yield


@pytest.fixture(scope="session")
def tiny_project(
    tmp_path_factory: pytest.TempPathFactory, prefect_harness: None
) -> tuple[Path, dict[str, Any]]:
    """The tiny project (``TINY_OVERRIDES``) after one run of the retrain flow, and its result.

    Built once for the session: every stage ran under the flow, as ``dvc repro --single-item``
    in a subprocess, with the demo month seeded. Modules read it; a test that runs more flows
    or experiments in it may add MLflow runs and DVC experiments, never change its workspace
    (params.yaml, dvc.lock and the outs stay as the flow left them).
    """
    from flows.retrain import retrain

    repo = copy_project(tmp_path_factory.mktemp("tiny-project"))
    seed_demo_month(repo)
    return repo, retrain(repo=repo)


@pytest.fixture
def in_folder(tmp_path: Path) -> Iterator[Path]:
    previous = Path.cwd()
    os.chdir(tmp_path)
    try:
        yield tmp_path
    finally:
        os.chdir(previous)
