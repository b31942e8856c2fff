"""Ingest of a hostile export whose bad lines carry personal data: none of it is on disk after.

Every planted value is searched for, as written and with its separators
removed, in every file the run could have written (the pool, its quarantine,
reports, metrics, the MLflow store): everything in the project but the
incoming file itself, which the test keeps outside ``data/`` for that reason.
"""

from __future__ import annotations

import hashlib
import json
import re
import stat
from pathlib import Path
from typing import Any

import pytest

from stages import ingest, task_names
from tests.helpers import write_params
from tuneloop.data.records import pool_records

# The whole suite (`make test`): the ingest stage on hostile files, nothing but stage runs
pytestmark = pytest.mark.slow

EMAIL = "zhang.wei.8841@example.com"
EMAIL_PLUS = "li_na+vip@mail.example.cn"
EMAIL_ESCAPED = "wang.fang@example.org"
EMAIL_SOURCE = "chen.source@example.net"
EMAIL_TAG = "tag.owner@example.com"
EMAIL_FILE = "zhao.min@example.com"
PHONE = "13912345678"
PHONE_SPACED = "+86 139 8765 4321"
PHONE_FULLWIDTH = "１３７００１２３４５６"  # typed with a Chinese IME
PHONE_ESCAPED = "13712345678"
PHONE_INTL = "+44 20 7946 0958"
CN_ID = "11010519491231002X"  # the textbook example: Beijing, born 1949-12-31
CN_ID_2 = "440308199001011239"  # Shenzhen, born 1990-01-01
CARD = "4111 1111 1111 1111"
CARD_MC = "5500000000000004"
CARD_UNIONPAY = "6212345678901234569"
IP = "203.0.113.7"
IPV6 = "2001:db8::1"
PLANTED = [
    EMAIL,
    EMAIL_PLUS,
    EMAIL_ESCAPED,
    EMAIL_SOURCE,
    EMAIL_TAG,
    EMAIL_FILE,
    PHONE,
    PHONE_SPACED,
    PHONE_FULLWIDTH,
    PHONE_ESCAPED,
    PHONE_INTL,
    CN_ID,
    CN_ID_2,
    CARD,
    CARD_MC,
    CARD_UNIONPAY,
    IP,
    IPV6,
]
INCOMING = "inbox"
FILE_NAME = f"export for {EMAIL_FILE}, 2026-10.jsonl"  # a file name is stored too
MAX_LINE_BYTES = 5000


def line(record: Any) -> bytes:
    return json.dumps(record, ensure_ascii=False).encode() + b"\n"


def escaped(text: str) -> bytes:
    """``text`` with every character written as a JSON \\u escape."""
    return "".join(f"\\u{ord(c):04x}" for c in text).encode()


GOOD_CHAT = {
    "prompt": f"我的手机是{PHONE}，邮箱{EMAIL}",
    "response": "[return] 好的，我们会联系您。",
    "tags": [f"customer:{EMAIL_TAG}", f"电话{PHONE_SPACED}"],
    "source": f"support-tool/{EMAIL_SOURCE}",
    "model_version": f"v3 from {IP}",
    "arm": f"challenger {IPV6}",
    "created_at": "2026-10-01T10:00:00Z",
}
GOOD_BADCASE = {
    "messages": [{"role": "user", "content": f"Card {CARD}, ID {CN_ID}, call {PHONE_INTL}"}],
    "bad_response": f"Sure, I will charge {CARD_MC}",
    "corrected_response": f"[unknown] Please never share card numbers like {CARD_UNIONPAY}.",
    "tags": [f"身份证{CN_ID_2}"],
}
GOOD_FULLWIDTH = {
    "messages": [
        {"role": "user", "content": f"电话{PHONE_FULLWIDTH}"},
        {"role": "assistant", "content": "[greeting] 您好"},
    ]
}
BAD_JSON = f'{{"prompt": "email me at {EMAIL}, 手机{PHONE}", "response": \n'.encode()

