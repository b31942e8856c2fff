"""The manual's screenshots, taken by headless Chromium from a demo project.

    python docs/screenshots.py --project demos/tasks --out docs/img     (``make docs-screenshots``)

Against the folder ``make demo`` leaves (``demos/tasks``: its ``mlflow.db``, ``mlartifacts/``
and ``review.db``), read-only:

- ``mlflow-compare.png``: MLflow's compare view of one task's two monthly retrain runs;
- ``eval-chart.png``: the gate's bar chart (``eval.png``) on the newer month's evaluate run;
- ``watchdog-timeline.png``: the power watchdog's timeline (``watchdog/timeline.png``) on that
  month's train run;
- ``review-page.png``: the blind review's page as a newly invited reviewer sees it, served by
  ``tuneloop review serve`` from a copy of ``review.db`` (the invitation lands in the copy, and
  no vote is cast);
- ``approval-form.png``: the Prefect UI's approval form of the demo's newest release that
  paused, its run set back to that pause in a copy of Prefect's store, served on a free port.

MLflow's UI is served by ``mlflow server`` over the project's store on a free port, as the
demo serves it. Every shot polls the page until what it shows is drawn, in a fixed window, so a
rerun after the next ``make demo`` gives the same pictures of the new runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from uuid import UUID

# Beside this script, which runs as `python docs/screenshots.py`: its folder is on sys.path.
from devtools import Browser, poll, stop

from tuneloop.net import free_port

WINDOW = (1400, 900)
START_TIMEOUT_S = 300  # servers on a busy 2-core machine
REVIEWER = "reviewer"  # the invited name on the copy's page


def _answers(url: str) -> bool:
    with (
        contextlib.suppress(urllib.error.URLError, OSError),
        urllib.request.urlopen(url, timeout=2) as answer,
    ):
        return bool(answer.status == 200)
    return False


@contextlib.contextmanager
def served(
    command: list[str], health: str, log: Path, env: dict[str, str] | None = None
) -> Iterator[None]:
    """``command`` running until the block ends, once ``health`` answers 200."""
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        poll(
            lambda: _answers(health) or process.poll() is not None,
            START_TIMEOUT_S,
            f"{command[0]} (see {log})",
        )
        if process.poll() is not None:
            raise RuntimeError(f"{' '.join(command[:3])} stopped; see {log}")
        yield
    finally:
        stop(process)


@dataclass(frozen=True)
class Month:
    """A task's retrain run of one month, and the runs the pictures come from."""

    task: str
    run_id: str
    run_name: str
    experiment_id: str
    train_run_id: str | None
    evaluate_run_id: str | None


