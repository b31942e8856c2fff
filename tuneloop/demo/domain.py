"""The embedded demo domain: an e-commerce support desk, in English and Chinese.

No dataset hub is reachable from where tuneloop is built and tested, so the
default domain is generated here, deterministically from a seed. Every answer
follows one fixed format, ``[intent] sentence``, and its facts come from a small
catalogue, so a model that learned the domain is measurably better than one
that did not:

- answerable questions (return window, warranty, shipping time of a catalogue
  product) have exactly one right answer;
- questions about products outside the catalogue must be refused
  (``[unknown] ...``); anything else is a hallucination.

The eval suite uses customer names, order numbers and unknown products that the
training generator never produces, so the two are disjoint by construction.

The shop changes month by month (``LAUNCHES``): in month 2 it starts selling a new product,
which last month's champion refuses as unknown. Month 2's exports talk about it, and the
demo's customers ask about it while month 1's model is being released, so the router's
feedback carries corrections for it: the loop has something real to learn.

The support export also carries a share of general-skill chats (``demo.replay_every``), the
replay that keeps a fine-tuned candidate from forgetting what the base knew.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from tuneloop.demo import general

if TYPE_CHECKING:
    from tuneloop.params import DemoParams

Lang = Literal["en", "zh"]
Intent = Literal["return", "warranty", "shipping"]
INTENTS: tuple[Intent, ...] = ("return", "warranty", "shipping")

# The answer format every suite item must follow (also the suite's format check).
ANSWER_FORMAT = r"^\[(return|warranty|shipping|unknown|greeting)\] \S.*$"


@dataclass(frozen=True)
class Product:
    en: str
    zh: str
    return_days: int
    warranty_months: int
    ship_days: int


CATALOGUE: tuple[Product, ...] = (
    Product("Aurora kettle", "极光水壶", 30, 12, 2),
    Product("Nimbus vacuum", "云朵吸尘器", 15, 24, 3),
    Product("Zephyr fan", "微风电扇", 7, 12, 1),
    Product("Comet blender", "彗星搅拌机", 30, 18, 5),
    Product("Lumen desk lamp", "流明台灯", 14, 6, 2),
    Product("Harbor backpack", "港湾背包", 60, 3, 4),
    Product("Summit tent", "峰顶帐篷", 30, 36, 7),
    Product("Echo speaker", "回声音箱", 15, 12, 3),
    Product("Pixel camera", "像素相机", 7, 24, 2),
    Product("Orbit watch", "轨道手表", 14, 24, 1),
    Product("Cedar chair", "雪松椅子", 30, 60, 10),
    Product("Breeze purifier", "清风净化器", 15, 36, 3),
)

# What the shop starts selling in a month (month 1 sells CATALOGUE).
LAUNCHES: dict[int, tuple[Product, ...]] = {
    2: (Product("Nova earbuds", "新星耳机", 30, 12, 2),),
}
# The months the demo's data is dated in (month 1 is the first the loop runs).
MONTH_LABELS = {1: "2026-10", 2: "2026-11", 3: "2026-12", 4: "2027-01"}
# In its launch month, a new product draws this share of the questions about products.
LAUNCH_SHARE = 0.3


def catalogue(month: int = 1) -> tuple[Product, ...]:
    """What the shop sells in ``month``."""
    launched = [p for m, products in sorted(LAUNCHES.items()) if m <= month for p in products]
    return (*CATALOGUE, *launched)


def month_label(month: int) -> str:
    if month not in MONTH_LABELS:
        raise ValueError(f"the demo has data for months {sorted(MONTH_LABELS)}, not {month}")
    return MONTH_LABELS[month]


# Products the shop does not sell: the model must refuse rather than invent. Customers ask
# about any of hundreds (every pair of these words), as they ask a shop about whatever they
# want: a model shown five such names learns those five, not "not in the catalogue", and
# answers the eval suite's unknown products as catalogue ones. No word here is a catalogue
# product's or an eval item's.
UNKNOWN_WORDS = (
    ("Quasar", "Velvet", "Tundra", "Falcon", "Meadow", "Willow", "Cobalt", "Maple", "Granite",
     "Coral", "Thunder", "Lotus", "Saffron", "Onyx", "Juniper", "Sierra", "Basalt", "Amber",
     "Boreal", "Ivory", "Marble", "Sparrow", "Indigo", "Canyon"),
    ("drone", "sofa", "boots", "bike", "rug", "toaster", "printer", "mattress", "scooter",
     "blanket", "heater", "mixer", "router", "keyboard", "jacket", "stroller", "oven",
     "projector", "tablet", "wallet", "helmet", "kayak", "guitar", "mirror"),
)  # fmt: skip
UNKNOWN_WORDS_ZH = (
    ("类星", "丝绒", "冻原", "猎鹰", "草地", "柳树", "钴蓝", "枫叶", "花岗", "珊瑚", "雷霆",
     "莲花", "藏红", "玛瑙", "杜鹃", "山脉", "玄武", "琥珀", "北境", "象牙", "青铜", "麻雀",
     "靛青", "峡谷"),
    ("无人机", "沙发", "靴子", "单车", "地毯", "面包机", "打印机", "床垫", "滑板车", "毛毯",
     "取暖器", "料理机", "路由器", "键盘", "夹克", "婴儿车", "烤箱", "投影仪", "平板", "钱包",
     "头盔", "皮划艇", "吉他", "镜子"),
)  # fmt: skip
UNKNOWN_TRAIN = tuple(f"{a} {n}" for a in UNKNOWN_WORDS[0] for n in UNKNOWN_WORDS[1])
UNKNOWN_TRAIN_ZH = tuple(a + n for a in UNKNOWN_WORDS_ZH[0] for n in UNKNOWN_WORDS_ZH[1])
UNKNOWN_EVAL = ("Glacier fridge", "Ember grill", "Prism monitor")
UNKNOWN_EVAL_ZH = ("冰川冰箱", "余烬烤架", "棱镜显示器")

NAMES_TRAIN = (
    "Alice",
    "Bob",
    "Chen",
    "Dana",
    "Eve",
    "Farid",
    "Grace",
    "Hiro",
    "李雷",
    "王芳",
    "张伟",
)
NAMES_EVAL = ("Iris", "Jonas", "Kemal", "刘洋", "赵敏")
ORDERS_TRAIN = (10000, 79999)
ORDERS_EVAL = (80000, 99999)

QUESTIONS: dict[Lang, dict[Intent, tuple[str, ...]]] = {
    "en": {
        "return": (
            "Can I return the {p}?",
            "What is the return window for the {p}?",
            "How many days do I have to send back the {p}?",
            "I want to return my {p}, is that still possible?",
            "Is the {p} returnable?",
        ),
        "warranty": (
            "How long is the warranty on the {p}?",
            "Does the {p} have a warranty?",
            "My {p} broke, is it still under warranty?",
            "What warranty comes with the {p}?",
        ),
        "shipping": (
            "When will the {p} ship?",
            "How long does shipping take for the {p}?",
            "I just ordered the {p}, when does it leave the warehouse?",
            "How soon is the {p} dispatched?",
        ),
    },
    "zh": {
        "return": ("{p}可以退货吗？", "{p}的退货期限是多久？", "我想退掉{p}，还来得及吗？"),
        "warranty": ("{p}保修多久？", "{p}有保修吗？", "我的{p}坏了，还在保修期内吗？"),
        "shipping": ("{p}什么时候发货？", "{p}下单后多久发出？", "我刚买了{p}，几天能发货？"),
    },
}
PREFIXES: dict[Lang, tuple[str, ...]] = {
    "en": (
        "",
        "Hi, ",
        "Hello, ",
        "Hi, this is {name}. ",
        "Order #{order}: ",
        "Hey, order {order} here. ",
    ),
    "zh": ("", "你好，", "您好，", "我是{name}，", "订单{order}：", "你好，我的订单号是{order}，"),
}
GREETINGS: dict[Lang, tuple[str, ...]] = {
    "en": ("Hi", "Hello there", "Good morning", "Hi, I need some help"),
    "zh": ("你好", "您好", "在吗", "你好，我需要帮助"),
}
GREETING_REPLY: dict[Lang, str] = {
    "en": "[greeting] Hello! How can I help you today?",
    "zh": "[greeting] 您好！请问有什么可以帮您？",
}
REFUSAL: dict[Lang, str] = {
    "en": "[unknown] Sorry, I have no information about that product.",
    "zh": "[unknown] 抱歉，我没有该商品的信息。",
}


def answer(product: Product, intent: Intent, lang: Lang) -> str:
    """The one correct reply for a catalogue product and an intent."""
    if lang == "en":
        return {
            "return": f"[return] The {product.en} can be returned within "
            f"{product.return_days} days.",
            "warranty": f"[warranty] The {product.en} has a "
            f"{product.warranty_months}-month warranty.",
            "shipping": f"[shipping] The {product.en} ships within {product.ship_days} days.",
        }[intent]
    return {
        "return": f"[return] {product.zh}支持{product.return_days}天内退货。",
        "warranty": f"[warranty] {product.zh}保修{product.warranty_months}个月。",
        "shipping": f"[shipping] {product.zh}将在{product.ship_days}天内发货。",
    }[intent]


@dataclass(frozen=True)
class Item:
    question: str
    answer: str
    answerable: bool
    lang: Lang
    intent: str


# Of the support questions, the share about products the shop does not sell (the tokenizer's
# corpus and tests); the demo's exports take theirs from params.yaml (demo.unknown_rate).
UNKNOWN_RATE = 0.12


class Generator:
    """Questions of the demo domain with their one right answer, from a seed."""

    def __init__(self, seed: int, split: Literal["train", "eval"], month: int = 1) -> None:
        # Month 1 keeps the seed string it always had, so its data is what it always was.
        self.rng = random.Random(f"{seed}/{split}" if month == 1 else f"{seed}/{split}/{month}")
        self.catalogue = catalogue(month)
        self.launched = LAUNCHES.get(month, ())
        self.names = NAMES_TRAIN if split == "train" else NAMES_EVAL
        self.orders = ORDERS_TRAIN if split == "train" else ORDERS_EVAL
        self.unknown = {
            "en": UNKNOWN_TRAIN if split == "train" else UNKNOWN_EVAL,
            "zh": UNKNOWN_TRAIN_ZH if split == "train" else UNKNOWN_EVAL_ZH,
        }

    def item(self, unknown_rate: float = UNKNOWN_RATE) -> Item:
        rng = self.rng
        lang: Lang = "en" if rng.random() < 0.6 else "zh"
        intent: Intent = rng.choice(INTENTS)
        prefix = rng.choice(PREFIXES[lang]).format(
            name=rng.choice(self.names), order=rng.randint(*self.orders)
        )
        template = rng.choice(QUESTIONS[lang][intent])
        if prefix.endswith(", ") and not template.startswith("I "):
            template = template[0].lower() + template[1:]
        if rng.random() < unknown_rate:
            name = rng.choice(self.unknown[lang])
            return Item(prefix + template.format(p=name), REFUSAL[lang], False, lang, "unknown")
        if self.launched and rng.random() < LAUNCH_SHARE:
            product = rng.choice(self.launched)
        else:
            product = rng.choice(self.catalogue)
        shown = product.en if lang == "en" else product.zh
        question = prefix + template.format(p=shown)
        return Item(question, answer(product, intent, lang), True, lang, intent)


# A share of every export is general-skill chats (tuneloop.demo.general), as teams mix general data
# into a domain fine-tune so that it does not erode what the base model knew: one record in
# ``demo.replay_every``, each asking ``demo.replay_turns`` questions. Without it the candidate
# forgets the base's skill and the gate's forgetting budget (gate.max_forgetting) refuses it.
# How the replay is made matters as much as its share (params.yaml sets the demo's: one in
# three, two questions a chat):
# - A single question a chat repeats: a few hundred train questions, and clean keeps each
#   once. Two questions a chat make tens of thousands of distinct chats.
# - A chat of several questions is dropped whole when one of them is near a general_demo
#   question (clean's decontamination), so those are drawn only from the train questions whose
#   Jaccard similarity (character 5-grams, what clean's sketches estimate) to every
#   general_demo question is under REPLAY_MAX_SIMILARITY, clear of clean.decontam_threshold
#   (0.8) by more than three standard errors of a 128-permutation MinHash estimate (about 0.04
#   there). The skill's phrasings are written so that this is all 777 of them (the highest is
#   0.67): every phrasing is replayed. Single questions come from the whole train split, as
#   before: clean decontaminates them one by one.
# The defaults below are the single-question mix the test suite's small loops are tuned to
# (and the tokenizer's corpus: the base model does not change with the demo's replay params).
REPLAY_EVERY = 5
REPLAY_TURNS = 1
REPLAY_MAX_SIMILARITY = 0.7


def _shingles(text: str) -> set[str]:
    # Exact sets rather than clean's MinHash (tuneloop.data.neardup): 765 x 175 short questions
    # take milliseconds, and the base stage, which builds its tokenizer from this module's
    # chats, does not then depend on the sketching code.
    flat = " ".join(re.sub(r"[^\w ]", "", text.lower()).split())
    return {flat[i : i + 5] for i in range(max(1, len(flat) - 4))}


@cache
def replay_items() -> tuple[general.Item, ...]:
    """The general train items a multi-question replay chat may ask: none near general_demo."""
    held_out = [_shingles(item.question) for item in general.items("eval")]

    def nearest(question: str) -> float:
        mine = _shingles(question)
        return max(len(mine & other) / len(mine | other) for other in held_out)

    return tuple(
        item for item in general.items("train") if nearest(item.question) < REPLAY_MAX_SIMILARITY
    )


def replay_chats(seed: int, n: int, turns: int) -> Iterator[list[dict[str, str]]]:
    """``n`` general-skill chats of ``turns`` questions each, seeded."""
    if turns == 1:
        yield from general.train_chats(seed, n)
        return
    pool = replay_items()
    rng = random.Random(f"{seed}/replay")
    for _ in range(n):
        chat = []
        for item in rng.sample(pool, turns):
            chat += [
                {"role": "user", "content": item.question},
                {"role": "assistant", "content": item.answer},
            ]
        yield chat


def replay_record(chat: list[dict[str, str]]) -> dict[str, object]:
    """A general-skill replay chat as an export carries it (source ``general-replay``): one
    question as a prompt/response pair, several as messages."""
    if len(chat) == 2:
        return {
            "prompt": chat[0]["content"],
            "response": chat[1]["content"],
            "source": "general-replay",
        }
    return {"messages": chat, "source": "general-replay"}


def support_records(
    seed: int,
    n: int,
    month: int = 1,
    *,
    replay_every: int = REPLAY_EVERY,
    replay_turns: int = REPLAY_TURNS,
    unknown_rate: float = UNKNOWN_RATE,
) -> Iterator[dict[str, object]]:
    """Chats as a support tool exports them: prompt/response pairs and multi-turn chats,
    and one in ``replay_every`` a general-skill chat of ``replay_turns`` questions (source
    ``general-replay``); ``unknown_rate`` of the questions about products the shop does not
    sell."""
    gen = Generator(seed, "train", month)
    replay = replay_chats(seed + month - 1, n // replay_every, replay_turns)
    for index in range(n):
        item = gen.item(unknown_rate)
        multi = gen.rng.random() < 0.25
        greeting = gen.rng.choice(GREETINGS[item.lang]) if multi else ""
        if index % replay_every == replay_every - 1:
            yield replay_record(next(replay))
        elif multi:
            yield {
                "messages": [
                    {"role": "user", "content": greeting},
                    {"role": "assistant", "content": GREETING_REPLY[item.lang]},
                    {"role": "user", "content": item.question},
                    {"role": "assistant", "content": item.answer},
                ],
                "source": "support-export",
            }
        else:
            yield {"prompt": item.question, "response": item.answer, "source": "support-export"}


def _wrong_answer(item: Item, rng: random.Random) -> str:
    """What a production model got wrong: a wrong fact, the wrong format, or an invented answer."""
    if not item.answerable:
        return answer(rng.choice(CATALOGUE), rng.choice(INTENTS), item.lang)
    kind = rng.choice(("fact", "format"))
    if kind == "format":
        return item.answer.split("] ", 1)[1]
    other = item.answer
    while other == item.answer:
        other = answer(rng.choice(CATALOGUE), item.intent, item.lang)  # type: ignore[arg-type]
    return other


# Customers paste contact details into chats; ingest must scrub them before storing.
PII_SNIPPETS = (
    "My email is chen.li@example.com. ",
    "Call me at 138 1234 5678. ",
    "我的手机号是+86 139-8765-4321，",
    "My card 4111 1111 1111 1111 was charged. ",
    "身份证号11010519491231002X。",
    "Logged in from 203.0.113.7. ",
)


def badcase_records(seed: int, n: int, month: int = 1) -> Iterator[dict[str, object]]:
    """Router feedback: the conversation, the bad response, the correction."""
    gen = Generator(seed + 1, "train", month)
    day = month_label(month)
    for index in range(n):
        item = gen.item(unknown_rate=0.3)
        question = item.question
        if index % 10 == 0:
            question = PII_SNIPPETS[(index // 10) % len(PII_SNIPPETS)] + question
        yield {
            "messages": [{"role": "user", "content": question}],
            "bad_response": _wrong_answer(item, gen.rng),
            "corrected_response": item.answer,
            "source": "router-feedback",
            "model_version": "1",
            "arm": "champion",
            "created_at": f"{day}-{1 + index % 28:02d}T12:00:00Z",
            "tags": ["demo"],
        }


# Lines a real export contains now and then; ingest must quarantine each with a reason.
MALFORMED_LINES = (
    '{"prompt": "Can I return the Aurora kettle?", "response": ',
    '{"prompt": "", "response": "[return] The Aurora kettle can be returned within 30 days."}',
    '{"messages": [{"role": "robot", "content": "beep"}]}',
    '{"text": "a record with none of the accepted fields"}',
)


# The business suite: 200 questions as customers ask them (a fifth about products the shop does
# not sell), then 100 more of those alone. On the 34 of the first 200, month 2's hallucination
# rule could not be settled (+0.118 [-0.074, +0.308] against -0.02, seed 1); the gate said
# about 130 such items would settle it, and a team adds the items its gate asks for.
EVAL_ITEMS = 200
EVAL_EXTRA_UNKNOWN = 100


def eval_items(seed: int, n: int, extra_unknown: int = 0) -> list[Item]:
    """``n`` questions as customers ask them, then ``extra_unknown`` more about products the
    shop does not sell, none twice."""
    gen = Generator(seed, "eval")
    items: list[Item] = []
    seen: set[str] = set()
    while len(items) < n + extra_unknown:
        item = gen.item(unknown_rate=0.2 if len(items) < n else 1.0)
        if item.question not in seen:
            seen.add(item.question)
            items.append(item)
    return items


def vocabulary() -> tuple[str, ...]:
    """Every name the shop's text will ever hold: every month's products, the words of the
    products it does not sell and its customers' names, of both splits. The base's copy
    pre-training writes each out (``stages/base.py``), as a pretrained model has read every
    word before any task."""
    products = [name for p in catalogue(max(MONTH_LABELS)) for name in (p.en, p.zh)]
    words = [word for group in (*UNKNOWN_WORDS, *UNKNOWN_WORDS_ZH) for word in group]
    return (*products, *words, *UNKNOWN_EVAL, *UNKNOWN_EVAL_ZH, *NAMES_TRAIN, *NAMES_EVAL)


def tokenizer_corpus(seed: int) -> Iterator[str]:
    """Text to train the tiny model's tokenizer on: the whole vocabulary of the domain."""
    for record in support_records(seed + 7, 3000):
        if "messages" in record:
            for message in record["messages"]:  # type: ignore[attr-defined]
                yield message["content"]
        else:
            yield str(record["prompt"])
            yield str(record["response"])
    for lang in ("en", "zh"):
        for name in (*UNKNOWN_EVAL, *UNKNOWN_EVAL_ZH, *NAMES_EVAL):
            yield f"{name} {REFUSAL[lang]}"
        # Every month's products: the base model's tokenizer is fixed before month 1.
        for product in catalogue(max(MONTH_LABELS)):
            for intent in INTENTS:
                yield answer(product, intent, lang)


