"""Badcase feedback: what ``/v1/feedback`` accepts and the JSON line it appends.

Each accepted flag becomes one line of ``<feedback_dir>/router-feedback-YYYY-MM-DD.jsonl``
(UTC date), shaped as tuneloop's badcase record so next month's ingest stage
reads it like any other badcase export. On the way:

- sizes are checked against the router's ``limits`` (each text, the number of
  turns and tags, and the finished line against ``limits.line_bytes``), so the
  router never writes a line that ingest would quarantine as ``line_too_long``;
- every stored text (turns, responses, tags) goes through ingest's own PII
  scrubber (``tuneloop.data.pii``), so raw personal data never reaches the disk;
- the producer that sent it is recorded as the tag ``tuneloop.feedback.source=<name>``;
- the record is checked with ingest's own ``parse_record`` before it is written,
  so a flag that ingest would quarantine (wrong turn order, empty text) is
  refused at once, with the reason, while the tool that sent it can still fix it.

Files are created ``0640`` (group-readable for the ingest job, nobody else).
"""

from __future__ import annotations

import fcntl
import json
import os
import stat
import threading
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from serving.config import Limits
from serving.limits import Refused
from tuneloop.data import pii
from tuneloop.data.records import parse_record

SOURCE = "router-feedback"
# Tag on a badcase no valid, first-time request id attributes to an arm: kept,
# since the conversation is still training data, but marked so nobody charges it
# to a model.
UNATTRIBUTED = "unattributed"
# Tags under this prefix are the router's own; a producer may not send them.
TAG_PREFIX = "tuneloop."
SOURCE_TAG = "tuneloop.feedback.source"
FILE_MODE = 0o640


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    role: Literal["system", "user", "assistant"]
    content: str = Field(min_length=1)


class FeedbackRequest(BaseModel):
    """A response flagged as bad by a user or a support tool."""

    # Strict: a number is not text and a string is not a list; no silent coercion.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    messages: list[ChatMessage] = Field(min_length=1, description="the conversation before it")
    bad_response: str = Field(min_length=1)
    corrected_response: str | None = Field(default=None, min_length=1)
    request_id: str | None = Field(
        default=None, min_length=1, description="the router's X-Request-Id of the response"
    )
    tags: list[str] = Field(default_factory=list)


def check_sizes(flag: FeedbackRequest, limits: Limits) -> None:
    """``Refused(413)`` naming the first field over its limit."""
    if len(flag.messages) > limits.messages:
        raise Refused(
            413, f"{len(flag.messages)} messages; at most {limits.messages}", "too_many_messages"
        )
    texts: list[tuple[str, str | None]] = [
        (f"messages[{i}].content", m.content) for i, m in enumerate(flag.messages)
    ]
    texts += [("bad_response", flag.bad_response), ("corrected_response", flag.corrected_response)]
    for where, text in texts:
        if text is not None and len(text) > limits.text_chars:
            raise Refused(
                413, f"{where} is {len(text)} characters; at most {limits.text_chars}", "too_long"
            )
    if len(flag.tags) > limits.tags:
        raise Refused(413, f"{len(flag.tags)} tags; at most {limits.tags}", "too_many_tags")
    for i, tag in enumerate(flag.tags):
        if len(tag) > limits.tag_chars:
            raise Refused(
                413, f"tags[{i}] is {len(tag)} characters; at most {limits.tag_chars}", "too_long"
            )
        if tag.startswith(TAG_PREFIX):
            raise Refused(400, f"tags[{i}]: tags starting {TAG_PREFIX!r} are the router's", "tag")


def badcase_record(
    request: FeedbackRequest,
    producer: str,
    arm: str | None,
    model_version: str | None,
    created_at: datetime,
) -> tuple[dict[str, object], Counter[str]]:
    """The scrubbed badcase line for a flag, and the PII hits per type it removed.

    Raises ``tuneloop.data.records.InvalidRecord`` if ingest would quarantine the line.
    """
    found: Counter[str] = Counter()

    def clean(text: str) -> str:
        scrubbed, counts = pii.scrub(text)
        found.update(counts)
        return scrubbed

    tags = [clean(tag) for tag in request.tags]
    tags.append(f"{SOURCE_TAG}={producer}")
    if arm is None:
        tags.append(UNATTRIBUTED)
    corrected = request.corrected_response
    record: dict[str, object] = {
        "messages": [{"role": m.role, "content": clean(m.content)} for m in request.messages],
        "bad_response": clean(request.bad_response),
        "corrected_response": clean(corrected) if corrected is not None else None,
        "source": SOURCE,
        "model_version": model_version,
        "arm": arm,
        "created_at": created_at.isoformat(timespec="seconds").replace("+00:00", "Z"),
        "tags": tags,
    }
    parse_record(record)
    return record, found


def encode_line(record: dict[str, object], limits: Limits) -> bytes:
    """The record as one JSON line, or ``Refused(413)`` when ingest would find it too long."""
    data = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
    # Ingest measures the line without its newline.
    if len(data) - 1 > limits.line_bytes:
        raise Refused(
            413,
            f"the badcase line would be {len(data) - 1} bytes; at most {limits.line_bytes} "
            "(ingest.max_line_bytes): send a shorter conversation",
            "line_too_long",
        )
    return data


def feedback_path(folder: Path, created_at: datetime) -> Path:
    return folder / f"{SOURCE}-{created_at:%Y-%m-%d}.jsonl"


class FeedbackWriter:
    """Appends whole lines: a thread lock within the process, ``flock`` across router processes."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._lock = threading.Lock()

    def append(self, data: bytes, created_at: datetime) -> Path:
        path = feedback_path(self.folder, created_at)
        self.folder.mkdir(mode=0o750, parents=True, exist_ok=True)
        with self._lock:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, FILE_MODE)
            try:
                mode = stat.S_IMODE(os.fstat(fd).st_mode)
                if mode & ~FILE_MODE:
                    # A file made by an older router or by hand: narrow it, never widen.
                    os.fchmod(fd, mode & FILE_MODE)
                fcntl.flock(fd, fcntl.LOCK_EX)
                view = memoryview(data)
                while view:
                    written = os.write(fd, view)
                    view = view[written:]
                # A flagged badcase is the raw material of next month's training run.
                os.fsync(fd)
            finally:
                os.close(fd)  # also releases the flock
        return path
