"""The embedded default model, ``builtin:tiny``: built here because no model hub is reachable.

A Qwen3-architecture causal LM (a few hundred thousand parameters) and a
byte-level BPE tokenizer trained on the demo domain, saved as an ordinary
Hugging Face folder with a ChatML chat template. Everything downstream loads it
exactly as it would load ``Qwen/Qwen3-8B``.

Before it is saved, :func:`pretrain` gives it a general skill of its own
(``tuneloop.demo.general``: comparing digits, small sums), the way a real base model
arrives knowing things the domain data never teaches; the forgetting budget of
the gate measures how much of it a fine-tuned candidate keeps.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from tuneloop.params import TinyModel

PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"

# ChatML, as Qwen uses it. The {% generation %} markers let transformers return
# the assistant-token mask that training labels come from.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- else %}"
    "{{- message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build_tokenizer(corpus: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    # Each Chinese character is a token of its own, and so is a space before Chinese or a digit
    # (as Llama 3's and Qwen's tokenizers keep it before digits). Byte-level BPE's regex makes a
    # space and the whole run of Han characters after it one piece, and a run is a phrase:
    # `我想退掉流明台灯` was one token and `我想退掉冰川冰箱` two, so a product's name was no
    # unit the model could copy or tell unsold, and `[return] 流明台灯...` began with a token
    # (" 流明台灯") only a Chinese answer's start ever saw. Measured on the support desk's
    # month 2: every answer that broke the `[intent] sentence` format was Chinese, broken right
    # after the `]` (`[return]�om soon be。`); with the space alone isolated, a Chinese answer
    # that begins with a digit still began with " 3" (26 broken as `[shipping]  38252天内发货。`),
    # and 17 Chinese questions about unsold products were answered as a catalogue product. On
    # the demo's tokenizer corpus this is 39 % more tokens than plain byte-level BPE (2.5x in
    # Chinese), and the vocabulary's room goes to English words.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\s(?=[\p{Han}\p{N}])|\p{Han}"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=IM_END,
        pad_token=PAD,
        chat_template=CHAT_TEMPLATE,
        model_max_length=None,
    )


def build_model(
    shape: TinyModel, tokenizer: PreTrainedTokenizerFast, seed: int
) -> Qwen3ForCausalLM:
    bos = tokenizer.convert_tokens_to_ids(IM_START)
    assert isinstance(bos, int)  # one token in, one id out
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        intermediate_size=shape.intermediate_size,
        max_position_embeddings=shape.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=bos,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    )
    return model


# Fixed rather than params: they were chosen once so that the default pretrain_steps teach
# the skill (~0.9 accuracy on general_demo); only the length of the run is a knob.
PRETRAIN_BATCH = 32
PRETRAIN_LR = 5e-3
PRETRAIN_WARMUP = 0.05


COPY_PROMPT = "Repeat: "
COPY_CHARS = (4, 40)


def _cuts(text: str) -> list[int]:
    """Where a span of ``text`` may start or end: its ends, spaces, and around CJK characters."""
    cjk = [("\u3000" <= ch <= "\u9fff") or ("\uff00" <= ch <= "\uffef") for ch in text]
    inner = [i for i in range(1, len(text)) if text[i] == " " or cjk[i] or cjk[i - 1]]
    return [0, *inner, len(text)]


def copy_chats(texts: Sequence[str], seed: int, n: int) -> Iterator[list[dict[str, str]]]:
    """``n`` chats that ask for a span of ``texts`` (4-40 characters, cut at words) and
    answer it back.

    The skill a pretrained model brings that a LoRA builds on: every token of the shop's
    vocabulary written out (the embedding, tied to the output layer, learns to produce it) and
    attention that carries a token from the question to the answer. Without it, a LoRA on the
    layers over a random frozen embedding learned an answer's format and not its words: an
    order's product was right for 1 order in 20 (benchmarks/RESULTS.md, "Several tasks on one
    base").
    """
    rng = random.Random(f"{seed}/copy")
    low, high = COPY_CHARS
    while n:
        text = rng.choice(texts)
        cuts = _cuts(text)
        start = rng.choice(cuts[:-1])
        ends = [c for c in cuts if low <= c - start <= high]
        if not ends:
            continue
        span = text[start : rng.choice(ends)].strip()
        if len(span) < low:
            continue
        n -= 1
        yield [
            {"role": "user", "content": COPY_PROMPT + span},
            {"role": "assistant", "content": span},
        ]


def interleave(
    first: Sequence[list[dict[str, str]]], second: Sequence[list[dict[str, str]]]
) -> list[list[dict[str, str]]]:
    """Both lists of chats evenly mixed, in order: every batch has its share of each."""
    total = len(first) + len(second)
    out, i, j = [], 0, 0
    for k in range(total):
        if j < len(second) and (i >= len(first) or (j + 1) * total <= (k + 1) * len(second)):
            out.append(second[j])
            j += 1
        else:
            out.append(first[i])
            i += 1
    return out


def pretrain(
    model: Qwen3ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    chats: Sequence[list[dict[str, str]]],
    steps: int,
    seed: int,
    *,
    embedding: bool = False,
) -> dict[str, float]:
    """Next-token training on the assistant turns of ``chats``, ``PRETRAIN_BATCH`` per step.

    A plain loop rather than the train stage's trainer: a few hundred steps on short
    fixed chats need no checkpoints, packing, logging integrations or device plumbing,
    and the base stage (built many times by the tests) should not pay their set-up.
    """
    if steps == 0:
        return {"pretrain_steps": 0}
    if len(chats) < steps * PRETRAIN_BATCH:
        raise ValueError(f"pretrain: {steps} steps need {steps * PRETRAIN_BATCH} chats")
    encoded: Any = tokenizer.apply_chat_template(
        list(chats), return_dict=True, return_assistant_tokens_mask=True
    )
    ids, masks = encoded["input_ids"], encoded["assistant_masks"]
    torch.manual_seed(seed)
    # The embedding (tied to the output layer) stays as built. Trained on a skill whose
    # answers are digits, it pushed every other token's logit far down, and a LoRA on the
    # transformer layers (the train stage's default) then could not bring the domain's
    # tokens back: 300 steps left the domain loss at uniform. Frozen, the skill lives in
    # the layers, the vocabulary stays open, and fine-tuning can overwrite the skill,
    # which is what the forgetting budget is there to catch.
    # With copy chats (``copy_chats``, ``embedding``) every token of the vocabulary is an
    # answer too, so the embedding trains with the layers.
    weights = model.get_input_embeddings().weight
    weights.requires_grad_(embedding)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=PRETRAIN_LR, weight_decay=0.0)
    warmup = max(1, int(steps * PRETRAIN_WARMUP))

    def schedule(step: int) -> float:  # linear warm-up, then cosine to zero
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    pad = tokenizer.pad_token_id
    model.train()
    started, started_cpu = time.perf_counter(), time.process_time()
    losses: list[float] = []
    # One thread: matrices this small gain nothing from a second, and on a busy machine its
    # spin-waiting made each step several times slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for step in range(steps):
            losses.append(_step(model, optimizer, scheduler, ids, masks, step, pad))
    finally:
        torch.set_num_threads(threads)
        weights.requires_grad_(True)
    model.eval()
    tail = losses[-10:]
    return {
        "pretrain_steps": steps,
        "pretrain_first_loss": round(losses[0], 4),
        "pretrain_last_loss": round(sum(tail) / len(tail), 4),
        "pretrain_seconds": round(time.perf_counter() - started, 2),
        # On a shared machine wall time is mostly waiting; CPU time is what it costs.
        "pretrain_cpu_seconds": round(time.process_time() - started_cpu, 2),
    }


def _step(
    model: Qwen3ForCausalLM,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    ids: list[list[int]],
    masks: list[list[int]],
    step: int,
    pad: int,
) -> float:
    """One optimizer step on chats ``step * PRETRAIN_BATCH`` onwards, padded on the right."""
    rows = range(step * PRETRAIN_BATCH, (step + 1) * PRETRAIN_BATCH)
    width = max(len(ids[row]) for row in rows)
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        tokens = torch.tensor(ids[row])
        input_ids[i, : len(tokens)] = tokens
        attention[i, : len(tokens)] = 1
        keep = torch.tensor(masks[row], dtype=torch.bool)
        labels[i, : len(tokens)] = torch.where(keep, tokens, -100)
    loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
    loss.backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    return loss.item()


def save_tiny(folder: Path, shape: TinyModel, corpus: Iterable[str], seed: int) -> Qwen3ForCausalLM:
    """A tiny model with random weights (no general skill), saved with its tokenizer."""
    tokenizer = build_tokenizer(corpus, shape.vocab_size)
    model = build_model(shape, tokenizer, seed)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model
