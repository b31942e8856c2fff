"""The review page as reviewers meet it: ``tuneloop review serve`` on uvicorn, stopped and
started again mid-review; a real browser (headless Chromium, driven over the DevTools
protocol) voting by mouse and by keyboard, and refusing to run a hostile answer; the store on
PostgreSQL, the team stack's database.

Needs Debian's ``chromium`` for the browser tests and ``postgresql`` for the last one (CI
installs both); each skips where its program is missing.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from docs.devtools import Browser, stop
from tests.helpers import CHROMIUM, INITDB, postgres_bin
from tests.registry_helpers import register_versions
from tests.review_helpers import CANDIDATE, CHAMPION, NAMES, review_items
from tuneloop.net import free_port
from tuneloop.params import BlindReviewParams, load_params
from tuneloop.release import approval, signoff
from tuneloop.review import store as review_store
from tuneloop.review.store import ReviewStore, create_invite, create_review, revoke, vote_rows
from tuneloop.review.tally import compute_results
from tuneloop.review.web import COOKIE, create_review_app
from tuneloop.tracking import runs

# The whole suite (`make test`): the review page on uvicorn, restarted; Chromium; PostgreSQL
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium")
WINDOW = (1280, 1000)


@contextlib.contextmanager
def review_server(db: str) -> Iterator[str]:
    """``tuneloop review serve`` over ``db`` on a free loopback port; its base URL."""
    port = free_port()
    command = [sys.executable, "-m", "tuneloop.cli", "review", "serve", "--db", db]
    server = subprocess.Popen(
        [*command, "--host", "127.0.0.1", "--port", str(port)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base}/healthz", timeout=2).status_code == 200:
                    break
            if server.poll() is not None or time.monotonic() > deadline:
                output = server.stdout.read() if server.stdout else ""
                pytest.fail(f"tuneloop review serve did not start:\n{output}")
            time.sleep(0.3)
        yield base
    finally:
        stop(server, grace=30)


FORM_FIELD = re.compile(r'<input type="hidden" name="(item|nonce)" value="([^"]*)">')
QUESTION = re.compile(r'<div class="text" id="question"[^>]*>(.*?)</div>', re.S)


def form_of(page: str) -> dict[str, str]:
    return dict(FORM_FIELD.findall(page))


def test_a_restarted_server_loses_nothing_and_resumes(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'review.db'}"
    store = ReviewStore(db)
    create_review(store, "r", review_items(6), champion=CHAMPION, candidate=CANDIDATE)
    with review_server(db) as base:
        invite = create_invite(store, "alice", base_url=base)
        browser = httpx.Client(timeout=30, follow_redirects=True)
        page = browser.get(invite.link)
        assert "Item <b>1</b> of <b>9</b>" in page.text
        for choice in ("a", "b", "tie"):
            page = browser.post(f"{base}/review/vote", data=form_of(page.text) | {"choice": choice})
            assert page.status_code == 200, page.text
        assert "Item <b>4</b> of <b>9</b>" in page.text
        waiting = QUESTION.findall(page.text)
        for name in NAMES:
            assert name.lower() not in page.text.lower()
    before = [(r.reviewer, r.item, r.preference) for r in vote_rows(store)]
    assert len(before) == 3

    with review_server(db) as base:  # a new process over the same file
        browser.cookies.set(COOKIE, invite.token)
        page = browser.get(f"{base}/review")
        assert "Item <b>4</b> of <b>9</b>" in page.text
        assert QUESTION.findall(page.text) == waiting
        while 'id="done"' not in page.text:
            page = browser.post(f"{base}/review/vote", data=form_of(page.text) | {"choice": "a"})
            assert page.status_code == 200, page.text
        assert "All done: 9 of 9" in page.text
    after = [(r.reviewer, r.item, r.preference) for r in vote_rows(store)]
    assert after[:3] == before and len(after) == 9
    store.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ReviewStore, str]]:
    folder = tmp_path_factory.mktemp("review-served")
    db = f"sqlite:///{folder / 'review.db'}"
    store = ReviewStore(db)
    create_review(store, "browser", review_items(4), champion=CHAMPION, candidate=CANDIDATE,
                  controls=1, control_gap=1)  # fmt: skip
    create_review(store, "hostile", review_items(2, hostile=True), champion=CHAMPION,
                  candidate=CANDIDATE, controls=0)  # fmt: skip
    with review_server(db) as base:
        yield store, base
    store.close()


@pytest.fixture(scope="module")
def browser(
    served: tuple[ReviewStore, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Browser]:
    if CHROMIUM is None:
        pytest.skip("needs Debian's chromium")
    found = Browser(tmp_path_factory.mktemp("chromium-profile"), WINDOW)
    yield found
    found.close()


def at_item(number: int, total: int) -> str:
    return (
        "!!document.getElementById('progress') && "
        f"document.getElementById('progress').textContent === 'Item {number} of {total}'"
    )


@needs_chromium
def test_a_reviewer_votes_by_mouse_and_by_keyboard(
    served: tuple[ReviewStore, str], browser: Browser, tmp_path_factory: pytest.TempPathFactory
) -> None:
    store, base = served
    invite = create_invite(store, "lin", review="browser", base_url=base)
    browser.visit(invite.link, at_item(1, 5))
    assert browser.evaluate("location.pathname") == "/review", "the token left the address bar"
    browser.click("#choice-a")
    browser.wait(at_item(2, 5))
    browser.press("2")
    browser.wait(at_item(3, 5))
    # Keys typed into the comment stay there; the mouse votes.
    browser.click("#comment")
    browser.send("Input.insertText", text="很好, clear")
    browser.press("1")
    assert browser.evaluate("document.getElementById('comment').value") == "很好, clear1"
    browser.evaluate("document.getElementById('comment').value = '很好, clear'")
    browser.click("#choice-tie")
    browser.wait(at_item(4, 5))
    browser.press("w")
    browser.wait(at_item(5, 5))
    browser.press("t")
    browser.wait("!!document.getElementById('done')")
    text = browser.evaluate("document.body.innerText")
    assert "All done: 5 of 5" in text

    with store.engine.connect() as conn:
        cast = list(
            conn.execute(
                sa.select(review_store.votes.c.choice, review_store.votes.c.comment)
                .join(review_store.reviewers)
                .where(review_store.reviewers.c.name == "lin")
                .order_by(review_store.votes.c.id)
            )
        )
    assert [c for c, _ in cast] == ["a", "b", "tie", "both_wrong", "tie"]
    assert cast[2][1] == "很好, clear"
    results = compute_results(store, "browser")
    assert results.votes == 4 and [r.controls for r in results.reviewers] == [1]
    reaches_mlflow_the_card_and_status(store, tmp_path_factory.mktemp("review-mlflow"))


def reaches_mlflow_the_card_and_status(store: ReviewStore, folder: Path) -> None:
    """The browser's votes, judged by the gate's review rule, on the candidate's MLflow run
    (metrics, table, plot), in its model card and in `tuneloop status`."""
    client = register_versions(folder, "support", [{}, {}])
    candidate = client.get_model_version("support", "2")
    run_id = str(candidate.run_id)
    card = folder / "model-card.md"
    card.write_text("# support: candidate\n\n## Blind review\n\nNot reviewed yet.\n\n"
                    "## Compute\n\n2 CPU cores\n", encoding="utf-8")  # fmt: skip
    client.log_artifact(run_id, str(card), "evaluation")
    gate = load_params(ROOT / "params.yaml").gate.model_copy(
        update={"blind_review": BlindReviewParams(min_votes=10, margin=0.1)}
    )
    judged = signoff.judge_review(store, "browser", gate)
    assert judged.check is not None and judged.check.status == "inconclusive"
    assert "6 more votes needed" in judged.check.reason
    signoff.record_review(client, run_id, judged, candidate)

    run = client.get_run(run_id)
    assert run.data.metrics["review.votes"] == 4.0
    assert run.data.metrics["review.win"] == judged.results.overall.win.value
    assert run.data.tags["review.status"] == "inconclusive"
    listed = {a.path for a in client.list_artifacts(run_id, "review")}
    assert listed == {"review/results.md", "review/results.json", "review/results.png"}
    local = Path(client.download_artifacts(run_id, "", str(folder / "got")))
    assert (local / "review/results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| all | 4 |" in (local / "review/results.md").read_text(encoding="utf-8")
    carded = (local / "evaluation/model-card.md").read_text(encoding="utf-8")
    assert carded.count("## Blind review") == 1 and "Not reviewed yet" not in carded
    assert "blind review browser: 4 votes by 1 reviewers" in carded
    assert carded.index("## Blind review") < carded.index("## Compute")
    tags = client.get_model_version("support", "2").tags
    assert tags[signoff.TAG_REVIEW] == judged.summary()
    with runs.use_tracking_uri(f"sqlite:///{folder / 'mlflow.db'}"):
        shown = approval.format_status(
            {
                "aliases": {"champion": "1", "challenger": "2"},
                "challenger_tags": approval.version_tags("support", "2"),
                "waiting_for_approval": [],
            }
        )
    assert f"review: {judged.summary()}" in shown


@needs_chromium
def test_a_hostile_answer_is_shown_and_never_run(
    served: tuple[ReviewStore, str], browser: Browser
) -> None:
    store, base = served
    invite = create_invite(store, "mallory", review="hostile", base_url=base)
    browser.visit(invite.link, at_item(1, 2))
    time.sleep(1.0)  # time for an <img onerror> to fire, had one been made
    assert browser.evaluate("document.title") == "Blind review: item 1 of 2"
    assert browser.evaluate("document.querySelectorAll('img, .answer b').length") == 0
    assert browser.evaluate("document.scripts.length") == 1
    shown = browser.evaluate(
        "document.getElementById('answer-a').innerText + document.getElementById('answer-b')"
        ".innerText"
    )
    assert "<script>document.title='pwned'</script>" in shown
    assert "<img src=x onerror=\"document.title='pwned'\">" in shown
    assert "马上为您处理" in shown and "请稍候" in shown
    lang = browser.evaluate("document.getElementById('question').lang")
    assert lang in ("en", "zh")
    source = browser.evaluate("document.documentElement.outerHTML").lower()
    for name in NAMES:
        assert name.lower() not in source


@pytest.fixture(scope="module")
def postgres_url() -> Iterator[str]:
    """A throwaway PostgreSQL cluster on 127.0.0.1 with a ``review`` database: its URL."""
    bin_dir = postgres_bin()
    if bin_dir is None:
        pytest.skip("PostgreSQL is not installed (Debian: apt-get install postgresql)")
    pytest.importorskip("psycopg", reason="psycopg 3 (the server extra) is not installed")
    as_user: list[str] = []
    folder = Path(tempfile.mkdtemp(prefix="tuneloop-review-pg-"))
    if os.geteuid() == 0:  # initdb refuses root
        try:
            owner = pwd.getpwnam("postgres")
        except KeyError:
            shutil.rmtree(folder)
            pytest.skip("running as root and there is no 'postgres' user to run PostgreSQL as")
        os.chown(folder, owner.pw_uid, owner.pw_gid)
        as_user = ["runuser", "-u", "postgres", "--"]
    data, port = folder / "data", free_port()
    pg_ctl = [*as_user, str(bin_dir / "pg_ctl"), "-D", str(data)]

    def run(*command: str) -> None:
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            pytest.fail(f"{' '.join(command)}:\n{done.stdout}{done.stderr}")

    started = False
    try:
        run(*as_user, str(bin_dir / "initdb"), "-D", str(data), *INITDB)
        options = f"-c listen_addresses=127.0.0.1 -p {port} -k {folder} -c fsync=off"
        run(*pg_ctl, "-l", str(folder / "log"), "-w", "-t", "60", "-o", options, "start")
        started = True
        run(str(bin_dir / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "postgres",
            "review")  # fmt: skip
        yield f"postgresql+psycopg://postgres@127.0.0.1:{port}/review"
    finally:
        if started:
            subprocess.run([*pg_ctl, "-m", "immediate", "stop"], capture_output=True, check=False)
        shutil.rmtree(folder, ignore_errors=True)


def test_the_store_on_postgresql(postgres_url: str) -> None:
    store = ReviewStore(postgres_url)
    items = review_items(6)
    items[0] = replace(items[0], candidate_answer="a model's NUL: \x00")
    create_review(store, "pg", items, champion=CHAMPION, candidate=CANDIDATE)
    invites = {name: create_invite(store, name, base_url="http://t") for name in ("ann", "bo")}

    def reviewer(name: str, on: ReviewStore) -> TestClient:
        client = TestClient(create_review_app(on), base_url="http://t")
        client.cookies.set(COOKIE, invites[name].token)
        return client

    ann = reviewer("ann", store)
    page = ann.get("/review/next.json").json()
    form = {"item": page["item"], "nonce": page["nonce"], "choice": "a", "comment": "好"}
    assert ann.post("/review/vote", data=form, follow_redirects=False).status_code == 303
    assert ann.post("/review/vote", data=form).status_code == 409  # replayed
    nul = ann.post("/review/vote", data=form | {"comment": "\x00"})
    assert nul.status_code == 400 and "NUL" in nul.text
    again = ann.get("/review/next.json").json()
    stale = form | {"nonce": ann.get("/review/next.json").json()["nonce"]}
    assert again["item"] != form["item"] and stale["item"] == form["item"]
    assert ann.post("/review/vote", data=stale).status_code == 403  # not this item's form
    assert reviewer("bo", store).post("/review/vote", data=form).status_code == 403
    store.close()

    restarted = ReviewStore(postgres_url)
    ann, bo = reviewer("ann", restarted), reviewer("bo", restarted)
    assert ann.get("/review/next.json").json()["number"] == 2
    while not (page := ann.get("/review/next.json").json())["done"]:
        form = {"item": page["item"], "nonce": page["nonce"], "choice": "b"}
        assert ann.post("/review/vote", data=form, follow_redirects=False).status_code == 303
    page = bo.get("/review/next.json").json()
    form = {"item": page["item"], "nonce": page["nonce"], "choice": "tie"}
    assert bo.post("/review/vote", data=form, follow_redirects=False).status_code == 303
    assert revoke(restarted, "bo") == 1
    rows = vote_rows(restarted)
    assert rows[0].comment == "好" and rows[0].slices["language"] in ("en", "zh")
    with restarted.engine.connect() as conn:
        answers = list(conn.scalars(sa.select(review_store.items.c.candidate_answer)))
    assert "a model's NUL: \ufffd" in answers
    assert sum(r.reviewer == "ann" for r in rows) == 9
    results = compute_results(restarted, "pg")
    assert results.votes == 6 + 1 and results.revoked_votes == 1
    restarted.close()
