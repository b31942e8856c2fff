"""The blind review's durable state: reviews, reviewers by invitation, their plans, their votes.

One database holds every review: SQLite in the project (``review.db``) by default, the team
stack's PostgreSQL through ``TUNELOOP_REVIEW_DB`` (any SQLAlchemy URL, as MLflow's
``--backend-store-uri`` and Prefect's ``PREFECT_API_DATABASE_CONNECTION_URL`` take one). Only
SQLAlchemy Core is used, so both behave the same.

What a reviewer is shown is decided once, when they are invited, and stored: their *plan* is
the review's items in an order of their own, each with a coin for which answer comes first
(A), plus a few *control* slots that repeat an item they saw earlier, with a fresh coin. The
plan is drawn from the review's secret and the reviewer's name, so it is deterministic; being
stored, a restarted server shows every reviewer the same next item. The page never learns
which answer is whose: a slot is named by a random key, and the store maps the reviewer's
"A" or "B" back to the candidate or the champion when the vote is written.

Votes are written one transaction each, and only against a *page*: a one-time nonce issued
when the store hands a reviewer their next item. A vote is refused (``Refused``, with the
HTTP status the page answers with) without a known reviewer (401), from a revoked one (403),
for a slot that is not theirs or was never shown to them (403), with a used nonce (409, a
replay) or on a slot already voted (409). A refusal changes nothing.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import random
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

DB_URL_ENV = "TUNELOOP_REVIEW_DB"
DEFAULT_DB = "review.db"  # in the project, beside MLflow's mlflow.db
DEFAULT_PORT = 8765  # of `tuneloop review serve`
DEFAULT_BASE_URL = f"http://127.0.0.1:{DEFAULT_PORT}"
# Control repeats per reviewer, and the other items at least between an item and its repeat.
CONTROLS = 3
CONTROL_GAP = 3
# What a reviewer may answer, as the form sends it; "a" and "b" are positions on their page.
CHOICES = ("a", "b", "tie", "both_wrong")
# What a vote means once the store has undone the page's order.
PREFERENCES = ("candidate", "champion", "tie", "both_wrong")
SLICE_KEYS = ("intent", "language")

metadata = sa.MetaData()
reviews = sa.Table(
    "review",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("name", sa.String(200), nullable=False, unique=True),
    sa.Column("champion", sa.String(500), nullable=False),
    sa.Column("candidate", sa.String(500), nullable=False),
    sa.Column("secret", sa.String(64), nullable=False),
    sa.Column("controls", sa.Integer, nullable=False),
    sa.Column("control_gap", sa.Integer, nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
)
items = sa.Table(
    "review_item",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("review_id", sa.ForeignKey("review.id"), nullable=False),
    sa.Column("position", sa.Integer, nullable=False),
    sa.Column("ref", sa.String(500), nullable=False),
    sa.Column("question", sa.Text, nullable=False),
    sa.Column("champion_answer", sa.Text, nullable=False),
    sa.Column("candidate_answer", sa.Text, nullable=False),
    sa.Column("slices", sa.JSON, nullable=False),
    sa.UniqueConstraint("review_id", "position"),
)
reviewers = sa.Table(
    "review_reviewer",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("review_id", sa.ForeignKey("review.id"), nullable=False),
    sa.Column("name", sa.String(200), nullable=False),
    sa.Column("token_sha256", sa.String(64), nullable=False, unique=True),
    sa.Column("invited_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("revoked_at", sa.DateTime(timezone=True)),
    sa.UniqueConstraint("review_id", "name"),
)
slots = sa.Table(
    "review_slot",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("reviewer_id", sa.ForeignKey("review_reviewer.id"), nullable=False),
    sa.Column("position", sa.Integer, nullable=False),
    sa.Column("item_id", sa.ForeignKey("review_item.id"), nullable=False),
    sa.Column("key", sa.String(32), nullable=False, unique=True),
    sa.Column("control", sa.Boolean, nullable=False),
    sa.Column("candidate_first", sa.Boolean, nullable=False),
    sa.UniqueConstraint("reviewer_id", "position"),
    sa.UniqueConstraint("reviewer_id", "item_id", "control"),
)
pages = sa.Table(
    "review_page",
    metadata,
    sa.Column("nonce_sha256", sa.String(64), primary_key=True),
    sa.Column("slot_id", sa.ForeignKey("review_slot.id"), nullable=False),
    sa.Column("issued_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("used_at", sa.DateTime(timezone=True)),
)
votes = sa.Table(
    "review_vote",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("slot_id", sa.ForeignKey("review_slot.id"), nullable=False, unique=True),
    sa.Column("reviewer_id", sa.ForeignKey("review_reviewer.id"), nullable=False),
    sa.Column("item_id", sa.ForeignKey("review_item.id"), nullable=False),
    sa.Column("choice", sa.String(16), nullable=False),
    sa.Column("preference", sa.String(16), nullable=False),
    sa.Column("comment", sa.Text, nullable=False),
    sa.Column("voted_at", sa.DateTime(timezone=True), nullable=False),
    # Set when the reviewer is revoked: the vote is kept, and the results say so.
    sa.Column("reviewer_revoked", sa.Boolean, nullable=False),
)


class ReviewError(ValueError):
    """A wrong call (an unknown review or reviewer, a name taken, an empty review)."""


class Refused(Exception):
    """A vote or page turned away; ``status`` is the HTTP answer, ``reason`` says why."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


