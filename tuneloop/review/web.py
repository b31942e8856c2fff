"""The review page's web app (FastAPI, server-rendered HTML, no JavaScript build).

=========================  ==========================================================
``GET /r/{token}``         an invitation link: keeps the token in a cookie, then the page
``GET /review``            the reviewer's next item (or "all done"), with a one-time form
``GET /review/next.json``  the same item as JSON, for a scripted panel (the demo's)
``POST /review/vote``      one vote (form fields ``item``, ``nonce``, ``choice``, ``comment``)
=========================  ==========================================================

The token travels in an HttpOnly cookie (SameSite=Lax) after the first visit, so it leaves
the address bar and the history at once. A vote's body is capped before it is read: a
declared ``Content-Length`` over the limit is refused before any byte, a body without one is
cut off as it passes the limit (413). A vote answers 303 to ``/review`` (the next item), or
with ``Accept: application/json`` a JSON object; a refusal answers its status with the
reason, in HTML or JSON likewise.
"""

from __future__ import annotations

import logging
import secrets
from typing import Any
from urllib.parse import parse_qs

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, RedirectResponse
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from tuneloop.review import page as pages
from tuneloop.review.store import (
    Refused,
    ReviewStore,
    next_page,
    progress,
    record_vote,
    reviewer_of,
)

log = logging.getLogger(__name__)

COOKIE = "tuneloop_review"
MAX_COMMENT = 2_000  # characters
# Bytes of a vote's form. A character is up to 4 bytes of UTF-8 and each byte 3 once
# percent-encoded: a comment of MAX_COMMENT characters in any script fits, with the fields.
MAX_BODY = 12 * MAX_COMMENT + 1_024
FIELDS = ("item", "nonce", "choice", "comment")

SECURITY_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
    "X-Frame-Options": "DENY",
}


def csp(script_nonce: str | None) -> str:
    script = f"'nonce-{script_nonce}'" if script_nonce else "'none'"
    return (
        f"default-src 'none'; style-src 'unsafe-inline'; script-src {script}; "
        "form-action 'self'; base-uri 'none'; frame-ancestors 'none'"
    )


def wants_json(request: Request) -> bool:
    return "application/json" in request.headers.get("accept", "")


def html_response(text: str, status: int = 200, script_nonce: str | None = None) -> HTMLResponse:
    headers = {**SECURITY_HEADERS, "Content-Security-Policy": csp(script_nonce)}
    return HTMLResponse(text, status_code=status, headers=headers)


def refusal(request: Request, error: Refused) -> Response:
    if wants_json(request):
        return JSONResponse(
            {"error": error.reason}, status_code=error.status, headers=SECURITY_HEADERS
        )
    return html_response(pages.message_page(error.status, error.reason), error.status)


async def read_form(request: Request, limit: int) -> dict[str, str]:
    """The vote's form fields, the body read only up to ``limit`` bytes (``Refused`` if more)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise Refused(400, "Content-Length is not a number")
        if int(declared) > limit:
            raise Refused(413, f"the form is over the {limit}-byte limit; shorten the comment")
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/x-www-form-urlencoded":
        raise Refused(415, "send the vote as a form (application/x-www-form-urlencoded)")
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise Refused(413, f"the form is over the {limit}-byte limit; shorten the comment")
            chunks.append(chunk)
    except ClientDisconnect:
        raise Refused(400, "the browser went away mid-form") from None
    try:
        text = b"".join(chunks).decode("utf-8")
        fields = parse_qs(text, keep_blank_values=True, max_num_fields=len(FIELDS) + 1)
    except (UnicodeDecodeError, ValueError):
        raise Refused(400, "the form is not valid UTF-8 form data") from None
    unknown = sorted(set(fields) - set(FIELDS))
    if unknown:
        raise Refused(400, f"unknown form fields: {', '.join(f[:40] for f in unknown)}")
    if any(len(values) != 1 for values in fields.values()):
        raise Refused(400, "each form field once")
    form = {name: values[0] for name, values in fields.items()}
    missing = [name for name in ("item", "nonce", "choice") if not form.get(name)]
    if missing:
        raise Refused(400, f"the form lacks {', '.join(missing)}")
    return form


def create_review_app(
    store: ReviewStore, *, max_body: int = MAX_BODY, max_comment: int = MAX_COMMENT
) -> FastAPI:
    """The review page over ``store``: every review's reviewers, told apart by their token."""
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None, title="Blind review")

    @app.exception_handler(Refused)
    async def refused(request: Request, error: Refused) -> Response:
        return refusal(request, error)

    @app.get("/healthz", response_class=PlainTextResponse)
    async def healthz() -> str:
        return "ok"

    @app.get("/")
    async def home() -> Response:
        return html_response(pages.message_page(200, "Open the page through your invitation link."))

    @app.get("/r/{token}")
    async def invitation(token: str, request: Request) -> Response:
        await run_in_threadpool(reviewer_of, store, token)
        response = RedirectResponse("/review", status_code=303, headers=SECURITY_HEADERS)
        response.set_cookie(
            COOKIE,
            token,
            httponly=True,
            samesite="lax",
            secure=request.url.scheme == "https",
            max_age=90 * 24 * 3600,
        )
        return response

    def next_for(token: str | None) -> tuple[Any, tuple[int, int]]:
        reviewer = reviewer_of(store, token)
        found = next_page(store, reviewer)
        return found, progress(store, reviewer)

    @app.get("/review")
    async def review(request: Request) -> Response:
        found, (done, total) = await run_in_threadpool(next_for, request.cookies.get(COOKIE))
        if found is None:
            return html_response(pages.done_page(done, total))
        script_nonce = secrets.token_urlsafe(16)
        return html_response(pages.item_page(found, script_nonce, max_comment), 200, script_nonce)

    @app.get("/review/next.json")
    async def review_json(request: Request) -> Response:
        found, (done, total) = await run_in_threadpool(next_for, request.cookies.get(COOKIE))
        body: dict[str, Any] = {"done": found is None, "voted": done, "total": total}
        if found is not None:
            body |= {
                "item": found.key,
                "nonce": found.nonce,
                "number": found.number,
                "question": found.question,
                "answer_a": found.answer_a,
                "answer_b": found.answer_b,
                "language": found.language,
            }
        return JSONResponse(body, headers=SECURITY_HEADERS)

    @app.post("/review/vote")
    async def vote(request: Request) -> Response:
        reviewer = await run_in_threadpool(reviewer_of, store, request.cookies.get(COOKIE))
        form = await read_form(request, max_body)
        comment = form.get("comment", "")
        if len(comment) > max_comment:
            raise Refused(413, f"the comment is over {max_comment} characters; shorten it")
        if "\x00" in comment:  # PostgreSQL's text cannot hold it: refused, not a 500
            raise Refused(400, "the comment holds a NUL character; remove it")
        await run_in_threadpool(
            record_vote, store, reviewer, form["item"], form["nonce"], form["choice"], comment
        )
        log.info("review vote by %s", reviewer.name)
        if wants_json(request):
            done, total = await run_in_threadpool(progress, store, reviewer)
            return JSONResponse(
                {"recorded": True, "voted": done, "total": total}, headers=SECURITY_HEADERS
            )
        return RedirectResponse("/review", status_code=303, headers=SECURITY_HEADERS)

    return app
