"""Chat samples into token ids and labels, with the model's own chat template.

Labels are the assistant turns only (-100 elsewhere). The assistant spans are
found on the rendered text, by rendering each prefix of the conversation with
the same template, and mapped to tokens through the tokenizer's offsets. That
works for any template, with or without ``{% generation %}`` markers (most
released chat templates have none), and it checks the property it relies on:
rendering is prefix-stable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from transformers.tokenization_utils_base import PreTrainedTokenizerBase

IGNORE = -100


class TemplateError(ValueError):
    """The chat template cannot be used for assistant-only labels."""


@dataclass(frozen=True)
class Tokenized:
    input_ids: list[int]
    labels: list[int]


def render(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], **kwargs: Any
) -> str:
    text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    assert isinstance(text, str)  # tokenize=False always returns text
    return text


def assistant_spans(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]]
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant replies."""
    full = render(tokenizer, messages)
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = render(tokenizer, messages[:index], add_generation_prompt=True)
        upto = render(tokenizer, messages[: index + 1])
        if not (full.startswith(prompt) and full.startswith(upto) and upto.startswith(prompt)):
            raise TemplateError(
                "the chat template does not render conversations prefix-stably (turn "
                f"{index} renders differently once later turns follow), so assistant tokens "
                "cannot be located; use a template without history rewriting"
            )
        end = len(upto.rstrip())  # the reply and its end-of-turn token, not the newline after
        spans.append((len(prompt), end))
    return full, spans


def tokenize_chat(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]]) -> Tokenized:
    text, spans = assistant_spans(tokenizer, messages)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    input_ids: list[int] = encoded["input_ids"]
    labels = [IGNORE] * len(input_ids)
    for position, (start, end) in enumerate(encoded["offset_mapping"]):
        if any(s <= start and end <= e and end > start for s, e in spans):
            labels[position] = input_ids[position]
    return Tokenized(input_ids, labels)