@dataclass(frozen=True)
class ReviewItem:
    """One question with the champion's and the candidate's answers, and its slice labels."""

    question: str
    champion_answer: str
    candidate_answer: str
    slices: Mapping[str, str] = field(default_factory=dict)  # e.g. intent, language
    ref: str = ""  # where it came from: a suite item's id, a badcase's id

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> ReviewItem:
        """An item from its JSON record (evaluate's ``review-items.jsonl``, an items file);
        a missing question or answer raises KeyError."""
        return cls(
            question=record["question"],
            champion_answer=record["champion_answer"],
            candidate_answer=record["candidate_answer"],
            slices=record.get("slices", {}),
            ref=str(record.get("ref", "")),
        )


@dataclass(frozen=True)
class Invite:
    name: str
    link: str
    token: str  # shown once; the store keeps only its sha256


@dataclass(frozen=True)
class Reviewer:
    id: int
    review_id: int
    name: str
    revoked: bool


@dataclass(frozen=True)
class Page:
    """What the next page shows a reviewer: no model names, the answers in their order."""

    key: str  # the slot's opaque key, sent back as the form's ``item``
    nonce: str  # one-time: a vote needs it, and uses it up
    question: str
    answer_a: str
    answer_b: str
    language: str | None
    number: int  # this item is number ``number`` of ``total``
    total: int


@dataclass(frozen=True)
class VoteRow:
    """A vote as the results read it."""

    reviewer: str
    item: int
    control: bool
    preference: str
    slices: Mapping[str, str]
    reviewer_revoked: bool
    comment: str = ""


def now() -> datetime:
    return datetime.now(UTC)


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def default_url(project: Path | None = None) -> str:
    """``TUNELOOP_REVIEW_DB`` if set, else SQLite in the project (the working directory)."""
    return os.environ.get(DB_URL_ENV) or f"sqlite:///{(project or Path.cwd()) / DEFAULT_DB}"


class ReviewStore:
    """The database behind every review; tables are created on first use."""

    def __init__(self, url: str | None = None) -> None:
        self.url = url or default_url()
        # SQLite lets one writer in at a time: a vote waits for another's transaction (they are
        # milliseconds) rather than failing with "database is locked" after pysqlite's 5 s.
        options = {"connect_args": {"timeout": 30}} if self.url.startswith("sqlite") else {}
        self.engine: Engine = sa.create_engine(self.url, **options)
        metadata.create_all(self.engine)

    def close(self) -> None:
        self.engine.dispose()


def _storable(text: str) -> str:
    """A model's text as both databases hold it: PostgreSQL's text type refuses NUL, which a
    model may emit; it is shown as U+FFFD, the replacement character, instead."""
    return text.replace("\x00", "\ufffd")


def _inserted_id(result: sa.CursorResult[Any]) -> int:
    key = result.inserted_primary_key
    if key is None:
        raise RuntimeError("the database returned no id for a new row")
    return int(key[0])


