"""Request bodies under limits: size before reading, then JSON that cannot hurt the router.

Every endpoint that takes a body reads it through ``read_json``, in this order:

1. ``Content-Length`` over the limit: refused before a byte is read (413);
2. the body is read in chunks and refused as soon as it passes the limit, so a
   chunked upload without a length cannot grow past it either (413);
3. JSON parsing: invalid JSON or UTF-8 (400), nesting deeper than the limit
   (400; the stdlib parser would otherwise raise ``RecursionError`` at ~1,000
   levels, which becomes a 500), lone surrogates such as ``"\\ud800"`` (400;
   Python decodes them into strings that cannot be written as UTF-8, which
   again would be a 500 at the first write).

Each refusal is a ``Refused`` with the status and a reason a client can act on.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import ClientDisconnect, Request


class Refused(Exception):
    """A request turned away before it did anything; ``status`` and a reason for the client."""

    def __init__(
        self, status: int, reason: str, kind: str, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.kind = kind
        self.headers = headers or {}


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, or ``Refused(413)`` once it is known to be over ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            length = int(declared)
        except ValueError:
            raise Refused(400, "Content-Length is not a number", "bad_request") from None
        if length > limit:
            raise Refused(
                413, f"body of {length} bytes is over the {limit}-byte limit", "too_large"
            )
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise Refused(413, f"body is over the {limit}-byte limit", "too_large")
            chunks.append(chunk)
    except ClientDisconnect:
        raise Refused(400, "the client went away mid-body", "bad_request") from None
    return b"".join(chunks)


def parse_json(raw: bytes, max_depth: int) -> Any:
    """The decoded JSON value, or ``Refused(400)`` naming what is wrong with it."""
    if not raw.strip():
        raise Refused(400, "request body is empty; send a JSON object", "bad_json")
    try:
        # UTF-8 only (RFC 8259), where json.loads(bytes) would also guess UTF-16 and -32.
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise Refused(400, f"body is not valid UTF-8 (byte {error.start})", "bad_json") from None
    try:
        value = json.loads(text)
    except RecursionError:
        raise Refused(400, f"JSON nested too deep (limit {max_depth} levels)", "too_deep") from None
    except ValueError as error:  # json.JSONDecodeError
        raise Refused(400, f"body is not valid JSON: {error}", "bad_json") from None
    # The walk is needed only when the text could hold either problem: a lone surrogate
    # comes only from a \u escape (strict UTF-8 has none), and nesting deeper than
    # max_depth needs more than max_depth brackets. A chat request has neither.
    if "\\u" in text or text.count("[") + text.count("{") > max_depth:
        _check(value, max_depth)
    return value


def _check(value: Any, max_depth: int) -> None:
    """Nesting depth and lone surrogates, without recursion (the value may be deep)."""
    stack: list[tuple[Any, int, str]] = [(value, 1, "$")]
    while stack:
        item, depth, where = stack.pop()
        if isinstance(item, str):
            _check_text(item, where)
        elif isinstance(item, dict | list):
            if depth > max_depth:
                raise Refused(
                    400, f"JSON nested too deep at {where} (limit {max_depth} levels)", "too_deep"
                )
            if isinstance(item, dict):
                for key, child in item.items():
                    _check_text(key, f"{where} (a key)")
                    stack.append((child, depth + 1, f"{where}.{key[:40]}"))
            else:
                stack.extend((child, depth + 1, f"{where}[{i}]") for i, child in enumerate(item))


def _check_text(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise Refused(
            400,
            f"lone surrogate {text[error.start]!r} at {where}: not a character; "
            "send text as valid UTF-16 pairs or UTF-8",
            "bad_text",
        ) from None
