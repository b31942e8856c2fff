"""PII scrubbing: every type found, checksum negatives and ordinary numbers left alone."""

from __future__ import annotations

import datetime as dt
import ipaddress
from collections import Counter

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tuneloop.data.pii import (
    BANK_CARD,
    CN_ID,
    EMAIL,
    IP,
    PHONE,
    cn_id_valid,
    luhn_valid,
    placeholder,
    scrub,
    scrub_bytes,
    scrub_fields,
)

# The fast tier: no pipeline, server or rank.
pytestmark = pytest.mark.fast

# The textbook example ID (Beijing, born 1949-12-31) and test card numbers
# published by the card schemes.
VALID_ID = "11010519491231002X"
VISA = "4111111111111111"
UNIONPAY_19 = "6212345678901234569"


def _cn_id_check(body: str) -> str:
    weights = (7, 9, 10, 5, 8, 4, 2, 1, 6, 3, 7, 9, 10, 5, 8, 4, 2)
    return "10X98765432"[sum(w * int(d) for w, d in zip(weights, body, strict=True)) % 11]


def _luhn_complete(prefix: str) -> str:
    """The Luhn check digit that makes ``prefix + digit`` valid."""
    return next(str(d) for d in range(10) if luhn_valid(prefix + str(d)))


def test_luhn_and_id_helpers() -> None:
    assert luhn_valid(VISA)
    assert luhn_valid(UNIONPAY_19)
    assert not luhn_valid("4111111111111112")
    assert cn_id_valid(VALID_ID)
    assert cn_id_valid(VALID_ID.lower())
    assert not cn_id_valid("110105194912310021")  # wrong check character
    assert not cn_id_valid("110105194902300028"[:17] + _cn_id_check("11010519490230002"))  # Feb 30
    future = (dt.date.today() + dt.timedelta(days=400)).strftime("%Y%m%d")
    body = "110105" + future + "002"
    assert not cn_id_valid(body + _cn_id_check(body))


@pytest.mark.parametrize(
    ("text", "expected", "kind"),
    [
        ("联系邮箱zhang.san@example.com，谢谢", "联系邮箱<EMAIL>，谢谢", EMAIL),
        ("mail me: Li_Wei+ft@mail.corp.example.cn.", "mail me: <EMAIL>.", EMAIL),
        ("QQ邮箱13812345678@qq.com", "QQ邮箱<EMAIL>", EMAIL),
        ("手机13812345678请回电", "手机<PHONE>请回电", PHONE),
        ("电话：+86 138-1234-5678。", "电话：<PHONE>。", PHONE),
        ("电话0086 138 1234 5678", "电话<PHONE>", PHONE),
        ("(+86)19912345678", "<PHONE>", PHONE),
        ("+8613812345678", "<PHONE>", PHONE),
        ("call +1 (555) 123-4567 now", "call <PHONE> now", PHONE),
        ("UK office +44 20 7946 0958", "UK office <PHONE>", PHONE),
        ("手机１３８１２３４５６７８号", "手机<PHONE>号", PHONE),
        ("身份证号11010519491231002X。", "身份证号<CN_ID>。", CN_ID),
        ("身份证号11010519491231002x", "身份证号<CN_ID>", CN_ID),
        (f"卡号{VISA}，请退款", "卡号<BANK_CARD>，请退款", BANK_CARD),
        ("card 4111 1111 1111 1111 expires", "card <BANK_CARD> expires", BANK_CARD),
        ("card 4111-1111-1111-1111", "card <BANK_CARD>", BANK_CARD),
        ("amex 3782 822463 10005", "amex <BANK_CARD>", BANK_CARD),
        (f"银联卡{UNIONPAY_19}", "银联卡<BANK_CARD>", BANK_CARD),
        ("4111 1111 1111 1111 2024", "<BANK_CARD> 2024", BANK_CARD),
        ("服务器192.168.1.1挂了", "服务器<IP>挂了", IP),
        ("from 10.0.0.255.", "from <IP>.", IP),
        ("地址2001:db8::1不通", "地址<IP>不通", IP),
        ("peer 2001:0db8:85a3:0000:0000:8a2e:0370:7334 up", "peer <IP> up", IP),
        ("mapped ::ffff:10.0.0.1 here", "mapped <IP> here", IP),
        ("link fe80::1%eth0", "link <IP>%eth0", IP),
    ],
)
def test_each_type_found_and_replaced(text: str, expected: str, kind: str) -> None:
    out, counts = scrub(text)
    assert out == expected
    assert counts == Counter({kind: 1})