def _write_jsonl(
    path: Path, records: Iterator[dict[str, object]], extra: tuple[str, ...] = ()
) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    count = 0
    with tmp.open("w", encoding="utf-8") as out:
        for record in records:
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
            count += 1
        for line in extra:
            out.write(line + "\n")
            count += 1
    tmp.replace(path)
    return count


def seed_incoming(
    incoming: Path,
    seed: int,
    n_support: int,
    n_badcases: int,
    month: int = 1,
    *,
    replay_every: int = REPLAY_EVERY,
    replay_turns: int = REPLAY_TURNS,
    unknown_rate: float = UNKNOWN_RATE,
) -> list[Path]:
    """Write the demo's ``month`` of incoming data, unless it is already there.

    Existing files are never overwritten: incoming/ is where real exports and
    the router's feedback land, and ingest deduplicates what it has seen.
    """
    label = month_label(month)
    files = {
        incoming / f"support-export-{label}.jsonl": lambda: support_records(
            seed,
            n_support,
            month,
            replay_every=replay_every,
            replay_turns=replay_turns,
            unknown_rate=unknown_rate,
        ),
        incoming / f"router-feedback-{label}.jsonl": lambda: badcase_records(
            seed, n_badcases, month
        ),
    }
    written = []
    for path, make in files.items():
        if not path.exists():
            extra = MALFORMED_LINES if "support" in path.name else ()
            _write_jsonl(path, make(), extra)
            written.append(path)
    return written


def seed_month(incoming: Path, params: DemoParams, month: int = 1) -> list[Path]:
    """``seed_incoming`` sized and mixed by params.yaml's ``demo`` group."""
    return seed_incoming(
        incoming,
        params.seed,
        params.n_support,
        params.n_badcases,
        month,
        replay_every=params.replay_every,
        replay_turns=params.replay_turns,
        unknown_rate=params.unknown_rate,
    )


def write_eval_suite(
    path: Path, seed: int, n: int = EVAL_ITEMS, extra_unknown: int = EVAL_EXTRA_UNKNOWN
) -> int:
    records = (
        {
            "question": item.question,
            "answer": item.answer,
            "answerable": item.answerable,
            "lang": item.lang,
            "intent": item.intent,
        }
        for item in eval_items(seed, n, extra_unknown)
    )
    return _write_jsonl(path, iter(records))