# Each bad line, and the reason it must be quarantined for.
BAD_LINES: list[tuple[str, bytes]] = [
    ("bad_json", BAD_JSON),
    (
        "invalid_utf8",
        f'{{"prompt": "caf\xe9 call {PHONE_INTL}", "response": "card {CARD}"}}\n'.encode("latin-1"),
    ),
    (
        "line_too_long",
        line({"prompt": "x" * MAX_LINE_BYTES + f" 身份证号{CN_ID} {EMAIL_PLUS}", "response": "r"}),
    ),
    (
        "unknown_role",
        line(
            {
                "messages": [
                    {"role": EMAIL_PLUS, "content": "hi"},
                    {"role": "assistant", "content": "x"},
                ]
            }
        ),
    ),
    ("invalid_value", line({"prompt": [PHONE], "response": {"ip": IP, "card": CARD_MC}})),
    ("invalid_value", line({"prompt": "q", "response": "a", "tags": [[[[EMAIL, {"id": CN_ID}]]]]})),
    ("too_deep", b"[" * 2400 + json.dumps(EMAIL_PLUS).encode() + b"]" * 2400 + b"\n"),
    ("unknown_field", line({"prompt": "q", "response": "a", CARD_UNIONPAY: EMAIL})),
    (
        "bad_json",
        b'{"prompt": "reach ' + escaped(EMAIL_ESCAPED) + b" or " + escaped(PHONE_ESCAPED) + b"\n",
    ),
    ("lone_surrogate", b'{"prompt": "\\ud800 ' + EMAIL_SOURCE.encode() + b'", "response": "x"}\n'),
    ("unknown_shape", line({EMAIL_TAG: PHONE})),
    (
        "missing_field",
        line({"messages": [{"role": "user", "content": f"ID {CN_ID_2}"}, {"role": "assistant"}]}),
    ),
    ("not_an_object", line([EMAIL, PHONE])),
    (
        "wrong_turn_order",
        line(
            {
                "messages": [
                    {"role": "assistant", "content": f"call {PHONE}"},
                    {"role": "user", "content": "x"},
                ]
            }
        ),
    ),
]


def hostile_file() -> bytes:
    good = [line(GOOD_CHAT), line(GOOD_BADCASE), line(GOOD_FULLWIDTH)]
    lines = good[:2] + [raw for _, raw in BAD_LINES] + good[2:]
    lines += [b"\n", line(GOOD_CHAT), BAD_JSON]  # a blank line, then two duplicates
    return b"".join(lines)


def needles(value: str) -> set[bytes]:
    """The forms a value could be stored in: as written, compact, and folded to ASCII digits."""
    forms = {value, re.sub(r"[ \-]", "", value)}
    forms |= {re.sub(r"\D", "", f) for f in forms if sum(c.isdigit() for c in f) >= 8}
    folded = "".join(str(int(c)) if c.isdigit() else c for c in value)
    forms.add(folded)
    if value.startswith("+86"):
        forms.add(re.sub(r"\D", "", value)[2:])  # the mobile number without the country code
    return {f.encode() for f in forms if f}


def written_files(project: Path) -> list[Path]:
    return [
        p
        for p in sorted(project.rglob("*"))
        if p.is_file() and INCOMING not in p.relative_to(project).parts
    ]


def metrics(project: Path) -> dict[str, Any]:
    return json.loads((project / "metrics/ingest.json").read_text())


@pytest.fixture
def hostile(in_folder: Path) -> Path:
    inbox = in_folder / INCOMING
    inbox.mkdir()
    (inbox / FILE_NAME).write_bytes(hostile_file())
    return in_folder


def set_limits(project: Path, max_reject_rate: float) -> None:
    write_params(
        project,
        {
            "ingest": {"max_reject_rate": max_reject_rate, "max_line_bytes": MAX_LINE_BYTES},
            "paths": {"incoming": INCOMING},
        },
    )
    task_names.main()


