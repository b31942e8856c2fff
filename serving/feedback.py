"""Badcase feedback: what ``/v1/feedback`` accepts and the JSON line it appends.

Each accepted flag becomes one line of ``<feedback_dir>/router-feedback-YYYY-MM-DD.jsonl``
(UTC date), shaped as tuneloop's badcase record so next month's ingest stage
reads it like any other badcase export. The record is checked with ingest's own
``parse_record`` before it is written, so a flag that ingest would quarantine
(wrong turn order, empty text) is refused at once, with the reason, while the
support tool that sent it can still fix it.
"""

from __future__ import annotations

import fcntl
import json
import os
import threading
from datetime import datetime
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from tuneloop.records import parse_record

SOURCE = "router-feedback"
# Tag on a badcase whose serving arm the router no longer remembers (restart, or
# older than its served-records window): kept, since the conversation is still
# training data, but marked so nobody charges it to the wrong model.
UNATTRIBUTED = "unattributed"


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    role: Literal["system", "user", "assistant"]
    content: str = Field(min_length=1)


class FeedbackRequest(BaseModel):
    """A response flagged as bad by a user or a support tool."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    messages: list[ChatMessage] = Field(min_length=1, description="the conversation before it")
    bad_response: str = Field(min_length=1)
    corrected_response: str | None = Field(default=None, min_length=1)
    user: str | None = Field(default=None, min_length=1)
    request_id: str | None = Field(
        default=None, min_length=1, description="the router's X-Request-Id or the response's id"
    )
    tags: list[str] = Field(default_factory=list)


def badcase_record(
    request: FeedbackRequest,
    arm: str | None,
    model_version: str | None,
    created_at: datetime,
) -> dict[str, object]:
    """The badcase line for a flag; raises ``tuneloop.records.InvalidRecord`` if ingest would."""
    tags = list(request.tags)
    if arm is None:
        tags.append(UNATTRIBUTED)
    record: dict[str, object] = {
        "messages": [m.model_dump() for m in request.messages],
        "bad_response": request.bad_response,
        "corrected_response": request.corrected_response,
        "source": SOURCE,
        "model_version": model_version,
        "arm": arm,
        "created_at": created_at.isoformat(timespec="seconds").replace("+00:00", "Z"),
        "tags": tags,
    }
    parse_record(record)
    return record


def feedback_path(folder: Path, created_at: datetime) -> Path:
    return folder / f"{SOURCE}-{created_at:%Y-%m-%d}.jsonl"


class FeedbackWriter:
    """Appends whole lines: a thread lock within the process, ``flock`` across router processes."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._lock = threading.Lock()

    def append(self, record: dict[str, object], created_at: datetime) -> Path:
        path = feedback_path(self.folder, created_at)
        data = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
        self.folder.mkdir(parents=True, exist_ok=True)
        with self._lock:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
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
