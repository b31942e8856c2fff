"""The record shapes ingest accepts, and the pool record it stores.

Accepted input shapes (one JSON object a line):

- ``{"prompt": str, "response": str}`` — a single exchange;
- ``{"messages": [{"role", "content"}, ...]}`` — a chat ending in an assistant turn;
- a badcase: ``{"messages": [... ending in a user turn], "bad_response": str,
  "corrected_response"?: str}`` — what the model said and, optionally, what it
  should have said.

Each may carry ``source``, ``model_version``, ``arm``, ``created_at``, ``task`` (which of the
project's tasks it is for, ``tuneloop.params.tasks``) and ``tags``. Anything else is rejected
with a reason a person can act on.

The pool holds, for each task, one batch file of records per ingest run
(``records/<task>/<batch>_<task>.jsonl``, ``task_records``), oldest first, and beside each
the ids of its records (``<batch>_<task>.ids``, ``ids_index``), which the next ingest
dedupes against without parsing the records.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import mmap
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import xxhash
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from tuneloop.io import file_stamp, read_json, read_jsonl, write_json

log = logging.getLogger(__name__)

Role = Literal["system", "user", "assistant"]
Content = Annotated[str, StringConstraints(strip_whitespace=False, min_length=1)]


class InvalidRecord(ValueError):
    """A record that cannot enter the pool; the message is the quarantine reason.

    ``kind`` is a short code for counting (``bad_json``, ``unknown_role``, ...).
    """

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    role: Role
    content: Content


class _Meta(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    source: str | None = None
    model_version: str | None = None
    arm: str | None = None
    created_at: str | None = None
    task: str | None = None
    tags: list[str] = Field(default_factory=list)


class PromptResponse(_Meta):
    prompt: Content
    response: Content


class Chat(_Meta):
    messages: list[Message] = Field(min_length=2)


class Badcase(_Meta):
    messages: list[Message] = Field(min_length=1)
    bad_response: Content
    corrected_response: Content | None = None


class PoolRecord(BaseModel):
    """A record in ``data/pool``: the conversation, what to learn from it, where it came from."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    id: str
    kind: Literal["chat", "badcase"]
    messages: list[Message]
    bad_response: str | None = None
    corrected_response: str | None = None
    meta: dict[str, Any]
    provenance: dict[str, Any]


def _check_turns(messages: list[tuple[str, str]], last: Role) -> None:
    """Turn order and content of ``(role, content)`` pairs; InvalidRecord says what is wrong."""
    for index, (role, content) in enumerate(messages):
        if not content.strip():
            raise InvalidRecord("empty_content", f"messages[{index}] ({role}) has empty content")
        if role == "system" and index != 0:
            raise InvalidRecord(
                "system_not_first",
                f"messages[{index}] is a system turn; only the first turn may be",
            )
    turns = messages[1:] if messages[0][0] == "system" else messages
    for index, (role, _) in enumerate(turns):
        expected = "user" if index % 2 == 0 else "assistant"
        if role != expected:
            raise InvalidRecord(
                "wrong_turn_order",
                f"wrong turn order: turn {index} is {role!r}, expected {expected!r} "
                "(turns alternate user/assistant after an optional system turn)",
            )
    if not turns or turns[-1][0] != last:
        raise InvalidRecord("wrong_turn_order", f"the conversation must end with a {last} turn")


def _explain(error: ValidationError) -> InvalidRecord:
    parts, kinds = [], []
    for item in error.errors():
        where = ".".join(str(p) for p in item["loc"]) or "record"
        if item["type"] == "missing":
            kinds.append("missing_field")
            parts.append(f"missing field {where!r}")
        elif item["type"] == "extra_forbidden":
            kinds.append("unknown_field")
            parts.append(f"unknown field {where!r}")
        elif item["type"] == "literal_error" and where.endswith("role"):
            kinds.append("unknown_role")
            role = item.get("input")
            # Only a short string is worth quoting; repr of a deeply nested value can
            # itself fail, and a long one would swamp the reason.
            shown = repr(role) if isinstance(role, str) and len(role) <= 40 else "a value"
            parts.append(f"unknown role {shown} at {where} (use system/user/assistant)")
        elif item["type"] == "string_too_short":
            kinds.append("empty_content")
            parts.append(f"empty content at {where}")
        else:
            kinds.append("invalid_value")
            parts.append(f"{where}: {item['msg']}")
    return InvalidRecord(kinds[0] if kinds else "invalid_value", "; ".join(parts))


