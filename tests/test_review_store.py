"""The review page in process (FastAPI's TestClient over SQLite): blindness, escaping, every
refusal, a restart mid-review, revocation, and the ``tuneloop review`` commands."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient
from httpx import Response

from tests.review_helpers import CANDIDATE, CHAMPION, NAMES, review_items, sqlite_store
from tuneloop.review import store as review_store
from tuneloop.review.store import (
    Invite,
    ReviewError,
    ReviewStore,
    create_invite,
    create_review,
    revoke,
    vote_rows,
)
from tuneloop.review.tally import compute_results
from tuneloop.review.web import COOKIE, MAX_BODY, MAX_COMMENT, create_review_app

# The fast tier: no pipeline, server or rank.
pytestmark = pytest.mark.fast

BASE = "http://review.test"


@pytest.fixture
def store(tmp_path: Path) -> Iterator[ReviewStore]:
    found = sqlite_store(tmp_path)
    create_review(found, "month-1", review_items(8), champion=CHAMPION, candidate=CANDIDATE)
    yield found
    found.close()


class Reviewer:
    """A reviewer's browser: the invitation's cookie, and every response it was given."""

    def __init__(self, store: ReviewStore, invite: Invite) -> None:
        self.client = TestClient(create_review_app(store), base_url=BASE)
        self.responses: list[Response] = []
        self.get(invite.link.removeprefix(BASE), follow_redirects=False)
        self.client.cookies.set(COOKIE, invite.token)

    def get(self, url: str, **kw: object) -> Response:
        response = self.client.get(url, **kw)  # type: ignore[arg-type]
        self.responses.append(response)
        return response

    def post(self, data: dict[str, str], **kw: object) -> Response:
        response = self.client.post("/review/vote", data=data, **kw)  # type: ignore[arg-type]
        self.responses.append(response)
        return response

    def page(self) -> dict[str, str]:
        """The next item as the JSON endpoint gives it (the same as the HTML page)."""
        return self.get("/review/next.json").json()  # type: ignore[no-any-return]

    def vote(self, choice: str = "a", comment: str = "") -> Response:
        found = self.page()
        form = {"item": found["item"], "nonce": found["nonce"], "choice": choice}
        return self.post(form | {"comment": comment}, follow_redirects=False)


def invite(store: ReviewStore, name: str) -> Reviewer:
    return Reviewer(store, create_invite(store, name, base_url=BASE))


def stored(store: ReviewStore) -> list[tuple[object, ...]]:
    with store.engine.connect() as conn:
        return [tuple(r) for r in conn.execute(sa.select(review_store.votes))]


def test_an_invitation_stores_only_the_tokens_hash(store: ReviewStore) -> None:
    made = create_invite(store, "alice", base_url=BASE)
    assert made.link == f"{BASE}/r/{made.token}" and len(made.token) >= 40
    with store.engine.connect() as conn:
        hashes = list(conn.scalars(sa.select(review_store.reviewers.c.token_sha256)))
    assert hashes == [review_store.sha256(made.token)]
    # Inviting again: a new link, and the old one no longer opens anything.
    again = create_invite(store, "alice", base_url=BASE)
    client = TestClient(create_review_app(store), base_url=BASE)
    assert client.get(f"/r/{made.token}", follow_redirects=False).status_code == 401
    assert client.get(f"/r/{again.token}", follow_redirects=False).status_code == 303


def test_each_reviewer_sees_every_item_once_and_controls_come_back(store: ReviewStore) -> None:
    alice = invite(store, "alice")
    shown: list[str] = []
    while not (found := alice.page()).get("done"):
        assert found["number"] == len(shown) + 1
        shown.append(found["question"])
        assert alice.vote("a").status_code == 303
    assert len(shown) == 8 + 3 and len(set(shown)) == 8
    rows = vote_rows(store)
    assert sum(r.control for r in rows) == 3
    # "A" means the candidate where it came first and the champion elsewhere: both occur.
    assert {r.preference for r in rows} == {"candidate", "champion"}
    done = alice.get("/review")
    assert "All done: 11 of 11" in done.text


def test_no_response_names_a_model(store: ReviewStore) -> None:
    """Every page, redirect, JSON answer and refusal a reviewer can get, headers included."""
    alice, bob = invite(store, "alice"), invite(store, "bob")
    alice.get("/")
    alice.get("/healthz")
    alice.get("/docs")
    alice.get("/openapi.json")
    alice.get("/review")
    first = alice.page()
    alice.post({"item": first["item"], "nonce": first["nonce"], "choice": "b"})  # 303 -> page
    alice.post({"item": first["item"], "nonce": first["nonce"], "choice": "b"})  # 409 replay
    bob.post({"item": first["item"], "nonce": first["nonce"], "choice": "a"})  # 403
    alice.post({"item": "x", "nonce": "y", "choice": "maybe"})  # 400
    alice.post({"item": "x", "nonce": "y", "choice": "a", "comment": "\x00"})  # 400
    alice.post({"item": "x", "nonce": "y", "choice": "a", "extra": "1"})  # 400
    as_json = {"content-type": "application/json"}
    alice.responses.append(alice.client.post("/review/vote", content=b"{}", headers=as_json))
    alice.post({"item": "x", "nonce": "y", "choice": "a", "comment": "x" * (MAX_COMMENT + 1)})
    alice.get("/r/not-a-token", follow_redirects=False)
    alice.get("/review", cookies={COOKIE: "forged"})
    while not alice.page().get("done"):
        alice.vote("tie", comment="fine")
    alice.get("/review")
    alice.post({"item": first["item"], "nonce": first["nonce"], "choice": "a"},
               headers={"accept": "application/json"})  # fmt: skip
    revoke(store, "bob")
    bob.get("/review")
    bob.get("/review/next.json")
    statuses = {r.status_code for r in alice.responses + bob.responses}
    assert {200, 303, 400, 401, 403, 404, 409, 413, 415} <= statuses
    for response in alice.responses + bob.responses:
        seen = (str(response.url) + str(response.headers) + response.text).lower()
        for name in NAMES:
            assert name.lower() not in seen, f"{name!r} in {response.url} ({response.status_code})"


def test_an_answers_html_is_text(tmp_path: Path) -> None:
    store = sqlite_store(tmp_path)
    create_review(store, "hostile", review_items(2, hostile=True), champion="a", candidate="b",
                  controls=0)  # fmt: skip
    page = invite(store, "alice").get("/review")
    assert page.headers["content-type"] == "text/html; charset=utf-8"
    assert "&lt;script&gt;document.title=&#x27;pwned&#x27;&lt;/script&gt;" in page.text
    assert "<script>document" not in page.text and "<img" not in page.text
    assert "<b>bold?</b>" not in page.text
    # One script, the page's own, allowed by the policy's nonce; no other can run.
    assert page.text.count("<script") == 1
    nonce = page.text.split('<script nonce="', 1)[1].split('"', 1)[0]
    assert f"script-src 'nonce-{nonce}'" in page.headers["content-security-policy"]
    assert page.headers["x-content-type-options"] == "nosniff"


def test_chinese_is_served_as_utf8_with_its_lang(store: ReviewStore) -> None:
    alice = invite(store, "alice")
    while "我" not in (found := alice.page())["question"] and "如" not in found["question"]:
        alice.vote("a")
    page = alice.get("/review")
    assert page.content.decode("utf-8") == page.text
    assert f'lang="zh">{found["question"]}</div>' in page.text
    assert "马上为您处理" in page.text and '<meta charset="utf-8">' in page.text


def test_refused_without_a_token(store: ReviewStore) -> None:
    alice = invite(store, "alice")
    found = alice.page()
    stranger = TestClient(create_review_app(store), base_url=BASE)
    answer = stranger.post("/review/vote", data={**found, "choice": "a"} | {"comment": ""})
    assert answer.status_code == 401
    assert stranger.get("/review").status_code == 401
    assert stored(store) == []


def vote_form(found: dict[str, str], choice: str = "a") -> dict[str, str]:
    return {"item": found["item"], "nonce": found["nonce"], "choice": choice, "comment": ""}


def test_refused_with_another_reviewers_token(store: ReviewStore) -> None:
    alice, bob = invite(store, "alice"), invite(store, "bob")
    alice.vote("a")
    before = stored(store)
    found = alice.page()
    assert bob.post(vote_form(found)).status_code == 403  # alice's item, bob's cookie
    bobs = bob.page()  # bob's own nonce with alice's item: still not his item
    assert bob.post(vote_form(found | {"nonce": bobs["nonce"]})).status_code == 403
    assert stored(store) == before
    assert alice.post(vote_form(found), follow_redirects=False).status_code == 303


def test_refused_a_second_vote_on_the_same_item(store: ReviewStore) -> None:
    alice = invite(store, "alice")
    first, reloaded = alice.page(), alice.page()  # the page loaded twice: two forms
    assert first["item"] == reloaded["item"] and first["nonce"] != reloaded["nonce"]
    assert alice.post(vote_form(first, "a"), follow_redirects=False).status_code == 303
    before = stored(store)
    second = alice.post(vote_form(reloaded, "b"))
    assert second.status_code == 409 and "already voted" in second.text
    assert stored(store) == before


def test_refused_a_replayed_request(store: ReviewStore) -> None:
    alice = invite(store, "alice")
    form = vote_form(alice.page(), "tie")
    assert alice.post(form, follow_redirects=False).status_code == 303
    before = stored(store)
    replay = alice.post(form)
    assert replay.status_code == 409 and "already sent" in replay.text
    assert stored(store) == before and len(before) == 1


def test_refused_a_vote_on_an_item_never_shown(store: ReviewStore) -> None:
    alice = invite(store, "alice")
    current = alice.page()
    with store.engine.connect() as conn:
        later = conn.scalar(
            sa.select(review_store.slots.c.key)
            .where(review_store.slots.c.position == 5)
            .where(review_store.slots.c.reviewer_id == 1)
        )
    assert later != current["item"]
    # With the current page's nonce, and with a made-up one.
    assert alice.post(vote_form(current | {"item": later})).status_code == 403
    assert alice.post(vote_form({"item": later, "nonce": "made-up"})).status_code == 403
    assert stored(store) == []


def test_refused_an_oversized_comment(store: ReviewStore) -> None:
    alice = invite(store, "alice")
    found = alice.page()
    long = alice.post(vote_form(found) | {"comment": "长" * (MAX_COMMENT + 1)})
    assert long.status_code == 413 and "comment" in long.text
    huge = alice.post(vote_form(found) | {"comment": "x" * (MAX_BODY + 10)})
    assert huge.status_code == 413
    # Without a Content-Length (chunked): cut off as it passes the limit.
    body = f"item={found['item']}&nonce={found['nonce']}&choice=a&comment=".encode()
    chunks = iter([body, b"x" * MAX_BODY])
    headers = {"content-type": "application/x-www-form-urlencoded"}
    chunked = alice.client.post("/review/vote", content=chunks, headers=headers)
    assert chunked.status_code == 413
    assert stored(store) == []
    # The page is still good for a vote of a sane size.
    ok = alice.post(vote_form(found) | {"comment": "长" * MAX_COMMENT}, follow_redirects=False)
    assert ok.status_code == 303
    assert vote_rows(store)[0].comment == "长" * MAX_COMMENT


def test_refused_after_revocation_and_past_votes_are_kept_and_marked(store: ReviewStore) -> None:
    alice, bob = invite(store, "alice"), invite(store, "bob")
    alice.vote("a")
    bob.vote("a")
    pending = alice.page()
    assert revoke(store, "alice") == 1
    before = stored(store)
    assert alice.post(vote_form(pending)).status_code == 403
    assert alice.get("/review").status_code == 403
    assert stored(store) == before
    marks = {row.reviewer: row.reviewer_revoked for row in vote_rows(store)}
    assert marks == {"alice": True, "bob": False}
    results = compute_results(store)
    assert results.revoked_votes == 1 and results.votes == 2
    assert compute_results(store, include_revoked=False).votes == 1
    with pytest.raises(ReviewError, match="revoked"):
        create_invite(store, "alice")


def test_a_restart_loses_nothing_and_resumes_where_each_reviewer_was(tmp_path: Path) -> None:
    first = sqlite_store(tmp_path)
    create_review(first, "r", review_items(6), champion=CHAMPION, candidate=CANDIDATE)
    alice_invite, bob_invite = create_invite(first, "alice"), create_invite(first, "bob")
    alice, bob = Reviewer(first, alice_invite), Reviewer(first, bob_invite)
    for _ in range(3):
        alice.vote("a", comment="好")
    bob.vote("b")
    expected_alice, expected_bob = alice.page()["question"], bob.page()["question"]
    before = stored(first)
    first.close()

    second = sqlite_store(tmp_path)  # a new process would open the same file
    alice, bob = Reviewer(second, alice_invite), Reviewer(second, bob_invite)
    assert stored(second) == before
    page = alice.get("/review")
    assert "Item <b>4</b> of <b>" in page.text
    assert alice.page()["question"] == expected_alice
    assert bob.page()["question"] == expected_bob
    while not alice.page().get("done"):
        assert alice.vote("a").status_code == 303
    assert len([r for r in vote_rows(second) if r.reviewer == "alice"]) == 6 + 3  # 3 controls


def test_a_review_needs_items_and_a_new_name(tmp_path: Path) -> None:
    store = sqlite_store(tmp_path)
    with pytest.raises(ReviewError, match="no items"):
        create_review(store, "r", [], champion="a", candidate="b")
    create_review(store, "r", review_items(2), champion="a", candidate="b")
    with pytest.raises(ReviewError, match="exists"):
        create_review(store, "r", review_items(2), champion="a", candidate="b")
    with pytest.raises(ReviewError, match="no review named"):
        create_invite(store, "alice", review="nope")


def test_the_review_commands(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tuneloop.cli import main

    db = ["--db", f"sqlite:///{tmp_path / 'review.db'}"]
    items = tmp_path / "items.jsonl"
    items.write_text(
        "".join(
            json.dumps(
                {
                    "question": item.question,
                    "champion_answer": item.champion_answer,
                    "candidate_answer": item.candidate_answer,
                    "slices": dict(item.slices),
                    "ref": item.ref,
                },
                ensure_ascii=False,
            )
            + "\n"
            for item in review_items(6)
        ),
        encoding="utf-8",
    )
    create = ["review", "create", "month-1", str(items), *db]
    assert main([*create, "--champion", CHAMPION, "--candidate", CANDIDATE]) == 0
    assert main(["review", "invite", "alice", "--base-url", BASE, *db]) == 0
    link = capsys.readouterr().out.strip().splitlines()[-1]
    assert link.startswith(f"{BASE}/r/")

    store = ReviewStore(db[1])
    alice = Reviewer(store, Invite("alice", link, link.rsplit("/", 1)[1]))
    for choice in ("a", "b", "tie", "both_wrong"):
        alice.vote(choice, comment="ok")
    assert main(["review", "results", *db]) == 0
    table = capsys.readouterr().out
    # Alice saw 4 of the 6 items in her own random order, so which intents they hold varies
    # (both refund items are left out one time in 15); each language always has a vote.
    assert "| all | 4 |" in table and "| alice | 4 |" in table and "| intent=" in table
    assert "| language=en |" in table and "| language=zh |" in table
    assert main(["review", "results", "--json", *db]) == 0
    as_json = json.loads(capsys.readouterr().out)
    assert as_json["votes"] == 4 and as_json["candidate"] == CANDIDATE
    assert main(["review", "revoke", "alice", *db]) == 0
    assert "4 past votes kept" in capsys.readouterr().out
    assert main(["review", "revoke", "nobody", *db]) == 1
    assert "no reviewer 'nobody'" in capsys.readouterr().err
    assert main(["review", "results", "--exclude-revoked", "--json", *db]) == 0
    assert json.loads(capsys.readouterr().out)["votes"] == 0


def test_two_sends_of_one_form_at_once_record_one_vote(store: ReviewStore) -> None:
    """A double click: the same form twice, concurrently; one vote, one 409, no error."""
    reviewer = review_store.reviewer_of(store, create_invite(store, "alice").token)

    def send(page: review_store.Page, choice: str, start: threading.Barrier) -> object:
        start.wait()
        try:
            return review_store.record_vote(store, reviewer, page.key, page.nonce, choice, "")
        except review_store.Refused as refused:
            return refused.status

    for _ in range(3):
        page = review_store.next_page(store, reviewer)
        assert page is not None
        start = threading.Barrier(2)
        with ThreadPoolExecutor(2) as pool:
            outcomes = list(pool.map(send, [page, page], ["a", "b"], [start, start]))
        assert outcomes.count(409) == 1, outcomes
        assert {o for o in outcomes if o != 409} <= {"candidate", "champion"}
    assert len(stored(store)) == 3


def test_the_demo_panel_votes_through_the_page_for_the_answers_the_suite_marks_right(
    store: ReviewStore,
) -> None:
    from tuneloop.data.text import normalise
    from tuneloop.demo import reviewers

    # The suite's reference is the candidate's answer on every item: a reviewer without noise
    # would prefer the candidate every time, whichever side the page put it on.
    refs = {normalise(item.question): item.candidate_answer for item in review_items(8)}
    cast = {}
    for reviewer in reviewers.PANEL:
        link = create_invite(store, reviewer.name, base_url=BASE).link
        client = TestClient(create_review_app(store), base_url=BASE)
        cast[reviewer.name] = reviewers.vote_through_the_page(client, link, reviewer, refs, seed=0)
    results = compute_results(store, "month-1")
    controls = [r.controls for r in results.reviewers]
    assert cast == {r.name: 8 + c for r, c in zip(results.reviewers, controls, strict=True)}
    assert results.votes == 24 and all(c > 0 for c in controls)
    assert results.overall.win.count >= 18 and results.overall.decisive.low > 0.7
    # The same seed votes the same way again (the panel's tastes are seeded per reviewer).
    rng_a, rng_b = (reviewers.random.Random("0/ana") for _ in range(2))
    item = review_items(1)[0]
    votes = [
        reviewers.choose(item.question, item.champion_answer, item.candidate_answer, refs, rng, 0.5)
        for rng in (rng_a, rng_b)
    ]
    assert votes[0] == votes[1]
    never = reviewers.random.Random(0)
    right, wrong = item.candidate_answer, item.champion_answer
    assert reviewers.choose(item.question, right, wrong, refs, never, 0.0) == "a"
    assert reviewers.choose(item.question, wrong, right, refs, never, 0.0) == "b"
    assert reviewers.choose(item.question, right, right, refs, never, 0.0) == "tie"
    assert reviewers.choose(item.question, wrong, wrong, refs, never, 0.0) == "both_wrong"
