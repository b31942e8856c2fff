"""Which arm and model version served a flagged response: signed request ids, once each.

The router gives every proxied request an ``X-Request-Id`` that carries, signed
with HMAC-SHA256 under a secret only the routers hold, the arm and model version
that served it, when, and a keyed hash of the user. A feedback flag is charged
to an arm only through such an id:

- a forged or altered id fails the signature and attributes nothing, so a client
  cannot charge badcases to the other arm (bucket hashes are public, and
  ``X-User-Id`` and ids used to come from the client);
- an id flagged a second time attributes nothing (``SeenKeys``), so one response
  cannot be counted twice;
- the id itself says what served it, so any replica sharing the secret, or the
  same router after a restart, attributes it without remembering the request.

The user inside is ``HMAC(secret, user)``, never the user id itself: request ids
end up in client logs and support tickets. It lets the canary analysis count
badcases per distinct user, so one user flagging many answers counts once.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass

PREFIX = "r1"
_SIGNATURE_BYTES = 16  # 128 bits of HMAC-SHA256: far beyond guessing, short in a header
_DOMAIN = b"tuneloop-request-id\x00"
_USER_DOMAIN = b"tuneloop-user\x00"
# A header value this long is no id of ours; refuse before decoding anything.
MAX_ID_CHARS = 512


@dataclass(frozen=True)
class Attribution:
    """What a valid request id says: who served it, when, and to whom (a keyed hash)."""

    nonce: str
    issued_at: int
    arm: str
    model_version: str
    user_key: str  # HMAC of the user id, or the nonce for an anonymous request


def _mac(key: bytes, domain: bytes, data: bytes) -> bytes:
    # A domain prefix per use, so a user hash can never pass as a request-id signature.
    return hmac.digest(key, domain + data, "sha256")


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class RequestIds:
    """Signs and checks request ids with one secret; without one, ids attribute nothing."""

    def __init__(self, secret: str | None, max_age_s: int) -> None:
        self._key = secret.encode("utf-8") if secret else None
        self.max_age_s = max_age_s

    @property
    def signing(self) -> bool:
        return self._key is not None

    def user_key(self, user: str | None) -> str | None:
        """The keyed hash a request id carries for ``user``: the same on every replica that
        shares the secret, and no user id in clear; None without a user or a secret."""
        if self._key is None or not user:
            return None
        return _mac(self._key, _USER_DOMAIN, user.encode("utf-8"))[:8].hex()

    def issue(self, arm: str, model_version: str, user: str | None) -> str:
        """A new request id for a request this router is about to serve."""
        nonce = secrets.token_hex(8)
        if self._key is None:
            return nonce  # not ours to vouch for: attributes nothing
        key = self._key
        user_key = self.user_key(user) or nonce
        # Fields joined by "|", the version last: it is the one field that may hold a "|".
        payload = f"{nonce}|{int(time.time())}|{arm}|{user_key}|{model_version}".encode()
        signature = _mac(key, _DOMAIN, payload)[:_SIGNATURE_BYTES]
        return f"{PREFIX}.{_b64(payload)}.{_b64(signature)}"

    def _signed(self, request_id: str) -> tuple[bytes | None, str]:
        """(the id's payload, "") when this key signed it, whatever its age; (None, why not)."""
        key = self._key
        if key is None:
            return None, "this router signs no request ids (its secret is not set)"
        parts = request_id.split(".")
        if len(request_id) > MAX_ID_CHARS or len(parts) != 3 or parts[0] != PREFIX:
            return None, "not a request id this router issued"
        try:
            payload, signature = _unb64(parts[1]), _unb64(parts[2])
        except (binascii.Error, ValueError):
            return None, "not a request id this router issued"
        expected = _mac(key, _DOMAIN, payload)[:_SIGNATURE_BYTES]
        if not hmac.compare_digest(signature, expected):
            return None, "request id signature does not match (forged or altered)"
        return payload, ""

    def signed(self, request_id: str) -> bool:
        """Whether this key signed ``request_id`` (another task's router asks: was it yours?)."""
        return self._signed(request_id)[0] is not None

    def verify(self, request_id: str, now: float | None = None) -> tuple[Attribution | None, str]:
        """(what the id attests, "") for a valid id; (None, why not) otherwise."""
        payload, why = self._signed(request_id)
        if payload is None:
            return None, why
        try:
            nonce, issued_at, arm, user_key, version = payload.decode().split("|", 4)
            attribution = Attribution(nonce, int(issued_at), arm, version, user_key)
        except ValueError:  # UnicodeDecodeError included
            # Signed by us yet unreadable: only a changed format could do that.
            return None, "request id payload unreadable"
        age = (time.time() if now is None else now) - attribution.issued_at
        if age > self.max_age_s:
            return None, f"request id is {age / 86400:.1f} days old (limit {self.max_age_s} s)"
        return attribution, ""


class SeenKeys:
    """A bounded set, oldest forgotten first: flagged request ids, users already counted."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, None] = OrderedDict()

    def add(self, key: str) -> bool:
        """Remember ``key``; True when it is new."""
        if key in self._items:
            self._items.move_to_end(key)
            return False
        self._items[key] = None
        if len(self._items) > self.capacity:
            self._items.popitem(last=False)
        return True

    def discard(self, key: str) -> None:
        self._items.pop(key, None)

    def __len__(self) -> int:
        return len(self._items)