def parse_record(data: Any) -> Chat | Badcase:
    """Validate one decoded JSON value into a chat or a badcase, or raise InvalidRecord."""
    if not isinstance(data, dict):
        raise InvalidRecord(
            "not_an_object", f"a line must hold a JSON object, got {type(data).__name__}"
        )
    shape: type[PromptResponse | Chat | Badcase]
    if "bad_response" in data:
        shape = Badcase
    elif "messages" in data:
        shape = Chat
    elif "prompt" in data or "response" in data:
        shape = PromptResponse
    else:
        raise InvalidRecord(
            "unknown_shape",
            "none of the accepted shapes: needs 'prompt'+'response', 'messages', "
            f"or 'messages'+'bad_response' (found fields {sorted(data)})",
        )
    try:
        record = shape.model_validate(data)
    except ValidationError as error:
        raise _explain(error) from None
    if isinstance(record, PromptResponse):
        meta = record.model_dump(exclude={"prompt", "response"})
        record = Chat(
            messages=[
                Message(role="user", content=record.prompt),
                Message(role="assistant", content=record.response),
            ],
            **meta,
        )
        for message in record.messages:
            if not message.content.strip():
                raise InvalidRecord("empty_content", f"empty {message.role} text")
    pairs: list[tuple[str, str]] = [(m.role, m.content) for m in record.messages]
    _check_turns(pairs, last="assistant" if isinstance(record, Chat) else "user")
    return record


# --- the same, without pydantic, for ingest's million lines -------------------------------

META_FIELDS = ("source", "model_version", "arm", "created_at", "task")
_CHAT_KEYS = frozenset({"messages", *META_FIELDS, "tags"})
_BADCASE_KEYS = _CHAT_KEYS | {"bad_response", "corrected_response"}
_PROMPT_KEYS = frozenset({"prompt", "response", *META_FIELDS, "tags"})
_ROLES = frozenset(("system", "user", "assistant"))
_MESSAGE_KEYS = frozenset(("role", "content"))


@dataclass(slots=True)
class PlainRecord:
    """``parse_record``'s result as plain values: what ingest scrubs, hashes and stores."""

    kind: Literal["chat", "badcase"]
    messages: list[tuple[str, str]]  # (role, content)
    bad_response: str | None
    corrected_response: str | None
    meta: dict[str, Any]  # source, model_version, arm, created_at, task, tags (in this order)


def plain(record: Chat | Badcase) -> PlainRecord:
    meta = record.model_dump(include={*META_FIELDS, "tags"})
    messages: list[tuple[str, str]] = [(m.role, m.content) for m in record.messages]
    if isinstance(record, Badcase):
        return PlainRecord(
            "badcase", messages, record.bad_response, record.corrected_response, meta
        )
    return PlainRecord("chat", messages, None, None, meta)


def _text(value: Any) -> bool:
    return type(value) is str and len(value) > 0


