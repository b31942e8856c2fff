"""The router's limits: bodies capped before reading, JSON that cannot hurt it, flag rates.

Every endpoint that takes a body reads it through ``read_object`` (or ``read_model``,
which also validates it), in this order:

1. ``Content-Length`` over the limit: refused before a byte is read (413);
2. the body is read in chunks and refused as soon as it passes the limit, so a
   chunked upload without a length cannot grow past it either (413);
3. JSON parsing: invalid JSON or UTF-8 (400), nesting deeper than the limit
   (400; the stdlib parser would otherwise raise ``RecursionError`` at ~1,000
   levels, which becomes a 500), lone surrogates such as ``"\\ud800"`` (400;
   Python decodes them into strings that cannot be written as UTF-8, which
   again would be a 500 at the first write);
4. not a JSON object, or (``read_model``) not of the endpoint's shape (400).

A feedback producer's flags are limited in rate by its ``TokenBucket`` (429).

Each refusal is a ``Refused`` with the status and a reason a client can act on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request

from serving.config import FeedbackProducer

Body = TypeVar("Body", bound=BaseModel)


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


async def read_object(request: Request, limit: int, max_depth: int) -> dict[str, Any]:
    """The body as a JSON object, or ``Refused`` (413, 400) saying why not."""
    data = parse_json(await read_body(request, limit), max_depth)
    if not isinstance(data, dict):
        raise Refused(400, "request body must be a JSON object", "bad_json")
    return data


async def read_model(request: Request, model: type[Body], limit: int, max_depth: int) -> Body:
    """The body validated as ``model``; ``Refused(400)`` names each field that is wrong."""
    data = await read_object(request, limit, max_depth)
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise Refused(400, _validation_reason(error), "invalid_body") from None


def _validation_reason(error: ValidationError) -> str:
    # Without the input: it may be large, and it is the client's own anyway.
    return "; ".join(
        f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}"
        for e in error.errors(include_input=False, include_url=False)
    )


@dataclass
class TokenBucket:
    """A producer's rate limit: ``burst`` flags at once, refilled at ``rate_per_minute``."""

    producer: FeedbackProducer
    tokens: float
    at: float

    @classmethod
    def full(cls, producer: FeedbackProducer, now: float) -> TokenBucket:
        return cls(producer, float(producer.burst), now)

    def take(self, now: float) -> float:
        """0 when a flag may go now (and spend it); else the seconds until one may."""
        per_second = self.producer.rate_per_minute / 60
        self.tokens = min(self.producer.burst, self.tokens + (now - self.at) * per_second)
        self.at = now
        if self.tokens >= 1:
            self.tokens -= 1
            return 0.0
        return (1 - self.tokens) / per_second

    def spend(self, now: float) -> None:
        """Take a flag's token, or ``Refused(429)`` with when to retry."""
        wait = self.take(now)
        if wait > 0:
            spec = self.producer
            raise Refused(
                429,
                f"producer {spec.name!r} is over its rate limit ({spec.rate_per_minute:g} flags "
                f"a minute, bursts of {spec.burst}); retry in {wait:.1f} s",
                "rate_limited",
                headers={"Retry-After": str(max(1, round(wait + 0.5)))},
            )