def retrain_months(project: Path) -> list[Month]:
    """The newest two retrain runs (oldest first) of the task with the most of them; one
    after the demo's first month."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    experiments = [e.experiment_id for e in client.search_experiments()]
    found = client.search_runs(
        experiments,
        filter_string="tags.`tuneloop.pipeline` = 'retrain' and tags.task != ''",
        order_by=["attributes.start_time ASC"],
    )
    by_task: dict[str, list[Any]] = {}
    for run in found:
        by_task.setdefault(run.data.tags["task"], []).append(run)
    if not by_task:
        raise RuntimeError(f"{project / 'mlflow.db'} has no task's retrain run; run `make demo`")
    task = max(sorted(by_task), key=lambda t: len(by_task[t]))
    return [_month(client, task, run) for run in by_task[task][-2:]]


def _month(client: Any, task: str, run: Any) -> Month:
    children = client.search_runs(
        [run.info.experiment_id],
        filter_string=f"tags.mlflow.parentRunId = '{run.info.run_id}'",
        order_by=["attributes.start_time DESC"],
    )

    def stage(name: str) -> str | None:
        # A task's stage is `task-<name>@<task>` (dvc.yaml's foreach), a project's `<name>`.
        names = {name, f"task-{name}@{task}"}
        found = [c.info.run_id for c in children if c.data.tags.get("tuneloop.stage") in names]
        return found[0] if found else None

    return Month(
        task=task,
        run_id=run.info.run_id,
        run_name=run.info.run_name,
        experiment_id=run.info.experiment_id,
        train_run_id=stage("train"),
        evaluate_run_id=stage("evaluate"),
    )


def mlflow_shots(project: Path, out: Path, browser: Browser, logs: Path) -> list[Path]:
    months = retrain_months(project)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    command = [
        str(Path(sys.executable).with_name("mlflow")),
        "server",
        *("--host", "127.0.0.1", "--port", str(port), "--workers", "1"),
        *("--backend-store-uri", f"sqlite:///{project / 'mlflow.db'}"),
        *("--no-serve-artifacts", "--default-artifact-root", (project / "mlartifacts").as_uri()),
    ]
    written = []
    with served(command, f"{base}/health", logs / "mlflow-server.log"):
        as_a_trainer_sees_it(browser, base)
        if len(months) < 2:
            print("one month of retrain runs: no compare view (the demo's second month makes it)")
        else:
            written.append(compare_shot(base, months, out, browser))
        run_page = f"{base}/#/experiments/{months[-1].experiment_id}/runs"
        pictures = (
            ("evaluate", "eval.png", "eval-chart.png"),
            ("train", "watchdog/timeline.png", "watchdog-timeline.png"),
        )
        for stage, artifact, name in pictures:
            # The newest month whose stage ran (a cached stage makes no run).
            ids = [getattr(m, f"{stage}_run_id") for m in reversed(months)]
            run = next((i for i in ids if i), None)
            if run is None:
                print(f"no {stage} run in the months shot; skipped {name}")
                continue
            page = f"{run_page}/{run}/artifacts/{artifact}"
            written.append(browser.shoot(page, SHOWN, out / name))
    return written


def as_a_trainer_sees_it(browser: Browser, base: str) -> None:
    """MLflow 3's UI opens an assistant panel over the page on a first visit and starts in its
    GenAI view; the shots show the pages themselves, in the view for training models. Both
    choices are the browser's (its local storage for the server's origin), kept for every
    page after."""
    browser.visit(f"{base}/", TRAINING_SWITCH)
    browser.evaluate(
        "localStorage.setItem('mlflow.assistant.panelOpen_v1', 'false');"
        "localStorage.setItem('mlflow.assistant.fab.autoOpenedOnFirstLoad_v1', 'true'); true"
    )
    browser.evaluate(f"({TRAINING_SWITCH}).click(); true")


TRAINING_SWITCH = (
    "[...document.querySelectorAll('[role=button]')]"
    ".find(e => e.innerText.trim() === 'Model training')"
)
# An artifact's page shows the picture: an image wider than the page's icons, loaded.
SHOWN = "[...document.images].some(i => i.complete && i.naturalWidth > 200)"


def compare_shot(base: str, months: list[Month], out: Path, browser: Browser) -> Path:
    ids = ",".join(f'"{m.run_id}"' for m in months)
    compare = f'{base}/#/compare-runs?runs=[{ids}]&experiments=["{months[0].experiment_id}"]'
    # The page drawn (its title; placeholders before it), with both months' columns, each a
    # link to its run, and the parallel-coordinates plot (grey placeholders until it loads).
    columns = " && ".join(f"!!document.querySelector('a[href*=\"{m.run_id}\"]')" for m in months)
    drawn = f"document.body.innerText.includes('Comparing {len(months)} Runs') && {columns}"
    drawn += " && !!document.querySelector('.js-plotly-plot .parcoords')"
    return browser.shoot(compare, drawn, out / "mlflow-compare.png")


def review_shot(project: Path, out: Path, browser: Browser, work: Path) -> Path:
    """The newest review's page for a reviewer invited into a copy of the store."""
    from tuneloop.review.store import ReviewStore, create_invite

    source = project / "review.db"
    if not source.is_file():
        raise RuntimeError(f"{source} is missing: the demo's month 1 makes it; run `make demo`")
    copy = work / "review.db"
    shutil.copyfile(source, copy)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    store = ReviewStore(f"sqlite:///{copy}")
    try:
        invite = create_invite(store, REVIEWER, base_url=base)
    finally:
        store.close()
    command = [sys.executable, "-m", "tuneloop.cli", "review", "serve"]
    command += ["--db", f"sqlite:///{copy}", "--port", str(port)]
    with served(command, f"{base}/healthz", work / "review-server.log"):
        ready = "!!document.getElementById('progress')"
        return browser.shoot(invite.link, ready, out / "review-page.png")


@dataclass(frozen=True)
class Pause:
    """A release's flow run that once paused for approval, and the keys of that pause's form."""

    flow_run_id: str
    pause_key: str
    keys: dict[str, str]