def parse_plain(data: Any) -> PlainRecord | None:
    """``plain(parse_record(data))`` for a well-formed record, or None for anything else.

    Validating a line with pydantic and dumping it again took most of ingest's time. This
    accepts only values ``parse_record`` accepts unchanged (exact ``str``, ``list`` and
    ``dict`` types, no coercion), and returns None for everything else, including every
    invalid record: the caller then runs ``parse_record``, whose result or error stands.
    ``tests/test_ingest.py`` checks the two agree on generated records.
    """
    if type(data) is not dict:
        return None
    kind: Literal["chat", "badcase"]
    if "bad_response" in data:
        allowed, kind = _BADCASE_KEYS, "badcase"
    elif "messages" in data:
        allowed, kind = _CHAT_KEYS, "chat"
    elif "prompt" in data or "response" in data:
        allowed, kind = _PROMPT_KEYS, "chat"
    else:
        return None
    if not data.keys() <= allowed:
        return None
    meta: dict[str, Any] = {}
    for name in META_FIELDS:
        value = data.get(name)
        if value is not None and type(value) is not str:
            return None
        meta[name] = value
    tags = data.get("tags", [])
    if type(tags) is not list or not all(type(tag) is str for tag in tags):
        return None
    meta["tags"] = list(tags)
    if allowed is _PROMPT_KEYS:
        prompt, response = data.get("prompt"), data.get("response")
        if not (type(prompt) is str and prompt and type(response) is str and response):
            return None
        messages: list[tuple[str, str]] = [("user", prompt), ("assistant", response)]
    else:
        raw = data["messages"]
        if type(raw) is not list or len(raw) < (2 if kind == "chat" else 1):
            return None
        messages = []
        for message in raw:
            if type(message) is not dict or message.keys() != _MESSAGE_KEYS:
                return None
            role, content = message["role"], message["content"]
            if type(role) is not str or role not in _ROLES or not _text(content):
                return None
            messages.append((role, content))
    bad = corrected = None
    if kind == "badcase":
        bad, corrected = data["bad_response"], data.get("corrected_response")
        if not _text(bad) or not (corrected is None or _text(corrected)):
            return None
    try:
        _check_turns(messages, last="assistant" if kind == "chat" else "user")
    except InvalidRecord:
        return None
    return PlainRecord(kind, messages, bad, corrected, meta)


