"""The router abuse script, run as a user would run it: every attack answered right."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

# The whole suite (`make test`): a running router, attacked
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def test_the_router_abuse_script_passes() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "router_abuse.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "all answers and checks as expected" in done.stdout
    # Each attack is in the table, so a dropped one would show.
    for attack in ("8 MB body", "producer token", "forged ids", "nested 100,000", "flood of"):
        assert attack in done.stdout
