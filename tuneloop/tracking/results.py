"""Each month's results committed to git, so ``dvc metrics diff`` compares months.

``dvc.lock`` (the md5 of every input and output) and ``metrics/`` are what a month's run
leaves in the workspace. With ``schedule.commit_results`` the retrain flow commits them, on
top of the code it ran, to the branch ``tuneloop/results`` (one commit per retrain) and tags
the commit ``retrain-<UTC time>``. Then ``git checkout retrain-... && dvc pull && dvc repro``
gives that month back, and ``dvc metrics diff tuneloop/results~1 tuneloop/results`` compares
the last two months.

The commit is built with a private index (``GIT_INDEX_FILE``): the user's checkout, index and
current branch are never touched, whatever state they are in. Written here rather than with
``git stash``/``checkout`` gymnastics because those would touch a workspace someone may be
using.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

BRANCH = "tuneloop/results"
TAG_PREFIX = "retrain-"


class ResultsCommitError(RuntimeError):
    pass


@dataclass(frozen=True)
class Committed:
    commit: str
    tag: str
    branch: str = BRANCH


def _git(repo: Path, *args: str, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        ["git", *args], cwd=repo, capture_output=True, text=True, env=env, check=False
    )
    if done.returncode != 0:
        raise ResultsCommitError(f"git {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout.strip()


def commit_results(
    repo: Path, paths: list[Path], message: str, now: dt.datetime | None = None
) -> Committed:
    """Commit ``paths`` (relative to ``repo``) over HEAD's tree onto ``tuneloop/results``."""
    now = now or dt.datetime.now(dt.UTC)
    head = _git(repo, "rev-parse", "HEAD")
    try:
        parent: str | None = _git(repo, "rev-parse", "--verify", "--quiet", f"refs/heads/{BRANCH}")
    except ResultsCommitError:
        parent = None
    with tempfile.TemporaryDirectory(prefix="tuneloop-results-") as tmp:
        env = {**os.environ, "GIT_INDEX_FILE": str(Path(tmp) / "index")}
        # The code that ran (HEAD's tree) plus this month's lock and metrics.
        _git(repo, "read-tree", head, env=env)
        present = [str(p) for p in paths if (repo / p).exists()]
        if not present:
            raise ResultsCommitError(f"none of {[str(p) for p in paths]} exists in {repo}")
        # -f: dvc.lock and metrics/ may be git-ignored in a checkout that leaves them out.
        _git(repo, "add", "-f", "--", *present, env=env)
        tree = _git(repo, "write-tree", env=env)
    parents = ["-p", parent] if parent else []
    # HEAD as a second parent: the results branch shows which code each month ran.
    if parent != head:
        parents += ["-p", head]
    identity = {
        "GIT_AUTHOR_NAME": os.environ.get("GIT_AUTHOR_NAME", "tuneloop"),
        "GIT_AUTHOR_EMAIL": os.environ.get("GIT_AUTHOR_EMAIL", "tuneloop@localhost"),
        "GIT_COMMITTER_NAME": os.environ.get("GIT_COMMITTER_NAME", "tuneloop"),
        "GIT_COMMITTER_EMAIL": os.environ.get("GIT_COMMITTER_EMAIL", "tuneloop@localhost"),
    }
    commit = _git(
        repo, "commit-tree", tree, *parents, "-m", message, env={**os.environ, **identity}
    )
    _git(repo, "update-ref", f"refs/heads/{BRANCH}", commit, *([parent] if parent else []))
    tag = f"{TAG_PREFIX}{now:%Y%m%dT%H%M%SZ}"
    _git(repo, "tag", tag, commit)
    log.info("results of this retrain: commit %s on %s, tag %s", commit[:12], BRANCH, tag)
    return Committed(commit, tag)
