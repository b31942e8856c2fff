"""The process accounting behind ``benchmarks/suite_cpu.py``: what its hook records."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.suite_cpu import HOOK, kind_of

# The fast tier: no pipeline, server or rank.
pytestmark = pytest.mark.fast


def hooked(log: Path) -> dict[str, str]:
    return os.environ | {"PYTHONPATH": str(HOOK), "SUITE_CPU_LOG": str(log)}


def test_a_process_records_its_cpu_and_its_imports(tmp_path: Path) -> None:
    log = tmp_path / "processes.jsonl"
    code = "import decimal, fractions, statistics; sum(i * i for i in range(2_000_000))"
    subprocess.run([sys.executable, "-c", code], env=hooked(log), check=True)

    (record,) = [json.loads(line) for line in log.read_text().splitlines()]
    assert record["how"] == "exit" and record["argv"][1:] == ["-c", code]
    # The loop after the imports is CPU the imports do not count.
    assert 0 < record["import_cpu"] < record["cpu"]


def test_a_process_ended_by_sigterm_records_and_still_dies_by_it(tmp_path: Path) -> None:
    log = tmp_path / "processes.jsonl"
    ready = tmp_path / "ready"
    code = f"import pathlib, time; pathlib.Path({str(ready)!r}).touch(); time.sleep(60)"
    process = subprocess.Popen([sys.executable, "-c", code], env=hooked(log))
    deadline = time.monotonic() + 30
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)

    assert process.wait(timeout=30) == -signal.SIGTERM
    (record,) = [json.loads(line) for line in log.read_text().splitlines()]
    assert record["how"] == "sigterm"


def test_kinds_of_process() -> None:
    python = "/venv/bin/python"
    assert kind_of([python, "-m", "stages.train"]) == "stages.train"
    assert kind_of([python, "-u", "-c", "import sys;exec(eval(sys.stdin.readline()))"]) == (
        "pytest-xdist worker (the tests themselves)"
    )
    assert kind_of([python, "/venv/bin/transformers", "serve", "--port"]) == "transformers serve"
    assert kind_of([python, "/repo/tests/fixtures/ddp_hang.py", "--imbalanced"]) == "ddp_hang.py"
