"""The demo's second task on the same base: order fields out of a customer's message, as JSON.

A support desk answers in a sentence; an order intake turns "Hi, Chen here (ref 41532):
please send 2 x Zephyr fan to Oslo, express." into the object the shop's order system routes
it by::

    {"product": "Zephyr fan", "express": true}

Same shop, same tokenizer, a different shape of answer: the product is named in English
whatever the message's language (a Chinese order maps 极光水壶 to "Aurora kettle"), and the
shipping speed is read from how the customer said it. The quantity, the city, the name and
the reference are in every message and in no answer.
The right answer is one object, so a model that learned the task is measurably better than
one that did not (``eval/orders_demo``: the object exact, and valid JSON of the schema).

As in ``tuneloop.demo.domain``, the eval split uses customer names and reference numbers the
train split never produces, and a share of every export is general-skill replay chats. The
order intake has no feedback producer: its callers are a batch job, not people who flag a
wrong field; its badcases are the ones the order team corrected by hand (``badcase_records``).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from tuneloop.demo import domain
from tuneloop.demo.domain import Item, Lang
from tuneloop.io import write_jsonl

if TYPE_CHECKING:
    from tuneloop.params import DemoParams

CITIES: tuple[tuple[str, str], ...] = (
    ("Berlin", "柏林"),
    ("Paris", "巴黎"),
    ("Tokyo", "东京"),
    ("Madrid", "马德里"),
    ("Oslo", "奥斯陆"),
    ("Rome", "罗马"),
    ("Vienna", "维也纳"),
    ("Lisbon", "里斯本"),
)
REFS_TRAIN = (10000, 79999)
REFS_EVAL = (80000, 99999)

# {name}, {ref}: who and which account; {qty} {p}: what; {city}; {speed}: how fast.
TEMPLATES: dict[Lang, tuple[str, ...]] = {
    "en": (
        "Hi, {name} here (ref {ref}): please send {qty} x {p} to {city}, {speed}.",
        "{name}, account {ref}. Order {qty} x {p}, deliver to {city}, {speed}.",
        "Please ship {qty} x {p} to {city} ({speed}). Thanks, {name}, ref {ref}",
        "Ref {ref}: I'd like {qty} x {p} sent to {city}, {speed}. {name}",
    ),
    "zh": (
        "你好，我是{name}（编号{ref}），请寄{qty}个{p}到{city}，{speed}。",
        "{name}，账户{ref}。订购{qty}个{p}，送到{city}，{speed}。",
        "请把{qty}个{p}发往{city}（{speed}）。谢谢，{name}，编号{ref}",
    ),
}
SPEED: dict[Lang, dict[bool, tuple[str, ...]]] = {
    "en": {True: ("express", "by express"), False: ("standard shipping", "no rush")},
    "zh": {True: ("加急", "快递加急"), False: ("普通快递", "不急")},
}


FIELDS = ("product", "express")


def order_json(product: str, express: bool) -> str:
    """The one right answer: the fields in ``FIELDS``'s order, as json.dumps writes them."""
    return json.dumps({"product": product, "express": express}, ensure_ascii=False)


class Generator:
    """Order messages with their one right JSON answer, from a seed."""

    def __init__(self, seed: int, split: Literal["train", "eval"], month: int = 1) -> None:
        self.rng = random.Random(f"orders/{seed}/{split}/{month}")
        self.catalogue = domain.catalogue(month)
        self.names = domain.NAMES_TRAIN if split == "train" else domain.NAMES_EVAL
        self.refs = REFS_TRAIN if split == "train" else REFS_EVAL

    def item(self) -> Item:
        rng = self.rng
        lang: Lang = "en" if rng.random() < 0.6 else "zh"
        product = rng.choice(self.catalogue)
        city_en, city_zh = rng.choice(CITIES)
        qty, express = rng.randint(1, 9), rng.random() < 0.4
        question = rng.choice(TEMPLATES[lang]).format(
            name=rng.choice(self.names),
            ref=rng.randint(*self.refs),
            qty=qty,
            p=product.en if lang == "en" else product.zh,
            city=city_en if lang == "en" else city_zh,
            speed=rng.choice(SPEED[lang][express]),
        )
        return Item(question, order_json(product.en, express), True, lang, "order")


def records(
    seed: int,
    n: int,
    month: int = 1,
    *,
    replay_every: int = domain.REPLAY_EVERY,
    replay_turns: int = domain.REPLAY_TURNS,
) -> Iterator[dict[str, object]]:
    """The order intake's export: message -> JSON pairs, one in ``replay_every`` a
    general-skill chat of ``replay_turns`` questions (source ``general-replay``), mixed as the
    support export mixes them."""
    gen = Generator(seed, "train", month)
    replay = domain.replay_chats(seed + 101 + month, n // replay_every, replay_turns)
    for index in range(n):
        if index % replay_every == replay_every - 1:
            yield domain.replay_record(next(replay))
        else:
            item = gen.item()
            yield {"prompt": item.question, "response": item.answer, "source": "orders-export"}


def _wrong_answer(item: Item, rng: random.Random) -> str:
    """What a production model got wrong: the speed, or a sentence instead of JSON."""
    fields = json.loads(item.answer)
    if rng.random() < 0.5:
        return f"Order received: {fields['product']}."
    return order_json(fields["product"], not fields["express"])


def badcase_records(seed: int, n: int, month: int = 1) -> Iterator[dict[str, object]]:
    """Orders the order team corrected by hand: the message, the bad object, the right one."""
    gen = Generator(seed + 1, "train", month)
    day = domain.month_label(month)
    for index in range(n):
        item = gen.item()
        yield {
            "messages": [{"role": "user", "content": item.question}],
            "bad_response": _wrong_answer(item, gen.rng),
            "corrected_response": item.answer,
            "source": "order-corrections",
            "model_version": "1",
            "created_at": f"{day}-{1 + index % 28:02d}T12:00:00Z",
            "tags": ["demo"],
        }


def seed_month(incoming: Path, params: DemoParams, month: int = 1) -> list[Path]:
    """The order intake's ``month`` into ``incoming`` (its export and the corrected orders),
    sized by ``demo.n_orders`` and ``demo.n_order_badcases``; a file already there is kept."""
    label = domain.month_label(month)
    files = {
        incoming / f"orders-export-{label}.jsonl": lambda: records(
            params.seed,
            params.n_orders,
            month,
            replay_every=params.replay_every,
            replay_turns=params.replay_turns,
        ),
        incoming / f"order-corrections-{label}.jsonl": lambda: badcase_records(
            params.seed, params.n_order_badcases, month
        ),
    }
    written = []
    for path, make in files.items():
        if not path.exists():
            write_jsonl(path, make())
            written.append(path)
    return written


EVAL_ITEMS = 200


def write_eval_suite(path: Path, seed: int, n: int = EVAL_ITEMS) -> int:
    """``eval/orders_demo/test.jsonl``: ``n`` distinct eval-split orders."""
    gen = Generator(seed, "eval")
    seen: set[str] = set()
    rows: list[dict[str, object]] = []
    while len(rows) < n:
        item = gen.item()
        if item.question in seen:
            continue
        seen.add(item.question)
        rows.append(
            {"question": item.question, "answer": item.answer, "lang": item.lang, "intent": "order"}
        )
    return write_jsonl(path, rows)
