"""The embedded model's general skill: comparing two digits and adding small numbers.

``builtin:tiny`` learns this in the base stage, before it sees any domain data, so
that the forgetting budget (``gate.max_forgetting``) is measured for real on the
demo: ``eval/general_demo`` scores how much of the skill a fine-tuned candidate
kept. A real base model brings its general skills with it and is scored on
standard lm-eval tasks instead (``evaluate.general_suites``).

Three skills, each asked in four phrasings, answered with a short sentence that ends in
the number (``The larger is 8.``); the suite scores the last number of the reply:

- ``bigger`` / ``smaller``: the larger (smaller) of two different digits; a reply
  that picks one of the two at random is right half the time;
- ``sum``: two digits whose sum is at most 9; a random digit is right one time in ten.

Train and eval are disjoint by question text: a question belongs to the eval split
when its CRC32 falls in the eval share, so the suite asks phrasings of digit pairs the
model never saw written that way.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from tuneloop.io import write_jsonl

Skill = Literal["bigger", "smaller", "sum"]
SKILLS: tuple[Skill, ...] = ("bigger", "smaller", "sum")
# Each digit sits inside its question, with words on both sides, and the questions are short.
# Clean's decontamination measures near-duplicates by character 5-grams: a digit at either end
# of a long question is in one or two of them, so a train question one digit away from a held-out
# one looked like a copy of it (0.76-0.92), was dropped from the replay, and its phrasing was
# forgotten. Written this way, no train question comes within 0.67 of a held-out one
# (tests/test_general.py), and every one of them may be replayed.
TEMPLATES: dict[Skill, tuple[str, ...]] = {
    "bigger": (
        "Is {a} or {b} larger?",
        "Of {a} and {b}, which is more?",
        "Which of {a} and {b} is bigger?",
        "Between {a} and {b}, the larger?",
    ),
    "smaller": (
        "Is {a} or {b} smaller?",
        "Of {a} and {b}, which is less?",
        "Which of {a} and {b} is smaller?",
        "Between {a} and {b}, the smaller?",
    ),
    "sum": (
        "Add {a} and {b}, please.",
        "What is {a} plus {b} in total?",
        "The sum of {a} and {b} is?",
        "Work out {a} + {b} for me.",
    ),
}
EVAL_SHARE = 5  # one question in five is held out for the suite


@dataclass(frozen=True)
class Item:
    question: str
    answer: str
    skill: Skill


def _pairs(skill: Skill) -> list[tuple[int, int]]:
    if skill == "sum":
        return [(a, b) for a in range(10) for b in range(10 - a)]
    return [(a, b) for a in range(10) for b in range(10) if a != b]


REPLIES: dict[Skill, str] = {
    "bigger": "The larger is {n}.",
    "smaller": "The smaller is {n}.",
    "sum": "The sum is {n}.",
}


def _answer(skill: Skill, a: int, b: int) -> str:
    number = {"bigger": max(a, b), "smaller": min(a, b), "sum": a + b}[skill]
    return REPLIES[skill].format(n=number)


def split_of(question: str) -> Literal["train", "eval"]:
    return "eval" if zlib.crc32(question.encode()) % EVAL_SHARE == 0 else "train"


def all_items() -> list[Item]:
    """Every question of every skill, in a fixed order."""
    return [
        Item(template.format(a=a, b=b), _answer(skill, a, b), skill)
        for skill in SKILLS
        for template in TEMPLATES[skill]
        for a, b in _pairs(skill)
    ]


def items(split: Literal["train", "eval"]) -> list[Item]:
    return [item for item in all_items() if split_of(item.question) == split]


def train_chats(seed: int, n: int) -> Iterator[list[dict[str, str]]]:
    """``n`` chats drawn at random (with replacement) from the train split."""
    pool = items("train")
    rng = random.Random(f"{seed}/general")
    for _ in range(n):
        item = rng.choice(pool)
        yield [
            {"role": "user", "content": item.question},
            {"role": "assistant", "content": item.answer},
        ]


def corpus() -> Iterator[str]:
    """Text for the tiny model's tokenizer: every phrasing and answer of the skill."""
    for item in all_items():
        yield f"{item.question} {item.answer}"


def write_suite(path: Path) -> int:
    """The general_demo suite's test.jsonl: every eval-split question, with its skill."""
    return write_jsonl(
        path,
        (
            {"question": item.question, "answer": item.answer, "skill": item.skill}
            for item in items("eval")
        ),
    )
