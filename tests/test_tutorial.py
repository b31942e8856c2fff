"""The tutorial (docs/tutorial/your-model.md) run as written, from a fresh clone.

Every block titled ``step …`` runs, in the page's order, in one bash (so step 1's
``source .venv/bin/activate`` holds for the rest); the block titled ``params.yaml`` is merged
into the clone's params.yaml where the page says to set those keys. The clone is ``git clone``
of this checkout's committed code, so an uncommitted change is not what the page is checked
against. Two things are shared with the suite rather than built again, and neither is a
command of the page: the clone's ``.venv`` is this suite's environment (step 1's
``make setup`` finds it built and does nothing; the test checks that it did nothing, so it
never installs into the suite's environment), and its ``.hf`` is this checkout's, where the
SmolLM2 wheel is kept once fetched. The month itself is SmolLM2-135M on the CPU: the page's
params keep its first run to minutes (``train.max_steps``, ``evaluate.limit``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers import ROOT

# The slow tier, and a marker of its own: `make test` runs it, `make test-tutorial` it alone.
pytestmark = [pytest.mark.slow, pytest.mark.tutorial]

PAGE = ROOT / "docs" / "tutorial" / "your-model.md"
# The month on SmolLM2 takes minutes on 2 quiet cores; far past that something hangs.
MONTH_TIMEOUT_S = 3600
# A fenced block with a title: ```bash title="step 2: ..."
FENCE = re.compile(r'^```(\w+) title="([^"]+)"\n(.*?)^```', re.S | re.M)


def blocks() -> list[tuple[str, str]]:
    """(title, body) of each titled block, in the page's order."""
    return [(title, body) for _, title, body in FENCE.findall(PAGE.read_text(encoding="utf-8"))]


def clone(target: Path) -> Path:
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the tutorial starts from a clone")
    subprocess.run(["git", "clone", "-q", str(ROOT), str(target)], check=True)
    # What a fresh machine gets from step 1 and a first download: this suite's own.
    (target / ".venv").symlink_to(Path(sys.prefix))
    (target / ".hf").symlink_to((ROOT / ".hf").resolve())
    # git writes files with the time of the clone: make would see pyproject.toml as newer than
    # the environment and rebuild it. Their committed contents are what the suite was set up
    # from (checked below: step 1 must report nothing to do).
    for name in ("pyproject.toml", "constraints.txt"):
        stamp = (ROOT / name).stat()
        os.utime(target / name, (stamp.st_atime, stamp.st_mtime))
    return target


@pytest.fixture(scope="module")
def month(tmp_path_factory: pytest.TempPathFactory, prefect_harness: None) -> Path:
    from prefect.settings import PREFECT_API_URL

    repo = clone(tmp_path_factory.mktemp("tutorial") / "tuneloop")
    # Step 1 must find the environment built: were it to rebuild, it would install into this
    # suite's own. Make's test, in Python: `make -n` cannot tell, the key file's rule always runs.
    key = re.search(r"printf '%s\\n' '([^']*)'", dry_run(repo, ".venv/.key"))
    installed = repo / ".venv" / ".installed"
    built = (repo / ".venv" / ".key").read_text() if (repo / ".venv" / ".key").exists() else ""
    sources = ("pyproject.toml", "constraints.txt", ".venv/.key")
    newest = max((repo / name).stat().st_mtime for name in sources)
    if not key or built != key[1] + "\n" or not installed.exists():
        pytest.skip("this suite's .venv was not built by `make setup` with its defaults")
    if installed.stat().st_mtime < newest:
        pytest.skip("this suite's .venv is older than what it is built from")
    installed_at = installed.stat().st_mtime
    # -e, not pipefail: a reader's shell does not fail `json.tool ... | head` when head stops
    # reading early.
    script = ["set -eu"]
    for title, body in blocks():
        if title == "params.yaml":
            script.append(f"python - <<'PY'\n{apply_params(body)}\nPY")
        else:
            script += [f"echo '--- {title}'", body]
    # A reader's shell: not this suite's interpreter settings, nor the `make test` it runs
    # under (step 1's `make` would be a sub-make of it).
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PYTHON", "VIRTUAL_ENV"))
        and k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")
    }
    env |= {"PYTHONPATH": str(repo), "PREFECT_API_URL": str(PREFECT_API_URL.value())}
    log = repo.parent / "tutorial.log"
    with log.open("w") as out:
        # Its own process group: a failed or interrupted test ends the month's every process
        # (the flow, dvc, the stages, the MLflow server), not only the shell.
        shell = subprocess.Popen(
            ["bash", "-c", "\n".join(script)],
            cwd=repo,
            env=env,
            stdout=out,
            stderr=out,
            start_new_session=True,
        )
        try:
            code = shell.wait(timeout=MONTH_TIMEOUT_S)
        finally:
            end_group(shell)
    text = log.read_text(errors="replace")
    assert code == 0, text[-6000:]
    (repo / "tutorial.log").write_text(text)
    assert installed.stat().st_mtime == installed_at, "step 1 built the environment again"
    return repo


def end_group(shell: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(shell.pid, signal.SIGTERM)
        time.sleep(1)  # the stages' own handlers first; then whatever is left
        os.killpg(shell.pid, signal.SIGKILL)
    shell.wait()


def dry_run(repo: Path, target: str) -> str:
    return subprocess.run(
        ["make", "-n", target], cwd=repo, capture_output=True, text=True, check=True
    ).stdout


def apply_params(block: str) -> str:
    """Python that sets the page's keys in params.yaml as the demo's configs are set
    (``workspace.merged``: key by key, and a key params.yaml does not have is refused)."""
    return (
        "from pathlib import Path\n"
        "import yaml\n"
        "from tuneloop.demo.workspace import merged\n"
        "params = yaml.safe_load(open('params.yaml'))\n"
        f"keys = yaml.safe_load({block!r})\n"
        "params = merged(params, keys, Path('docs/tutorial/your-model.md'))\n"
        "yaml.safe_dump(params, open('params.yaml', 'w'), sort_keys=False)"
    )


def test_the_month_ends_with_the_gates_decision_on_the_tutorial_suite(month: Path) -> None:
    decision = json.loads((month / "metrics" / "decision.json").read_text())
    assert decision["verdict"] in {"pass", "fail", "inconclusive"}
    assert decision["reasons"] and decision["checks"], "a reason for each rule"
    assert any(check["suite"] == "my_support" for check in decision["checks"]), decision["checks"]
    report = (month / "reports" / "eval.md").read_text()
    assert "my_support" in report
    params = yaml.safe_load((month / "params.yaml").read_text())
    assert params["model"]["base"] == "builtin:smollm2-135m-instruct"
    assert (month / "models" / "adapter" / "adapter_config.json").is_file()


def test_step_6_shows_the_decision_and_the_registry(month: Path) -> None:
    text = (month / "tutorial.log").read_text()
    step_6 = text.split("--- step 6", 1)[1]
    assert "champion" in step_6, step_6[-3000:]


def test_the_clone_left_the_suites_environment_where_it_was(month: Path) -> None:
    # A new interpreter, not this one (whose tuneloop was imported before the month ran):
    # the editable install still points at this checkout, not at the tutorial's clone.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    found = subprocess.run(
        [sys.executable, "-c", "import tuneloop; print(tuneloop.__file__)"],
        cwd="/",
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert Path(found).resolve().is_relative_to(ROOT.resolve()), found
    shutil.rmtree(month / "models" / "merged", ignore_errors=True)  # 0.5 GB of float32
