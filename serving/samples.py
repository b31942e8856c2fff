"""The router's record of each finished request, read by the release's analysis with a cursor.

The cumulative counters and windowed percentiles in ``serving.metrics`` answer
"how is each arm doing lately"; a canary analysis needs something else: the
figures of exactly the requests of its interval, raw, so that it can test the
two arms against each other (``tuneloop.release.analysis``). Here every finished
proxied request becomes a ``Sample`` (arm, latency, time to first token, error
kind, whether a counted badcase flag names it) with a sequence number, kept in
a ring of the last ``sample_memory`` ones. ``GET /admin/samples?since=N`` pages
through the samples after ``N``; the analysis keeps its cursor between reads, so
neither side ever holds more than one ring, however long a release runs.

A flag arrives after its request: a sample stays findable by its request id
while it is in the ring, and a flag marks it ``badcase`` when the router counts
it (attributed, the arm's current version). Each sample carries its user's keyed
hash, so the analysis counts flagged *users* among the users of its interval. An
analysis that read a sample before the flag came does not see it; the
cumulative counters and the badcase files still do.

``Shadow pairs`` are the same idea for the shadow step: the champion's answer
to a mirrored request beside the challenger's answer to the same request.
"""

from __future__ import annotations

import json
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

# The most items one page of /admin/samples or /admin/shadow returns.
MAX_PAGE = 10_000


class Numbered(Protocol):
    seq: int

    def as_json(self) -> dict[str, Any]: ...


@dataclass(slots=True)
class Sample:
    """One proxied request, from the router's side. Times in seconds; None: not measured."""

    arm: str
    seq: int = 0
    latency_s: float | None = None
    ttft_s: float | None = None
    error: str | None = None  # an ErrorKind of serving.metrics, or None for a good answer
    badcase: bool = False
    user: str | None = None  # the user's keyed hash (as in request ids); None: anonymous

    def as_json(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "arm": self.arm,
            "latency_ms": _ms(self.latency_s),
            "ttft_ms": _ms(self.ttft_s),
            "error": self.error,
            "badcase": self.badcase,
            "user": self.user,
        }


@dataclass(slots=True)
class Answer:
    """One arm's answer to a mirrored request: its text (capped), time, and error if any."""

    text: str | None = None
    latency_s: float | None = None
    error: str | None = None
    status: int | None = None

    def as_json(self) -> dict[str, Any]:
        return {
            "text": self.text,
            "latency_ms": _ms(self.latency_s),
            "error": self.error,
            "status": self.status,
        }


@dataclass(slots=True)
class ShadowPair:
    """The champion's answer (what the user got) and the challenger's (seen by nobody)."""

    prompt: str
    champion: Answer = field(default_factory=Answer)
    challenger: Answer = field(default_factory=Answer)
    seq: int = 0
    pending: int = 2  # answers still to come; the pair is published when both are in

    def as_json(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "prompt": self.prompt,
            "champion": self.champion.as_json(),
            "challenger": self.challenger.as_json(),
        }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


Item = TypeVar("Item", bound=Numbered)


class Ring(Generic[Item]):
    """The last ``size`` finished items, numbered from 1, read by cursor.

    ``boot`` changes with every router process: a reader that sees a new one
    knows the numbering started again and reads from 0.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.boot = uuid.uuid4().hex
        self._items: deque[Item] = deque(maxlen=size)
        self._next = 1

    def append(self, item: Item) -> None:
        item.seq = self._next
        self._next += 1
        self._items.append(item)

    @property
    def last(self) -> int:
        return self._next - 1

    def read(self, since: int, limit: int) -> dict[str, Any]:
        """Items numbered above ``since``, oldest first, at most ``limit``.

        ``dropped``: items after ``since`` already pushed out of the ring (the
        reader came too late for them); ``next``: the cursor for the next read.
        """
        since = max(0, min(since, self.last))
        oldest = self._items[0].seq if self._items else self._next
        dropped = max(0, oldest - since - 1)
        start = max(0, since + 1 - oldest)
        page = [self._items[i] for i in range(start, min(len(self._items), start + limit))]
        return {
            "boot": self.boot,
            "last": self.last,
            "next": page[-1].seq if page else max(since, oldest - 1),
            "dropped": dropped,
            "items": [item.as_json() for item in page],
        }


class SampleLog:
    """Open samples by request id (so a later flag finds them), finished ones in a ring."""

    def __init__(self, size: int) -> None:
        self.ring: Ring[Sample] = Ring(size)
        self._by_id: OrderedDict[str, Sample] = OrderedDict()
        self._size = size

    def open(self, request_id: str, arm: str, user: str | None = None) -> Sample:
        sample = Sample(arm, user=user)
        self._by_id[request_id] = sample
        if len(self._by_id) > self._size:
            self._by_id.popitem(last=False)
        return sample

    def close(self, sample: Sample) -> None:
        self.ring.append(sample)

    def flag(self, request_id: str) -> bool:
        """Mark the request's sample a counted badcase; False when it is no longer held."""
        sample = self._by_id.get(request_id)
        if sample is None:
            return False
        sample.badcase = True
        return True


def completion_text(payload: bytes) -> str | None:
    """The answer of a non-streamed chat or text completion body; None if it holds none."""
    try:
        body = json.loads(payload)
        choice = body["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
    except (ValueError, KeyError, IndexError, TypeError):
        return None
    return text if isinstance(text, str) else None


def stream_text(payload: bytes) -> str | None:
    """The answer assembled from a streamed (SSE) completion; None if no chunk held text."""
    parts: list[str] = []
    for line in payload.decode("utf-8", errors="replace").splitlines():
        data = line.removeprefix("data:").strip() if line.startswith("data:") else ""
        if not data or data == "[DONE]":
            continue
        try:
            choice = json.loads(data)["choices"][0]
            piece = choice["delta"].get("content") if "delta" in choice else choice.get("text")
        except (ValueError, KeyError, IndexError, TypeError, AttributeError):
            continue
        if isinstance(piece, str):
            parts.append(piece)
    return "".join(parts) if parts else None


def holds_token(payload: bytes) -> bool:
    """Whether a streamed (SSE) completion's complete events so far carry a generated token.

    A chat chunk that only opens the assistant's turn (vLLM sends ``{"role": "assistant",
    "content": ""}`` before any token) does not; a later delta does, even one whose token
    decodes to no text yet. A completion's chunk holds its ``text``.
    """
    for line in payload.decode("utf-8", errors="replace").splitlines():
        data = line.removeprefix("data:").strip() if line.startswith("data:") else ""
        if not data or data == "[DONE]":
            continue
        try:
            choice = json.loads(data)["choices"][0]
            if "delta" not in choice:
                return "text" in choice
            delta = choice["delta"]
            if delta.get("content") or ("content" in delta and "role" not in delta):
                return True
        except (ValueError, KeyError, IndexError, TypeError, AttributeError):
            continue
    return False


def prompt_text(body: dict[str, Any]) -> str:
    """The last user turn of a chat request, or a completion's prompt (what a suite asks)."""
    messages = body.get("messages")
    if isinstance(messages, list):
        for message in reversed(messages):
            if isinstance(message, dict) and message.get("role") == "user":
                content = message.get("content")
                return content if isinstance(content, str) else json.dumps(content)[:4096]
        return ""
    prompt = body.get("prompt")
    return prompt if isinstance(prompt, str) else ""