def _review_row(conn: Connection, review: str | None) -> Any:
    """The named review, or the newest one when ``review`` is None."""
    query = sa.select(reviews)
    if review is None:
        row = conn.execute(query.order_by(reviews.c.id.desc()).limit(1)).first()
        if row is None:
            raise ReviewError("no review in the store yet; create one first")
        return row
    row = conn.execute(query.where(reviews.c.name == review)).first()
    if row is None:
        known = [r.name for r in conn.execute(sa.select(reviews.c.name))]
        raise ReviewError(f"no review named {review!r} (known: {known})")
    return row


def create_review(
    store: ReviewStore,
    name: str,
    review_items: Sequence[ReviewItem],
    *,
    champion: str,
    candidate: str,
    controls: int = CONTROLS,
    control_gap: int = CONTROL_GAP,
) -> int:
    """Store a review of ``review_items``: its id. The names of the two models stay in the store.

    ``controls`` items per reviewer come back after at least ``control_gap`` others (fewer
    when the review is too short to repeat that many that far apart).
    """
    if not review_items:
        raise ReviewError(f"review {name!r} has no items; give at least one")
    if controls < 0 or control_gap < 0:
        raise ReviewError("controls and control_gap are counts: 0 or more")
    for index, item in enumerate(review_items):
        for text in (item.question, item.champion_answer, item.candidate_answer):
            if not isinstance(text, str):
                raise ReviewError(f"item {index} ({item.ref!r}): question and answers are text")
    with store.engine.begin() as conn:
        if conn.execute(sa.select(reviews.c.id).where(reviews.c.name == name)).first():
            raise ReviewError(f"a review named {name!r} exists; give the new one another name")
        inserted = conn.execute(
            reviews.insert().values(
                name=name,
                champion=champion,
                candidate=candidate,
                secret=secrets.token_hex(32),
                controls=controls,
                control_gap=control_gap,
                created_at=now(),
            )
        )
        review_id = _inserted_id(inserted)
        conn.execute(
            items.insert(),
            [
                {
                    "review_id": review_id,
                    "position": index,
                    "ref": item.ref or str(index),
                    "question": _storable(item.question),
                    "champion_answer": _storable(item.champion_answer),
                    "candidate_answer": _storable(item.candidate_answer),
                    "slices": {str(k): str(v) for k, v in item.slices.items()},
                }
                for index, item in enumerate(review_items)
            ],
        )
    return review_id


def plan(
    secret: str, reviewer: str, item_ids: Sequence[int], controls: int, gap: int
) -> list[tuple[int, bool, bool]]:
    """A reviewer's slots in order: ``(item id, control, candidate first)``.

    The items in an order of the reviewer's own, then ``controls`` of them repeated, each at
    least ``gap`` items after its first showing, with a fresh coin for the answers' order.
    """
    digest = hmac.new(secret.encode(), reviewer.encode(), hashlib.sha256).digest()
    rng = random.Random(int.from_bytes(digest, "big"))
    order = list(item_ids)
    rng.shuffle(order)
    first = [(item, False, rng.random() < 0.5) for item in order]
    eligible = max(0, len(order) - gap)  # a repeat of position i goes after i + gap
    repeats: dict[int, list[tuple[int, bool, bool]]] = {}
    for i in sorted(rng.sample(range(eligible), min(controls, eligible))):
        after = rng.randint(i + gap, len(order) - 1)
        repeats.setdefault(after, []).append((order[i], True, rng.random() < 0.5))
    slots_in_order: list[tuple[int, bool, bool]] = []
    for position, slot in enumerate(first):
        slots_in_order.append(slot)
        slots_in_order.extend(repeats.get(position, []))
    return slots_in_order