@pytest.mark.parametrize(
    "text",
    [
        "110105194912310021",  # ID with a wrong check character (and not Luhn-valid)
        "11010519491332002X",  # month 13
        "6222021234567890",  # fails Luhn: an order number, not a card
        "4111 1111 1111 1112",
        "订单号1234567890123",
        "退款将在30天内到账",
        "order 45678 shipped",
        "价格¥1,299.00，折后$19.99",
        "2024-01-15 10:30:45",
        "2024年1月15日",
        "版本v1.2.3，第3章，占比12.5%",
        "1.2.3.4.5 and 256.1.1.1 are not addresses",
        "12:30:45 and std::vector<int> and a::b",
        "mac 00:1a:2b:3c:4d:5e",
        "phone 138123456789 has 12 digits",
        "+1 555123 is too short",
        "ticket #12345678",
    ],
)
def test_not_pii_left_alone(text: str) -> None:
    assert scrub(text) == (text, Counter())


def test_id_not_eaten_by_phone_or_card() -> None:
    # A valid ID whose first 17 digits pass Luhn would be miscounted as a card
    # if cards ran first; find one to make the order test bite.
    for seq in range(1000):
        body = f"11010519800101{seq:03d}"
        id_number = body + _cn_id_check(body)
        if luhn_valid(body[:17]) or luhn_valid(id_number):
            break
    assert scrub(f"证件{id_number}") == ("证件<CN_ID>", Counter({CN_ID: 1}))


def test_mixed_chinese_english() -> None:
    text = (
        "用户张三（zhangsan@corp.cn，手机+86 139 1234 5678）反馈：card 4111111111111111 "
        f"被扣款两次，身份证{VALID_ID}，登录IP 203.0.113.7，订单号 20240115001，30天内退款。"
    )
    out, counts = scrub(text)
    assert out == (
        "用户张三（<EMAIL>，手机<PHONE>）反馈：card <BANK_CARD> "
        "被扣款两次，身份证<CN_ID>，登录IP <IP>，订单号 20240115001，30天内退款。"
    )
    assert counts == Counter({EMAIL: 1, PHONE: 1, BANK_CARD: 1, CN_ID: 1, IP: 1})


def test_hits_counted_per_type() -> None:
    _, counts = scrub("a@b.co, c@d.co, 13812345678, 13912345678, 13712345678")
    assert counts == Counter({EMAIL: 2, PHONE: 3})


def test_hit_exposed_by_earlier_replacement_is_still_scrubbed() -> None:
    # The card's last digit blocks the phone's look-behind until the card is
    # replaced; scrub repeats so the phone does not survive.
    out, counts = scrub(f"{VISA}+441234567890")
    assert out == "<BANK_CARD><PHONE>"
    assert counts == Counter({BANK_CARD: 1, PHONE: 1})


# --- property tests -------------------------------------------------------------

_FILLER = st.text(alphabet="的是了我你他用户反馈退款订单谢谢请问客服 abcXYZ，。：", max_size=8)
# Characters that make PII-ish and near-PII-ish runs likely.
_NOISY = st.text(
    alphabet="0123456789０１２３ +-.:@()Xxabcdef 中文订单号，:com", min_size=0, max_size=80
)


@st.composite
def _cn_ids(draw: st.DrawFn) -> str:
    region = draw(st.from_regex(r"[1-8][0-9]{5}", fullmatch=True))
    born = draw(st.dates(min_value=dt.date(1900, 1, 1), max_value=dt.date.today()))
    seq = draw(st.from_regex(r"[0-9]{3}", fullmatch=True))
    body = region + born.strftime("%Y%m%d") + seq
    return body + _cn_id_check(body)


@st.composite
def _cards(draw: st.DrawFn) -> str:
    # Real scheme prefixes (Visa, Mastercard, UnionPay); 18 digits is left out
    # because an 18-digit number can legitimately be an ID number instead.
    prefix = draw(st.sampled_from(["4", "51", "55", "62"]))
    length = draw(st.sampled_from([13, 15, 16, 17, 19]))
    body = prefix + draw(st.from_regex(rf"[0-9]{{{length - len(prefix) - 1}}}", fullmatch=True))
    number = body + _luhn_complete(body)
    if length == 16 and draw(st.booleans()):
        sep = draw(st.sampled_from([" ", "-"]))
        number = sep.join(number[i : i + 4] for i in range(0, 16, 4))
    return number


@st.composite
def _phones(draw: st.DrawFn) -> str:
    digits = (
        "1" + draw(st.sampled_from("3456789")) + draw(st.from_regex(r"[0-9]{9}", fullmatch=True))
    )
    shape = draw(st.sampled_from(["plain", "spaced", "dashed", "+86", "0086", "intl"]))
    if shape == "intl":
        cc = draw(st.sampled_from(["1", "44", "49", "852"]))
        rest = draw(st.from_regex(r"[0-9]{7,10}", fullmatch=True))
        return f"+{cc} {rest[:3]} {rest[3:]}"
    if shape == "spaced":
        return f"{digits[:3]} {digits[3:7]} {digits[7:]}"
    if shape == "dashed":
        return f"{digits[:3]}-{digits[3:7]}-{digits[7:]}"
    if shape in ("+86", "0086"):
        return f"{shape} {digits}"
    return digits


