"""The manual: the README stays a landing page, the reference is complete, the site builds.

The reference pages are generated from the code (``tuneloop/cli/reference.py``), so what can
drift is a field or flag added without a description; the site is built with ``--strict`` (a
few seconds), so a broken link or page fails here. The tutorial's ``params.yaml`` block is
validated by the params models, its steps by ``bash -n``, every command it names must exist,
and its data and suite steps run as written; running its month is not part of this module.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import ROOT
from tuneloop.cli import PASSTHROUGH, PASSTHROUGH_PARSERS, reference
from tuneloop.params import load_params, with_overrides

# The fast tier: no pipeline, server or rank (a site build of a few seconds).
pytestmark = pytest.mark.fast

README = ROOT / "README.md"
TUTORIAL = ROOT / "docs" / "tutorial" / "your-model.md"
# A fenced block and the title in its info string: ```bash title="step 1: set up"
REFERENCE = ("params", "cli", "stages", "mlflow", "metrics")
FENCE = re.compile(r'^```(\w+)(?: title="([^"]*)")?\n(.*?)^```', re.S | re.M)


def test_readme_is_a_landing_page() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 200, "README.md is the landing page: at most 200 lines"
    assert "make test" in text, "CI runs the test command the README names"
    # A commit hash is a run's history: it belongs in benchmarks/RESULTS.md.
    hashes = [
        word
        for word in re.findall(r"\b[0-9a-f]{7,40}\b", text)
        if re.search(r"\d", word) and re.search(r"[a-f]", word)
    ]
    assert not hashes, f"README.md names commits {hashes}; measured runs go in RESULTS.md"


def test_every_params_field_cli_flag_and_metrics_field_has_a_description() -> None:
    assert reference.missing_descriptions() == []


def test_metrics_fields_reach_every_nested_model(monkeypatch: pytest.MonkeyPatch) -> None:
    # A model only nested in another (a check in the decision) is still checked for text:
    # a field of each, its description taken away, is named.
    from tuneloop.data.metrics import FolderCounts, ReplayMetrics
    from tuneloop.judge.decision import Champion, Check, ExportStanding, SliceComparison
    from tuneloop.models import GgufSource
    from tuneloop.quantization import FormatMetrics
    from tuneloop.training.metrics import JobReport, NodeUsage

    nested = (Check, SliceComparison, ExportStanding, Champion, JobReport, NodeUsage)
    for model in (*nested, FolderCounts, ReplayMetrics, FormatMetrics, GgufSource):
        name, field = next(iter(model.model_fields.items()))
        monkeypatch.setattr(field, "description", None)
        missing = reference.missing_descriptions()
        assert any(m.startswith("metrics: ") and m.endswith(f".{name}") for m in missing), model
        monkeypatch.undo()


def test_passthrough_commands_have_their_parsers() -> None:
    assert set(PASSTHROUGH_PARSERS) == set(PASSTHROUGH)


def test_cli_reference_names_every_command_and_flag() -> None:
    page = reference.cli_page()
    names = [name for name, _, _ in reference.commands()]
    assert {"retrain", "release", "review invite", *PASSTHROUGH} <= set(names)
    for name, _, parser in reference.commands():
        assert f"## `tuneloop {name}`" in page
        for flag in reference.flags(name, parser):
            assert f"`{flag.names}`" in page


def test_params_reference_names_every_key_with_its_shipped_value() -> None:
    page = reference.params_page(ROOT)
    assert "| `train.learning_rate` | float | required | `0.001` |" in page
    assert "`gate.on_inconclusive`" in page and "`schedule.pools.<name>.queues`" in page


def test_stages_reference_follows_dvc_yaml() -> None:
    page = reference.stages_page(ROOT)
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text(encoding="utf-8"))["stages"]
    for name in stages:
        assert f"## `{name}`" in page
    assert "(no docstring)" not in page


def test_mlflow_reference_finds_what_the_stages_write() -> None:
    page = reference.mlflow_page(ROOT)
    for key in ("gate.verdict", "tuneloop.train.stop_rule", "watchdog/accounting.json"):
        assert f"| `{key}` |" in page
    assert "| `gpu_hours.<state>` |" in page, "an f-string key shows its computed part"


def _tutorial_blocks() -> list[tuple[str, str, str]]:
    return FENCE.findall(TUTORIAL.read_text(encoding="utf-8"))


def test_tutorial_params_are_accepted_by_the_params_models() -> None:
    [block] = [body for lang, title, body in _tutorial_blocks() if title == "params.yaml"]
    params = with_overrides(load_params(ROOT / "params.yaml"), yaml.safe_load(block), "tutorial")
    assert params.model.base == "builtin:smollm2-135m-instruct"
    assert params.train.method == "lora"
    for suite in params.evaluate.suites:
        assert suite == "my_support" or (ROOT / "eval" / suite).is_dir()


def test_tutorial_steps_are_bash_and_name_real_commands() -> None:
    steps = [body for lang, title, body in _tutorial_blocks() if title.startswith("step ")]
    assert len(steps) >= 5
    known = {name.split()[0] for name, _, _ in reference.commands()}
    for body in steps:
        subprocess.run(["bash", "-n"], input=body, text=True, check=True)
        for command in re.findall(r"^\s*tuneloop ([a-z-]+)", body, re.M):
            assert command in known, f"the tutorial runs `tuneloop {command}`, which is no command"


def test_tutorial_data_and_suite_steps_run_as_written(tmp_path: Path) -> None:
    """Steps 2 and 3 in a copy of the project: the page's own lines are records to ingest
    (the demo month it adds holds malformed lines on purpose)."""
    from tuneloop.data.ingest import read_lines, sort_one

    shutil.copy(ROOT / "params.yaml", tmp_path)
    shutil.copytree(ROOT / "eval", tmp_path / "eval")
    steps = {title.split(":")[0]: body for _, title, body in _tutorial_blocks() if title}
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    for step in ("step 2", "step 3"):
        bash = subprocess.run(["bash", "-e"], input=steps[step], text=True, cwd=tmp_path, env=env)
        assert bash.returncode == 0, step
    lines = list(read_lines(tmp_path / "data" / "badcases" / "incoming"))
    own = [line for line in lines if line.file.startswith("2026-12/")]
    assert len(own) == 3 and len(lines) > 100, "the page's lines and the demo month"
    tasks = load_params(tmp_path / "params.yaml").task_names()  # what stage task_names writes
    for line in own:
        kind, *detail = sort_one(line, 1_000_000, "2026-12-01T00:00:00Z", tasks)
        assert kind == "record", (line.file, line.number, detail)
    suite = tmp_path / "eval" / "my_support"
    assert "task: my_support" in (suite / "my_support.yaml").read_text()
    items = [json.loads(line) for line in (suite / "test.jsonl").read_text().splitlines()]
    assert all({"question", "answer", "answerable"} <= set(item) for item in items)


def test_site_builds_strict(tmp_path: Path) -> None:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(ROOT)}
    mkdocs = Path(sys.executable).with_name("mkdocs")
    result = subprocess.run(
        [str(mkdocs), "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    for page in ("index.html", *(f"reference/{name}/index.html" for name in REFERENCE)):
        assert (tmp_path / "site" / page).is_file()
    assert "train.learning_rate" in (tmp_path / "site/reference/params/index.html").read_text()
    assert "global_steps" in (tmp_path / "site/reference/metrics/index.html").read_text()