def create_invite(
    store: ReviewStore, name: str, *, review: str | None = None, base_url: str | None = None
) -> Invite:
    """Invite ``name`` to a review (the newest by default): the link with their token.

    Inviting a reviewer again gives a new link; the old one stops working, their votes stay.
    A revoked reviewer is not invited again under the same name.
    """
    if not name.strip() or len(name) > 200:
        raise ReviewError("a reviewer's name is 1 to 200 characters")
    token = secrets.token_urlsafe(32)
    with store.engine.begin() as conn:
        row = _review_row(conn, review)
        found = conn.execute(
            sa.select(reviewers).where(reviewers.c.review_id == row.id, reviewers.c.name == name)
        ).first()
        if found is not None and found.revoked_at is not None:
            raise ReviewError(f"{name!r} was revoked from review {row.name!r}; invite another name")
        if found is not None:
            conn.execute(
                reviewers.update()
                .where(reviewers.c.id == found.id)
                .values(token_sha256=sha256(token), invited_at=now())
            )
        else:
            added = conn.execute(
                reviewers.insert().values(
                    review_id=row.id, name=name, token_sha256=sha256(token), invited_at=now()
                )
            )
            reviewer_id = _inserted_id(added)
            item_ids = list(
                conn.scalars(
                    sa.select(items.c.id).where(items.c.review_id == row.id).order_by(items.c.id)
                )
            )
            steps = plan(row.secret, name, item_ids, row.controls, row.control_gap)
            conn.execute(
                slots.insert(),
                [
                    {
                        "reviewer_id": reviewer_id,
                        "position": position,
                        "item_id": item_id,
                        "key": secrets.token_hex(16),
                        "control": control,
                        "candidate_first": candidate_first,
                    }
                    for position, (item_id, control, candidate_first) in enumerate(steps)
                ],
            )
    return Invite(name, f"{(base_url or DEFAULT_BASE_URL).rstrip('/')}/r/{token}", token)


def revoke(store: ReviewStore, name: str, *, review: str | None = None) -> int:
    """Refuse ``name``'s future votes; their past votes stay, marked. How many were marked."""
    with store.engine.begin() as conn:
        row = _review_row(conn, review)
        found = conn.execute(
            sa.select(reviewers).where(reviewers.c.review_id == row.id, reviewers.c.name == name)
        ).first()
        if found is None:
            raise ReviewError(f"no reviewer {name!r} in review {row.name!r}")
        conn.execute(reviewers.update().where(reviewers.c.id == found.id).values(revoked_at=now()))
        marked = conn.execute(
            votes.update().where(votes.c.reviewer_id == found.id).values(reviewer_revoked=True)
        )
    return int(marked.rowcount)


def reviewer_of(store: ReviewStore, token: str | None) -> Reviewer:
    """The reviewer whose token this is; ``Refused(401)`` for none or an unknown one."""
    if not token or len(token) > 200:
        raise Refused(401, "open the page through your invitation link")
    with store.engine.connect() as conn:
        row = conn.execute(
            sa.select(reviewers).where(reviewers.c.token_sha256 == sha256(token))
        ).first()
    if row is None:
        raise Refused(401, "this invitation is not known (or was replaced by a newer link)")
    return Reviewer(row.id, row.review_id, row.name, row.revoked_at is not None)


def progress(store: ReviewStore, reviewer: Reviewer) -> tuple[int, int]:
    """(votes given, slots in the plan) for ``reviewer``."""
    with store.engine.connect() as conn:
        total = conn.scalar(
            sa.select(sa.func.count()).select_from(slots).where(slots.c.reviewer_id == reviewer.id)
        )
        done = conn.scalar(
            sa.select(sa.func.count()).select_from(votes).where(votes.c.reviewer_id == reviewer.id)
        )
    return int(done or 0), int(total or 0)


def next_page(store: ReviewStore, reviewer: Reviewer) -> Page | None:
    """The reviewer's next unvoted slot with a fresh one-time nonce; None when all are voted."""
    if reviewer.revoked:
        raise Refused(403, "your invitation was revoked; no further votes are taken")
    nonce = secrets.token_urlsafe(24)
    with store.engine.begin() as conn:
        voted = sa.select(votes.c.slot_id).where(votes.c.reviewer_id == reviewer.id)
        row = conn.execute(
            sa.select(
                slots.c.id,
                slots.c.key,
                slots.c.candidate_first,
                items.c.question,
                items.c.champion_answer,
                items.c.candidate_answer,
                items.c.slices,
            )
            .join(items, items.c.id == slots.c.item_id)
            .where(slots.c.reviewer_id == reviewer.id, slots.c.id.not_in(voted))
            .order_by(slots.c.position)
            .limit(1)
        ).first()
        if row is None:
            return None
        conn.execute(
            pages.insert().values(nonce_sha256=sha256(nonce), slot_id=row.id, issued_at=now())
        )
        total = conn.scalar(
            sa.select(sa.func.count()).select_from(slots).where(slots.c.reviewer_id == reviewer.id)
        )
        done = conn.scalar(
            sa.select(sa.func.count()).select_from(votes).where(votes.c.reviewer_id == reviewer.id)
        )
    first, second = row.candidate_answer, row.champion_answer
    if not row.candidate_first:
        first, second = second, first
    return Page(
        key=row.key,
        nonce=nonce,
        question=row.question,
        answer_a=first,
        answer_b=second,
        language=row.slices.get("language"),
        number=int(done or 0) + 1,
        total=int(total or 0),
    )


