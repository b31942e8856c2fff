"""Who may call what: the admin token, and each feedback producer's own token.

Tokens are read from their environment variables on every request: a token is
rotated by restarting with a new value, and an unset or empty variable must lock
what it opens, never open it. Comparisons are constant-time.
"""

from __future__ import annotations

import hmac
import os
from typing import Annotated

from fastapi import Depends, Header

from serving.config import RouterConfig
from serving.limits import Refused
from serving.router_state import Live


def _bearer(authorization: str | None) -> bytes | None:
    """The token of an ``Authorization: Bearer <token>`` header; None for any other."""
    scheme, _, given = (authorization or "").partition(" ")
    return given.strip().encode() if scheme.lower() == "bearer" else None


def _matches(token: bytes, env: str) -> bool:
    expected = os.environ.get(env, "")
    return bool(expected) and hmac.compare_digest(token, expected.encode())


async def require_admin(state: Live, authorization: Annotated[str | None, Header()] = None) -> None:
    """``Refused(401)`` unless the request carries the admin token."""
    check_admin(state.config.admin_token_env, authorization)


def check_admin(env: str, authorization: str | None) -> None:
    """``Refused(401)`` unless ``authorization`` bears the token in ``$env``."""
    token = _bearer(authorization)
    if token is None or not _matches(token, env):
        raise Refused(
            401,
            f"admin endpoints need 'Authorization: Bearer <${env}>'",
            "unauthorized",
            headers={"WWW-Authenticate": "Bearer"},
        )


def producer_of(config: RouterConfig, authorization: str | None) -> str:
    """The feedback producer a bearer token belongs to; ``Refused(401)`` for any other."""
    token = _bearer(authorization)
    found = None
    if token:
        for producer in config.feedback_producers:
            if _matches(token, producer.token_env):
                found = producer.name
        if _matches(token, config.admin_token_env):
            found = None  # the admin token is not a feedback credential, even if reused
    if found is None:
        raise Refused(
            401,
            "feedback needs 'Authorization: Bearer <producer token>' of a producer in the "
            "router config's feedback_producers",
            "unauthorized",
            headers={"WWW-Authenticate": "Bearer"},
        )
    return found


async def feedback_producer(
    state: Live, authorization: Annotated[str | None, Header()] = None
) -> str:
    """The producer whose token this request carries (``Refused(401)`` without one)."""
    return producer_of(state.config, authorization)


# Parameters of the endpoints: ``dependencies=ADMIN``, ``producer: Producer``.
ADMIN = [Depends(require_admin)]
Producer = Annotated[str, Depends(feedback_producer)]