def copy_prefect_db(source: Path, copy: Path) -> Pause | None:
    """``source`` (Prefect's SQLite store) copied to ``copy``; the newest release run in it
    that paused with a form (None: no release paused in it)."""
    with (
        contextlib.closing(sqlite3.connect(f"file:{source}?mode=ro", uri=True)) as db,
        contextlib.closing(sqlite3.connect(copy)) as out,
    ):
        db.backup(out)
    with contextlib.closing(sqlite3.connect(copy)) as db:
        found = db.execute(
            "SELECT i.flow_run_id, i.key FROM flow_run_input i"
            " JOIN flow_run r ON r.id = i.flow_run_id JOIN flow f ON f.id = r.flow_id"
            " WHERE f.name = 'release' AND i.key LIKE 'paused-%-schema'"
            " ORDER BY i.created DESC LIMIT 1"
        ).fetchone()
    if found is None:
        return None
    run_id, key = found
    pause_key = key.removeprefix("paused-").removesuffix("-schema")
    base = f"paused-{pause_key}"
    keys = {part: f"{base}-{part}" for part in ("description", "response", "schema")}
    return Pause(str(UUID(run_id)), pause_key, keys)


def prefect_db() -> Path | None:
    """The SQLite file of Prefect's own server (the one ``make demo`` starts), if that is what
    Prefect's settings name."""
    from prefect.settings import get_current_settings

    url = get_current_settings().server.database.connection_url
    if url is None or not url.get_secret_value().startswith("sqlite"):
        return None
    path = Path(url.get_secret_value().split(":///", 1)[1])
    return path if path.is_file() else None


def approval_shot(out: Path, browser: Browser, work: Path) -> Path | None:
    """The approval form of the demo's newest release, as the Prefect UI shows a paused run:
    its run set back to that pause in a copy of Prefect's store, served on a free port."""
    source = prefect_db()
    home = work / "prefect"
    home.mkdir()
    pause = copy_prefect_db(source, home / "prefect.db") if source else None
    if pause is None:
        print(f"no release paused for approval in Prefect's store ({source}); skipped the form")
        return None
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = os.environ | {
        "PREFECT_HOME": str(home),
        "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{home / 'prefect.db'}",
        "PREFECT_API_URL": f"{base}/api",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }
    command = [str(Path(sys.executable).with_name("prefect")), "server", "start"]
    command += ["--host", "127.0.0.1", "--port", str(port)]
    with served(command, f"{base}/api/health", work / "prefect-server.log", env):
        _pause_again(base, pause)
        browser.visit(f"{base}/runs/flow-run/{pause.flow_run_id}", RESUME_BUTTON)
        browser.evaluate(f"({RESUME_BUTTON}).click()")
        browser.wait(FORM, "the approval form")
        return browser.capture(out / "approval-form.png", clip=MODAL)


# The Prefect UI's button on a paused run, and the form it opens (the fields of ``Approval``).
RESUME_BUTTON = (
    "[...document.querySelectorAll('button')].find(b => b.innerText.trim() === 'Resume')"
)
MODAL = ".p-modal__card"
FORM = f"(document.querySelector('{MODAL}')?.innerText || '').toLowerCase().includes('approver')"


def _pause_again(base: str, pause: Pause) -> None:
    """The copy's run back in the state it was in while it waited for a person."""
    timeout = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
    state = {
        "type": "PAUSED",
        "name": "Paused",
        "state_details": {
            "pause_key": pause.pause_key,
            "pause_reschedule": False,
            "pause_timeout": timeout,
            "run_input_keyset": pause.keys,
        },
    }
    body = json.dumps({"state": state, "force": True}).encode()
    request = urllib.request.Request(
        f"{base}/api/flow_runs/{pause.flow_run_id}/set_state",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as answer:
        result = json.load(answer)
    if result.get("status") != "ACCEPT":
        raise RuntimeError(f"Prefect did not pause the copy's run again: {result}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--project",
        type=Path,
        default=Path("demos/tasks"),
        help="the demo project to shoot (what `make demo` leaves; default: demos/tasks)",
    )
    parser.add_argument(
        "--out", type=Path, default=Path("docs/img"), help="folder for the PNGs (docs/img)"
    )
    args = parser.parse_args(argv)
    project = args.project.resolve()
    if not (project / "mlflow.db").is_file():
        print(f"{project / 'mlflow.db'} is missing: run `make demo` first", file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tuneloop-shots-") as folder:
        work = Path(folder)
        browser = Browser(work / "profile", WINDOW)
        try:
            written = mlflow_shots(project, args.out, browser, work)
            written.append(review_shot(project, args.out, browser, work))
            form = approval_shot(args.out, browser, work)
            written += [form] if form else []
        finally:
            browser.close()
    for path in written:
        print(f"wrote {path} ({path.stat().st_size // 1024} KB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
