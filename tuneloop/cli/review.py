"""``tuneloop review create|serve|invite|revoke|results``: the blind review by people.

Every command works on the review store: ``--db`` (any SQLAlchemy URL), else
``TUNELOOP_REVIEW_DB``, else ``review.db`` in the working directory. Commands that take
``--review`` default to the newest review in the store.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tuneloop.review.store import ReviewStore


def _store(args: argparse.Namespace) -> ReviewStore:
    from tuneloop.review.store import ReviewStore

    return ReviewStore(args.db)


def _create(args: argparse.Namespace) -> int:
    from tuneloop.review.store import ReviewError, ReviewItem, create_review

    items = []
    path = Path(args.items)
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            items.append(ReviewItem.from_record(record))
        except (ValueError, KeyError, TypeError) as error:
            print(
                f"tuneloop review create: {path}:{number}: {error!r}; each line is a JSON "
                "object with question, champion_answer, candidate_answer (and slices, ref)",
                file=sys.stderr,
            )
            return 2
    # Only what was given: the defaults live in create_review.
    counts = {
        k: getattr(args, k) for k in ("controls", "control_gap") if getattr(args, k) is not None
    }
    try:
        create_review(
            _store(args),
            args.name,
            items,
            champion=args.champion,
            candidate=args.candidate,
            **counts,
        )
    except ReviewError as error:
        print(f"tuneloop review create: {error}", file=sys.stderr)
        return 1
    print(f"review {args.name}: {len(items)} items; invite reviewers with `tuneloop review invite`")
    return 0


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from tuneloop.review.store import DEFAULT_PORT
    from tuneloop.review.web import create_review_app

    store = _store(args)
    port = DEFAULT_PORT if args.port is None else args.port
    print(f"review page on http://{args.host}:{port}/ (store {store.engine.url!r})", flush=True)
    uvicorn.run(create_review_app(store), host=args.host, port=port, log_level="warning")
    return 0


def _invite(args: argparse.Namespace) -> int:
    from tuneloop.review.store import ReviewError, create_invite

    try:
        invite = create_invite(_store(args), args.name, review=args.review, base_url=args.base_url)
    except ReviewError as error:
        print(f"tuneloop review invite: {error}", file=sys.stderr)
        return 1
    print(invite.link)
    return 0


def _revoke(args: argparse.Namespace) -> int:
    from tuneloop.review.store import ReviewError, revoke

    try:
        marked = revoke(_store(args), args.name, review=args.review)
    except ReviewError as error:
        print(f"tuneloop review revoke: {error}", file=sys.stderr)
        return 1
    print(f"revoked {args.name}: no further votes; {marked} past votes kept, marked as revoked")
    return 0


def _results(args: argparse.Namespace) -> int:
    from tuneloop.review.store import ReviewError
    from tuneloop.review.tally import compute_results

    try:
        results = compute_results(
            _store(args),
            args.review,
            confidence=args.confidence,
            include_revoked=not args.exclude_revoked,
        )
    except ReviewError as error:
        print(f"tuneloop review results: {error}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(results.as_dict(), indent=2, ensure_ascii=False))
    else:
        print(results.table())
    return 0


def add_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    group = commands.add_parser(
        "review", help="blind review by people: serve the page, invite, revoke, results"
    )
    sub = group.add_subparsers(dest="review_command", required=True)

    create = sub.add_parser("create", help="store a review from a JSON-lines file of items")
    create.add_argument("name", help="the review's name (never shown to reviewers)")
    create.add_argument(
        "items",
        help="JSON lines: question, champion_answer, candidate_answer, slices {intent, "
        "language}, ref",
    )
    create.add_argument("--champion", required=True, help="the champion's name, e.g. its version")
    create.add_argument("--candidate", required=True, help="the candidate's name")
    create.add_argument("--controls", type=int, help="control repeats per reviewer (3)")
    create.add_argument(
        "--control-gap", type=int, help="other items at least between an item and its repeat (3)"
    )
    create.set_defaults(run=_create)

    serve = sub.add_parser("serve", help="serve the review page (every review in the store)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, help="port to listen on (8765)")
    serve.set_defaults(run=_serve)

    invite = sub.add_parser("invite", help="invite a reviewer: prints their link")
    invite.add_argument("name", help="the reviewer's name; again: a new link, the old one dies")
    invite.add_argument(
        "--base-url",
        default=None,
        help="where reviewers reach `tuneloop review serve` (default: its own default address)",
    )
    invite.set_defaults(run=_invite)

    revoke = sub.add_parser("revoke", help="refuse a reviewer's future votes (past ones stay)")
    revoke.add_argument("name", help="the reviewer's name")
    revoke.set_defaults(run=_revoke)

    results = sub.add_parser("results", help="win, tie and loss rates, agreement, consistency")
    results.add_argument("--json", action="store_true", help="the results as JSON")
    results.add_argument("--confidence", type=float, default=0.95, help="of the intervals")
    results.add_argument(
        "--exclude-revoked", action="store_true", help="leave out revoked reviewers' votes"
    )
    results.set_defaults(run=_results)

    for command in (create, serve, invite, revoke, results):
        command.add_argument(
            "--db",
            default=None,
            help="review store URL (default: $TUNELOOP_REVIEW_DB or review.db)",
        )
    for command in (invite, revoke, results):
        command.add_argument("--review", default=None, help="the review's name (default: newest)")