def content_hash(record: Chat | Badcase | PlainRecord) -> str:
    """Identity of a record's content (not its metadata): equal conversations are duplicates."""
    bad: str | None = None
    corrected: str | None = None
    if isinstance(record, PlainRecord):
        messages = record.messages
        badcase = record.kind == "badcase"
        bad, corrected = record.bad_response, record.corrected_response
    else:
        messages = [(m.role, m.content) for m in record.messages]
        badcase = isinstance(record, Badcase)
        if isinstance(record, Badcase):
            bad, corrected = record.bad_response, record.corrected_response
    body: dict[str, Any] = {"messages": [[role, content.strip()] for role, content in messages]}
    # One conversation for two tasks is two records; without a task the hash is as it was.
    task = record.meta.get("task") if isinstance(record, PlainRecord) else record.task
    if task is not None:
        body["task"] = task
    if badcase:
        body["bad"] = (bad or "").strip()
        body["corrected"] = (corrected or "").strip()
    canonical = json.dumps(body, ensure_ascii=False, sort_keys=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


# The pool's folder of record batches: a folder per task in it (``task_records``).
RECORDS = "records"


def task_records(pool: Path, task: str) -> Path:
    """The folder of ``task``'s record batches in ``pool`` (``ingest.add_batch`` writes it):
    the one pool dep of the task's stages in dvc.yaml (``${paths.pool}/records/${key}``)."""
    return pool / RECORDS / task


def pool_batches(pool: Path, task: str | None = None) -> list[Path]:
    """The pool's record batch files, oldest first: the order records are cleaned in.

    Each task's batches lie in its own folder (``task_records``): ``task`` names one, None
    reads every task's (a merged model's data), a batch's tasks in name order.
    """
    if task is not None:
        return sorted(task_records(pool, task).glob("*.jsonl"))
    records = pool / RECORDS
    # A task's batch is named <batch>_<task>: unique in the whole pool, in time order.
    return sorted([*records.glob("*.jsonl"), *records.glob("*/*.jsonl")], key=lambda p: p.name)


def pool_records(pool: Path, task: str | None = None) -> Iterator[PoolRecord]:
    """Every record in the pool (of ``task``: ``pool_batches``), oldest batch first."""
    for path in pool_batches(pool, task):
        for data in read_jsonl(path):
            yield PoolRecord.model_validate(data)


# Beside each batch of records, its records' ids (``ids_index``): a month's ingest reads the
# pool's ids from these instead of parsing every record again (5 s of JSON at a million).
IDS_SUFFIX = ".ids"
_IDS_MAGIC = b"TLIDS\x00\x00\x01"
_ID_BYTES = 32


def ids_index(batch: bytes | Sequence[bytes], ids: Sequence[str]) -> bytes:
    """The ids file of a batch of records (its bytes as written, and its records' ids in order):
    a header tying it to exactly those bytes (size and xxh3-128), then each id's 32 bytes."""
    digest = xxhash.xxh3_128()
    size = 0
    for part in [batch] if isinstance(batch, bytes) else batch:
        digest.update(part)
        size += len(part)
    return b"".join(
        [_IDS_MAGIC, size.to_bytes(8, "little"), digest.digest(), *map(bytes.fromhex, ids)]
    )


def hashes_path(pool: Path) -> Path:
    """Where ``pool_ids`` remembers each batch's xxh3-128: beside the pool (a DVC out hashed
    whole), like its lock and staging folder (``tuneloop.data.pool``, which the stages that only
    read the pool do not import)."""
    return pool.parent / f".{pool.name}.hashes.json"


def _batch_digest(batch: Path, stat: os.stat_result, known: dict[str, Any]) -> bytes:
    """The batch's xxh3-128: remembered in ``known`` for this ``file_stamp``, else hashed
    and remembered there."""
    entry = known.get(batch.name)
    if isinstance(entry, dict) and entry.get("stat") == file_stamp(stat):
        with contextlib.suppress(KeyError, TypeError, ValueError):
            return bytes.fromhex(entry["xxh3"])
    if stat.st_size:
        # Hashed where it lies (a map of the page cache): reading a month's batch into memory
        # first cost as much again in page faults as the hash.
        with batch.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            digest = xxhash.xxh3_128_digest(data)
    else:
        digest = xxhash.xxh3_128_digest(b"")
    known[batch.name] = {"stat": file_stamp(stat), "xxh3": digest.hex()}
    return digest


def _indexed_ids(batch: Path, known: dict[str, Any]) -> list[str] | None:
    """The ids of a batch from its ids file, or None: missing, damaged, or not of these bytes."""
    try:
        index = batch.with_suffix(IDS_SUFFIX).read_bytes()
    except FileNotFoundError:
        return None
    header = len(_IDS_MAGIC) + 8 + 16
    if len(index) < header or not index.startswith(_IDS_MAGIC) or (len(index) - header) % _ID_BYTES:
        return None
    size = int.from_bytes(index[len(_IDS_MAGIC) : len(_IDS_MAGIC) + 8], "little")
    stat = batch.stat()
    if size != stat.st_size or index[header - 16 : header] != _batch_digest(batch, stat, known):
        return None
    text = index[header:].hex()
    return [text[i : i + 2 * _ID_BYTES] for i in range(0, len(text), 2 * _ID_BYTES)]


def pool_ids(pool: Path) -> set[str]:
    """The ids (content hashes) of every pooled record: from each batch's ids file, or where
    that is missing or not of the batch's bytes (a pool from before them), read by Arrow's JSON
    reader in C++ (validating a million records to read one field each took most of ingest's
    time)."""
    import pyarrow as pa
    import pyarrow.json as pa_json

    ids: set[str] = set()
    options = pa_json.ParseOptions(
        explicit_schema=pa.schema([("id", pa.string())]), unexpected_field_behavior="ignore"
    )
    memo = hashes_path(pool)
    try:
        remembered = read_json(memo)
    except (OSError, ValueError):
        remembered = None
    if not isinstance(remembered, dict):
        remembered = {}
    batches = pool_batches(pool)
    known = {b.name: remembered[b.name] for b in batches if b.name in remembered}
    for path in batches:
        indexed = _indexed_ids(path, known)
        if indexed is not None:
            ids.update(indexed)
        elif path.stat().st_size:
            log.info("pool: %s has no ids file of its bytes; reading its records' ids", path.name)
            table = pa_json.read_json(
                path,
                # A block must hold a whole line (ingest.max_line_bytes, 1 MB by default).
                read_options=pa_json.ReadOptions(block_size=64 << 20),
                parse_options=options,
            )
            ids.update(table.column("id").to_pylist())
    if known != remembered and memo.parent.is_dir():
        # Only what was read: the write needs the pool's lock, which ingest holds.
        write_json(memo, known)
    return ids
