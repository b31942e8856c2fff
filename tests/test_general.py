"""The embedded model's general skill: its generator, its committed suite, its pre-training.

Whether pre-training at the default size gives the base the skill (well above chance) is
measured on the real path in tests/test_evaluate.py.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from tests.helpers import ROOT
from tuneloop.demo import domain, general, tiny
from tuneloop.io import read_jsonl
from tuneloop.params import load_params

# The fast tier: no pipeline, server or rank.
pytestmark = pytest.mark.fast


def test_the_committed_suites_are_what_the_generators_write(tmp_path: Path) -> None:
    general.write_suite(tmp_path / "general.jsonl")
    assert (tmp_path / "general.jsonl").read_bytes() == (
        ROOT / "eval/general_demo/test.jsonl"
    ).read_bytes()
    params = load_params(ROOT / "params.yaml")
    domain.write_eval_suite(tmp_path / "support.jsonl", params.demo.seed)
    assert (tmp_path / "support.jsonl").read_bytes() == (
        ROOT / "eval/support_demo/test.jsonl"
    ).read_bytes()
    # The demo suite's slice labels: every item has an intent and a language.
    items = list(read_jsonl(ROOT / "eval/support_demo/test.jsonl"))
    assert {item["lang"] for item in items} == {"en", "zh"}
    assert {item["intent"] for item in items} == {"return", "warranty", "shipping", "unknown"}


def test_train_and_eval_questions_are_disjoint_and_answers_right() -> None:
    train, held_out = general.items("train"), general.items("eval")
    assert not {i.question for i in train} & {i.question for i in held_out}
    assert len(held_out) == 163 and {i.skill for i in held_out} == set(general.SKILLS)
    for item in held_out:
        a, b = (int(c) for c in item.question if c.isdigit())
        expected = {"bigger": max(a, b), "smaller": min(a, b), "sum": a + b}[item.skill]
        assert item.answer.endswith(f" {expected}."), item
    chats = list(general.train_chats(0, 50))
    assert chats == list(general.train_chats(0, 50))  # seeded
    assert all(chat[0]["content"] in {i.question for i in train} for chat in chats)


def test_the_demos_two_question_replay_stays_clear_of_the_general_suite() -> None:
    params = load_params(ROOT / "params.yaml").demo
    assert (params.replay_every, params.replay_turns) == (3, 2)  # what the demo ships
    records = list(domain.support_records(0, 300, replay_every=params.replay_every, replay_turns=2))
    replay = [r for r in records if r["source"] == "general-replay"]
    assert len(replay) == 100 and all(len(r["messages"]) == 4 for r in replay)  # type: ignore[arg-type]
    asked = {m["content"] for r in replay for m in r["messages"] if m["role"] == "user"}  # type: ignore[attr-defined]
    allowed = {item.question for item in domain.replay_items()}
    assert asked <= allowed and len(allowed) == len(general.items("train")) == 777
    # Every phrasing is replayed: a phrasing the replay never asks is the one the candidate forgets.
    phrasings = {t.format(a="", b="") for skill in general.SKILLS for t in general.TEMPLATES[skill]}
    asked_phrasings = {"".join(c for c in q if not c.isdigit()) for q in asked}
    assert asked_phrasings == phrasings
    # Decontaminated where the replay is made: none of them within clean's threshold of a
    # general_demo question, so clean does not drop a two-question chat for one of its halves.
    threshold = load_params(ROOT / "params.yaml").clean.decontam_threshold
    held_out = [domain._shingles(item.question) for item in general.items("eval")]
    for question in asked:
        mine = domain._shingles(question)
        assert max(len(mine & o) / len(mine | o) for o in held_out) < min(0.7, threshold - 0.1)
    # Seeded, and distinct chats where single questions would repeat.
    again = list(domain.support_records(0, 300, replay_every=3, replay_turns=2))
    assert again == records
    assert len({str(r["messages"]) for r in replay}) == len(replay)


@pytest.mark.usefixtures("one_torch_thread")
def test_pretraining_trains_the_layers_and_keeps_the_embedding() -> None:
    shape = load_params(ROOT / "params.yaml").model.tiny.model_copy(
        update={"hidden_size": 64, "head_dim": 16, "intermediate_size": 128, "vocab_size": 600}
    )
    corpus = itertools.chain(general.corpus(), (domain.REFUSAL["en"],))
    tokenizer = tiny.build_tokenizer(corpus, shape.vocab_size)
    model = tiny.build_model(shape, tokenizer, seed=0)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    assert tiny.pretrain(model, tokenizer, [], 0, seed=0) == {"pretrain_steps": 0}
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())

    steps = 40
    chats = list(general.train_chats(0, steps * tiny.PRETRAIN_BATCH))
    metrics = tiny.pretrain(model, tokenizer, chats, steps, seed=0)
    assert metrics["pretrain_steps"] == steps
    assert metrics["pretrain_last_loss"] < metrics["pretrain_first_loss"] - 0.5
    # The layers learn; the embedding (tied to the output layer) stays as built.
    changed = {n for n, p in model.named_parameters() if not torch.equal(before[n], p)}
    assert changed == set(before) - {"model.embed_tokens.weight"}
    with pytest.raises(ValueError, match="need 1312 chats"):
        tiny.pretrain(model, tokenizer, chats, steps + 1, seed=0)


def test_copy_chats_repeat_a_span_of_a_message_and_train_the_embedding() -> None:
    texts = ["Please ship 2 x Zephyr fan to Oslo, express.", "请把2个极光水壶发往东京（加急）。"]
    chats = list(tiny.copy_chats(texts, seed=0, n=200))
    assert len(chats) == 200
    for user, assistant in chats:
        span = assistant["content"]
        assert user["content"] == tiny.COPY_PROMPT + span
        assert any(span in text for text in texts)
        assert tiny.COPY_CHARS[0] <= len(span) <= tiny.COPY_CHARS[1]
    # Latin text is cut at words, Chinese at characters.
    latin = [a["content"] for _, a in chats if a["content"].isascii()]
    assert latin and all(f" {s} " in f" {texts[0]} " for s in latin)
    # Mixed evenly: every batch holds its share of each kind, in order.
    mixed = tiny.interleave(list(range(6)), ["a", "b"])  # type: ignore[arg-type]
    assert mixed == [0, 1, 2, "a", 3, 4, 5, "b"]

    shape = load_params(ROOT / "params.yaml").model.tiny.model_copy(
        update={"hidden_size": 64, "head_dim": 16, "intermediate_size": 128, "vocab_size": 600}
    )
    tokenizer = tiny.build_tokenizer(iter(texts), shape.vocab_size)
    model = tiny.build_model(shape, tokenizer, seed=0)
    before = model.get_input_embeddings().weight.detach().clone()
    tiny.pretrain(model, tokenizer, chats[:64], 2, seed=0, embedding=True)
    assert not torch.equal(before, model.get_input_embeddings().weight)