def test_no_planted_value_anywhere_on_disk_and_every_line_accounted(hostile: Path) -> None:
    # First with the default reject limit: the run fails and writes its report.
    set_limits(hostile, 0.05)
    with pytest.raises(SystemExit, match=r"over ingest\.max_reject_rate"):
        ingest.main()
    report = [json.loads(x) for x in (hostile / "reports/ingest-rejected.jsonl").open()]
    assert len(report) == len(BAD_LINES)
    # Then with the limit raised: the batch enters the pool and the quarantine.
    set_limits(hostile, 0.9)
    ingest.main()

    m = metrics(hostile)
    assert m["lines"] == m["accepted"] + m["quarantined"] + m["duplicates"]
    assert (m["accepted"], m["quarantined"], m["duplicates"], m["blank_lines"]) == (
        3,
        len(BAD_LINES),
        2,
        1,
    )
    wanted: dict[str, int] = {}
    for kind, _ in BAD_LINES:
        wanted[kind] = wanted.get(kind, 0) + 1
    assert m["quarantine_reasons"] == wanted

    files = written_files(hostile)
    assert any(p.parent.name == "quarantine" for p in files)
    assert any(p.parent.parent.name == "records" for p in files)  # records/<task>/
    for path in files:
        data = path.read_bytes()
        for value in PLANTED:
            for needle in needles(value):
                assert needle not in data, f"{value!r} ({needle!r}) is in {path}"


def test_quarantine_keeps_where_why_and_a_scrubbed_excerpt(hostile: Path) -> None:
    set_limits(hostile, 0.9)
    ingest.main()
    source = hostile / INCOMING / FILE_NAME
    raw = source.read_bytes()
    entries = [
        json.loads(x) for p in (hostile / "data/pool/quarantine").glob("*.jsonl") for x in p.open()
    ]
    assert [e["kind"] for e in entries] == [kind for kind, _ in BAD_LINES]
    for entry in entries:
        assert entry["file"] == "export for <EMAIL>, 2026-10.jsonl"
        # The byte offset and length find the very line in the incoming file.
        found = raw[entry["offset"] : entry["offset"] + entry["bytes"]]
        assert "raw:" + hashlib.sha256(found).hexdigest() == entry["sha256"]
        if entry["kind"] == "line_too_long":
            assert entry["excerpt"] is None  # too long to scrub: no excerpt at all
        else:
            assert entry["excerpt"]
    bad_json = [e["excerpt"] for e in entries if e["kind"] == "bad_json"]
    assert bad_json == [
        '{"prompt": "email me at <EMAIL>, 手机<PHONE>", "response": ',
        '{"prompt": "reach <EMAIL> or <PHONE>',  # resolved from \u escapes, then scrubbed
    ]
    by_kind = {e["kind"]: e for e in entries}
    assert "unknown role '<EMAIL>'" in by_kind["unknown_role"]["reason"]
    assert "<BANK_CARD>" in by_kind["unknown_field"]["reason"]


def test_every_stored_field_of_accepted_records_is_scrubbed(hostile: Path) -> None:
    set_limits(hostile, 0.9)
    ingest.main()
    records = {r.kind: r for r in pool_records(hostile / "data/pool") if r.kind == "badcase"}
    chats = [r for r in pool_records(hostile / "data/pool") if r.kind == "chat"]
    meta = next(r.meta for r in chats if r.meta["tags"])
    assert meta["tags"] == ["customer:<EMAIL>", "电话<PHONE>"]
    assert meta["source"] == "support-tool/<EMAIL>"
    assert (meta["model_version"], meta["arm"]) == ("v3 from <IP>", "challenger <IP>")
    assert meta["created_at"] == "2026-10-01T10:00:00Z"  # a date is not personal data
    assert records["badcase"].meta["tags"] == ["身份证<CN_ID>"]
    assert {r.provenance["file"] for r in chats} == {"export for <EMAIL>, 2026-10.jsonl"}
    assert any(m.content == "电话<PHONE>" for r in chats for m in r.messages)


def test_pool_quarantine_and_reports_are_private(hostile: Path) -> None:
    set_limits(hostile, 0.05)
    with pytest.raises(SystemExit):
        ingest.main()
    set_limits(hostile, 0.9)
    ingest.main()
    folders = [hostile / "data/pool", hostile / "reports"]
    paths = [p for folder in folders for p in folder.rglob("*") if p.is_file()]
    assert len(paths) == 4  # records, their ids, quarantine, report
    for path in paths:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode & 0o027 == 0, f"{path} is {oct(mode)}"