def record_vote(
    store: ReviewStore, reviewer: Reviewer, key: str, nonce: str, choice: str, comment: str
) -> str:
    """Write one vote in one transaction: its preference (``PREFERENCES``), or ``Refused``."""
    if choice not in CHOICES:
        raise Refused(400, f"choice must be one of {', '.join(CHOICES)}")
    with store.engine.begin() as conn:
        # Read again inside the transaction: a revoke between the page and the vote wins.
        revoked_at = conn.scalar(
            sa.select(reviewers.c.revoked_at).where(reviewers.c.id == reviewer.id)
        )
        if revoked_at is not None:
            raise Refused(403, "your invitation was revoked; no further votes are taken")
        slot = conn.execute(sa.select(slots).where(slots.c.key == key)).first()
        if slot is None or slot.reviewer_id != reviewer.id:
            raise Refused(403, "this item is not one of yours")
        page = conn.execute(sa.select(pages).where(pages.c.nonce_sha256 == sha256(nonce))).first()
        if page is None or page.slot_id != slot.id:
            raise Refused(403, "this item was not shown to you with this form")
        if page.used_at is not None:
            raise Refused(409, "this form was already sent; reload the page for the next item")
        if conn.execute(sa.select(votes.c.id).where(votes.c.slot_id == slot.id)).first():
            raise Refused(409, "you already voted on this item")
        used = conn.execute(
            pages.update()
            .where(pages.c.nonce_sha256 == page.nonce_sha256, pages.c.used_at.is_(None))
            .values(used_at=now())
        )
        if used.rowcount != 1:  # another request used it between our read and this write
            raise Refused(409, "this form was already sent; reload the page for the next item")
        preference = choice
        if choice in ("a", "b"):
            a_is_candidate = slot.candidate_first
            preference = "candidate" if (choice == "a") == a_is_candidate else "champion"
        try:
            conn.execute(
                votes.insert().values(
                    slot_id=slot.id,
                    reviewer_id=reviewer.id,
                    item_id=slot.item_id,
                    choice=choice,
                    preference=preference,
                    comment=comment,
                    voted_at=now(),
                    reviewer_revoked=False,
                )
            )
        except sa.exc.IntegrityError:  # a concurrent vote on the same slot won
            raise Refused(409, "you already voted on this item") from None
    return preference


def review_info(store: ReviewStore, review: str | None = None) -> dict[str, Any]:
    """The review's name, models, counts (for the results and the command line)."""
    with store.engine.connect() as conn:
        row = _review_row(conn, review)
        n_items = conn.scalar(
            sa.select(sa.func.count()).select_from(items).where(items.c.review_id == row.id)
        )
        names = list(
            conn.execute(
                sa.select(reviewers.c.name, reviewers.c.revoked_at)
                .where(reviewers.c.review_id == row.id)
                .order_by(reviewers.c.id)
            )
        )
    return {
        "id": row.id,
        "name": row.name,
        "champion": row.champion,
        "candidate": row.candidate,
        "items": int(n_items or 0),
        "reviewers": {name: revoked is not None for name, revoked in names},
    }


def vote_rows(store: ReviewStore, review: str | None = None) -> list[VoteRow]:
    """Every vote of a review, with its item's slices, in the order they were cast."""
    with store.engine.connect() as conn:
        row = _review_row(conn, review)
        found = conn.execute(
            sa.select(
                reviewers.c.name,
                votes.c.item_id,
                slots.c.control,
                votes.c.preference,
                items.c.slices,
                votes.c.reviewer_revoked,
                votes.c.comment,
            )
            .join(slots, slots.c.id == votes.c.slot_id)
            .join(reviewers, reviewers.c.id == votes.c.reviewer_id)
            .join(items, items.c.id == votes.c.item_id)
            .where(items.c.review_id == row.id)
            .order_by(votes.c.id)
        )
        return [
            VoteRow(name, item, bool(control), preference, dict(slices), bool(revoked), comment)
            for name, item, control, preference, slices, revoked, comment in found
        ]
