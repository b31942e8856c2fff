"""ChatTokenizer renders and encodes exactly as the transformers tokenizer of the same folder.

The data stages use ChatTokenizer (no transformers import); training, preflight and serving
use transformers. Both must turn a chat into the same text, ids, offsets and labels, for
the tiny model's ChatML template and for a template that uses what real ones use (a system
turn, special-token variables, loop controls, raise_exception, filters).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tuneloop.data.chat import (
    ChatTokenizer,
    TokenizerFilesError,
    assistant_spans,
    load_chat_tokenizer,
    render,
    tokenize_chat,
    tokenize_chats,
)
from tuneloop.demo import domain, tiny
from tuneloop.models import load_tokenizer

# The fast tier: no pipeline, server or rank.
pytestmark = pytest.mark.fast

RICH_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{ bos_token }}<|im_start|>system\n{{ messages[0]['content'] | trim }}<|im_end|>\n"
    "{%- set loop_messages = messages[1:] %}"
    "{%- else %}{%- set loop_messages = messages %}{%- endif %}\n"
    "{%- for message in loop_messages %}\n"
    "  {%- if message['role'] not in ['user', 'assistant'] %}"
    "{{ raise_exception('roles must be user or assistant') }}{%- endif %}\n"
    "  {%- if loop.index0 > 40 %}{% break %}{% endif %}\n"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}\n"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    "{{- '' if not tools else tools | tojson }}"
)


def conversations() -> list[list[dict[str, str]]]:
    chats: list[list[dict[str, str]]] = []
    for record in domain.support_records(3, 60):
        if "messages" in record:
            chats.append(record["messages"])  # type: ignore[arg-type]
        else:
            chats.append(
                [
                    {"role": "user", "content": str(record["prompt"])},
                    {"role": "assistant", "content": str(record["response"])},
                ]
            )
    chats.append(
        [
            {"role": "system", "content": "  You are the support desk. \n"},
            {"role": "user", "content": "Ｆｕｌｌ-width？ 全角，还有  spaces\tand tabs"},
            {"role": "assistant", "content": "[unknown] 抱歉 — “quotes” & <tags> {{ x }}"},
            {"role": "user", "content": "\n\nthanks\n"},
            {"role": "assistant", "content": "[greeting] 😀 you're welcome"},
        ]
    )
    return chats


def save_tokenizer(folder: Path, template: str, bos: str | None = None) -> Path:
    tokenizer = tiny.build_tokenizer(domain.tokenizer_corpus(0), 512)
    tokenizer.chat_template = template
    if bos is not None:
        tokenizer.bos_token = bos
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", params=["chatml", "rich"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    folder = tmp_path_factory.mktemp(request.param)
    if request.param == "chatml":
        save_tokenizer(folder, tiny.CHAT_TEMPLATE)
    else:
        save_tokenizer(folder, RICH_TEMPLATE, bos=tiny.PAD)
    return ChatTokenizer.from_folder(folder), load_tokenizer(folder)


def test_renders_like_transformers(pair: Any) -> None:
    fast, reference = pair
    for messages in conversations():
        for end in range(1, len(messages) + 1):
            for prompt in (False, True):
                kwargs = {"add_generation_prompt": prompt}
                assert render(fast, messages[:end], **kwargs) == render(
                    reference, messages[:end], **kwargs
                )


def test_encodes_like_transformers(pair: Any) -> None:
    fast, reference = pair
    for messages in conversations():
        text = render(fast, messages)
        ours = fast(text, add_special_tokens=False, return_offsets_mapping=True)
        theirs = reference(text, add_special_tokens=False, return_offsets_mapping=True)
        assert ours["input_ids"] == theirs["input_ids"]
        assert [tuple(o) for o in ours["offset_mapping"]] == [
            tuple(o) for o in theirs["offset_mapping"]
        ]
        assert tokenize_chat(fast, messages) == tokenize_chat(reference, messages)


def test_decodes_and_counts_like_transformers(pair: Any) -> None:
    """What preflight's round trip and vocabulary checks ask of the tokenizer."""
    fast, reference = pair
    assert len(fast) == len(reference)
    for messages in conversations():
        ids = tokenize_chat(fast, messages).input_ids
        for skip in (False, True):
            ours = fast.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
            theirs = reference.decode(
                ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False
            )
            assert ours == theirs
        assert fast.decode(ids) == render(fast, messages)  # the round trip preflight checks
    with pytest.raises(ValueError, match="without clean-up"):
        fast.decode([0], clean_up_tokenization_spaces=True)


def test_batched_tokenization_equals_one_by_one(pair: Any) -> None:
    fast, _ = pair
    chats = conversations()
    ids, labels, offsets = tokenize_chats(fast, chats)
    for i, messages in enumerate(chats):
        one = tokenize_chat(fast, messages)
        assert ids[offsets[i] : offsets[i + 1]].tolist() == one.input_ids
        assert labels[offsets[i] : offsets[i + 1]].tolist() == one.labels
    counts = fast.count_tokens([assistant_spans(fast, m)[0] for m in chats])
    assert counts.tolist() == np.diff(offsets).tolist()


def test_template_errors_surface(tmp_path: Path) -> None:
    fast = ChatTokenizer.from_folder(save_tokenizer(tmp_path, RICH_TEMPLATE, bos=tiny.PAD))
    with pytest.raises(Exception, match="roles must be user or assistant"):
        render(fast, [{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}])


def test_fingerprint_follows_the_files(tmp_path: Path) -> None:
    folder = save_tokenizer(tmp_path / "a", tiny.CHAT_TEMPLATE)
    first = ChatTokenizer.from_folder(folder).fingerprint
    assert load_chat_tokenizer(folder).fingerprint == first
    (folder / "chat_template.jinja").write_text(RICH_TEMPLATE)
    assert ChatTokenizer.from_folder(folder).fingerprint != first


def test_missing_files_say_what_is_needed(tmp_path: Path) -> None:
    with pytest.raises(TokenizerFilesError, match=r"no tokenizer\.json"):
        ChatTokenizer.from_folder(tmp_path)
    folder = save_tokenizer(tmp_path / "t", tiny.CHAT_TEMPLATE)
    (folder / "chat_template.jinja").unlink()
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(TokenizerFilesError, match="no \\(single\\) chat template"):
        ChatTokenizer.from_folder(folder)
