"""Each retrain's dvc.lock and metrics/ committed beside the user's work, never over it."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
from pathlib import Path

import pytest

from tuneloop.tracking import results

# The fast tier: no pipeline, server or rank.
pytestmark = pytest.mark.fast


def git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=repo, capture_output=True, text=True, check=True
    ).stdout.strip()


def test_results_are_committed_to_their_branch_and_tagged_without_touching_the_checkout(
    tmp_path: Path,
) -> None:
    repo = tmp_path
    git(repo, "init", "-q", "-b", "main")
    (repo / "dvc.yaml").write_text("stages: {}\n")
    git(repo, "add", "dvc.yaml")
    git(repo, "-c", "user.name=u", "-c", "user.email=u@e", "commit", "-qm", "code")
    head = git(repo, "rev-parse", "HEAD")
    (repo / "work.txt").write_text("someone's unstaged work\n")
    (repo / "metrics").mkdir()
    tags = []
    for month, accuracy in enumerate((0.70, 0.82), start=1):
        (repo / "dvc.lock").write_text(f"schema: '2.0'\nstages: {{}}\n# month {month}\n")
        (repo / "metrics" / "evaluate.json").write_text(json.dumps({"accuracy": accuracy}))
        done = results.commit_results(
            repo,
            [Path("dvc.lock"), Path("metrics")],
            f"month {month}",
            now=dt.datetime(2026, 10 + month, 1, tzinfo=dt.UTC),
        )
        tags.append(done.tag)
        shown = json.loads(git(repo, "show", f"{done.tag}:metrics/evaluate.json"))
        assert shown == {"accuracy": accuracy}
        assert git(repo, "show", f"{done.tag}:dvc.yaml") == "stages: {}"  # the code it ran
    assert tags == ["retrain-20261101T000000Z", "retrain-20261201T000000Z"]
    # One commit per month on the results branch, the second on top of the first.
    assert git(repo, "rev-parse", f"{results.BRANCH}~1") == git(repo, "rev-parse", tags[0])
    # The user's branch, index and files are as they were.
    assert git(repo, "rev-parse", "HEAD") == head
    assert git(repo, "branch", "--show-current") == "main"
    assert git(repo, "diff", "--cached", "--name-only") == ""
    assert (repo / "work.txt").read_text() == "someone's unstaged work\n"
    status = git(repo, "status", "--porcelain")
    assert "?? work.txt" in status and "dvc.yaml" not in status


def test_nothing_to_commit_is_an_error(tmp_path: Path) -> None:
    git(tmp_path, "init", "-q")
    (tmp_path / "a").write_text("a")
    git(tmp_path, "add", "a")
    git(tmp_path, "-c", "user.name=u", "-c", "user.email=u@e", "commit", "-qm", "a")
    with pytest.raises(results.ResultsCommitError, match="none of"):
        results.commit_results(tmp_path, [Path("dvc.lock")], "nothing")