@st.composite
def _emails(draw: st.DrawFn) -> str:
    local = draw(st.from_regex(r"[a-z0-9][a-z0-9._+-]{0,10}", fullmatch=True))
    domain = draw(st.from_regex(r"[a-z0-9]{1,8}(\.[a-z0-9]{1,8}){0,2}", fullmatch=True))
    return f"{local}@{domain}.{draw(st.sampled_from(['com', 'cn', 'org', 'io']))}"


@st.composite
def _ips(draw: st.DrawFn) -> str:
    if draw(st.booleans()):
        return str(ipaddress.IPv4Address(draw(st.integers(0, 2**32 - 1))))
    address = ipaddress.IPv6Address(draw(st.integers(0, 2**128 - 1)))
    text = address.compressed if draw(st.booleans()) else address.exploded
    assume(any(c.isdigit() for c in text))
    return text


_PII_ITEMS = st.one_of(
    st.tuples(st.just(CN_ID), _cn_ids()),
    st.tuples(st.just(BANK_CARD), _cards()),
    st.tuples(st.just(PHONE), _phones()),
    st.tuples(st.just(EMAIL), _emails()),
    st.tuples(st.just(IP), _ips()),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_PII_ITEMS, max_size=6), _FILLER)
def test_generated_pii_is_found_with_its_type(items: list[tuple[str, str]], filler: str) -> None:
    # Joined by a Chinese comma (no digit, '@' or ASCII letter), so each item stands alone.
    text = "，".join([filler, *(value for _, value in items), filler])
    out, counts = scrub(text)
    assert counts == Counter(kind for kind, _ in items)
    for _, value in items:
        assert value not in out


@settings(max_examples=500, deadline=None)
@given(st.one_of(_NOISY, st.text(max_size=60)))
def test_scrub_is_idempotent_and_leaves_nothing_detectable(text: str) -> None:
    once, _ = scrub(text)
    twice, counts = scrub(once)
    assert twice == once
    assert counts == Counter()


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=80))
def test_text_without_digits_or_at_is_unchanged(text: str) -> None:
    assume(not any(c.isdigit() or c in "@＠﹫" for c in text))
    assert scrub(text) == (text, Counter())


def test_placeholders_carry_no_digits() -> None:
    for kind in (EMAIL, PHONE, CN_ID, BANK_CARD, IP):
        assert not any(c.isdigit() or c == "@" for c in placeholder(kind))


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        # Not UTF-8: the bad byte becomes U+FFFD, the rest is still scrubbed.
        (b'{"prompt": "caf\xe9 a.b@example.com', '{"prompt": "caf\ufffd <EMAIL>'),
        # Broken JSON whose non-ASCII text an exporter escaped.
        (b'{"p": "\\u624b\\u673a13812345678', '{"p": "\u624b\u673a<PHONE>'),
        # Escaped digits and '@', as a hostile line might write them.
        ("".join(f"\\u{ord(c):04x}" for c in "13812345678").encode(), "<PHONE>"),
        (b"li\\u0040example.com", "<EMAIL>"),
        # An escaped surrogate pair is one character; a lone half cannot be stored.
        (b"\\ud83d\\ude00 \\ud800 " + VALID_ID.encode(), "\U0001f600 \ufffd <CN_ID>"),
        (b"", ""),
    ],
)
def test_scrub_bytes_reads_what_scrub_cannot(raw: bytes, expected: str) -> None:
    text, _ = scrub_bytes(raw)
    assert text == expected
    text.encode("utf-8")  # always storable


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=60), st.sampled_from(["a.b@example.com", "13812345678", VISA]))
def test_scrub_bytes_finds_pii_among_any_bytes(noise: bytes, value: str) -> None:
    raw = noise + b" " + value.encode() + b" " + noise
    text, _ = scrub_bytes(raw)
    assert value not in text
    text.encode("utf-8")


_FIELD_PIECES = [
    "4111 1111 1111 1111",
    "11010519491231002X",
    "13812345678",
    "+86 138 1234 5678",
    "192.168.1.1",
    "2001:db8::1",
    "zhang.san@example.com",
    "１３８１２３４５６７８",
    "＠",
    "手机",
    "0086",
    "-",
    " ",
    ".",
    ":",
    "@",
    "+",
    "\x00",
    "7",
    "x",
]
_field = st.lists(st.sampled_from(_FIELD_PIECES) | st.text(max_size=4), max_size=8).map("".join)


@settings(max_examples=300, deadline=None)
@given(st.lists(_field, max_size=6))
def test_scrub_fields_is_scrub_of_each_field(fields: list[str]) -> None:
    """One pass over a record's fields finds exactly what scrubbing each one finds."""
    scrubbed, counts = scrub_fields(fields)
    expected = [scrub(text) for text in fields]
    assert scrubbed == [text for text, _ in expected]
    assert counts == sum((found for _, found in expected), Counter())
