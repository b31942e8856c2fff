"""Shared fixtures: a tiny tuneloop project in a temp dir, one Prefect test server, and the
tiny project trained once by the retrain flow for every module that reads it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from tests.helpers import (  # noqa: F401
    ROOT,
    TINY_OVERRIDES,
    copy_project,
    seed_demo_month,
    write_params,
)
from tests.tiers import fast_by_default, spread_a_bare_run, untiered
from tests.vllm_helpers import vllm_shared, vllm_tiny  # noqa: F401

if TYPE_CHECKING:
    from tuneloop.data.chat import ChatTokenizer
    from tuneloop.orchestration.flow_results import TasksRun

# pytester: tests/test_tiers.py runs pytest on a project of two modules, one per tier.
pytest_plugins = ("pytester",)

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
# The longest groups start first, longest first, so no worker is left with one of them while
# the others have gone idle; by their time in `make test` on 2 cores, 2026-12-06 (a fresh
# clone at c39ebb3: test_tasks_pipeline 380 s down to test_watchdog_hang 32 s). The other
# slow modules follow, then the fast tier, whose modules take seconds each and fill the end:
# in alphabetical order, test_release_flow (90 s) and test_watchdog_hang had started last and
# run alone, 1-1.5 minutes of one busy core out of two.
LONG_FIRST = (
    "test_tasks_pipeline",
    "test_loop",
    "test_cluster_slurm",
    "tiny-project",
    "test_train_stage",
    "test_tutorial",
    "test_real_lora",
    "test_team_stack",
    "test_release_replicas",
    "vllm",
    "test_evaluate",
    "test_release_flow",
    "test_preflight_stage",
    "test_lineage",
    "test_release_lease",
    "test_eval_vllm",
    "test_watchdog_hang",
    "test_mlflow_ui",
)


def group_of(nodeid: str) -> str:
    """The worker's unit of a test under ``pytest -n``: its module, the tiny project's, or
    the shared vLLM's."""
    module = Path(nodeid.split("::", 1)[0]).stem
    if module in VLLM_MODULES:
        return "vllm"
    return "tiny-project" if module in TINY_PROJECT_MODULES else module


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    spread_a_bare_run(config)


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
    """Every test in one tier; the fast tier alone for a bare `pytest`; the longest groups
    first, then the other slow ones, then the fast tier (xdist hands out groups in collection
    order)."""
    if wrong := untiered(items):
        raise pytest.UsageError(
            "each test module needs `pytestmark = pytest.mark.fast` or `pytest.mark.slow` "
            f"(one tier; tests/conftest.py says which): {', '.join(wrong)}"
        )
    fast_by_default(config, items)

    def rank(item: pytest.Item) -> int:
        group = group_of(item.nodeid)
        if group in LONG_FIRST:
            return LONG_FIRST.index(group)
        return len(LONG_FIRST) + (item.get_closest_marker("slow") is None)  # slow, then fast

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
) -> tuple[Path, TasksRun]:
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


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> ChatTokenizer:
    """The demo's tiny chat tokenizer, trained once per module (a fraction of a second)."""
    from tuneloop.data.chat import ChatTokenizer
    from tuneloop.demo import domain, tiny

    folder = tmp_path_factory.mktemp("tokenizer")
    tiny.build_tokenizer(domain.tokenizer_corpus(0), 512).save_pretrained(folder)
    return ChatTokenizer.from_folder(folder)


@pytest.fixture
def in_folder(tmp_path: Path) -> Iterator[Path]:
    previous = Path.cwd()
    os.chdir(tmp_path)
    try:
        yield tmp_path
    finally:
        os.chdir(previous)
