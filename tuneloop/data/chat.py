"""Chat samples into token ids and labels, with the model's own chat template.

Labels are the assistant turns only (``IGNORE_INDEX`` elsewhere). The assistant spans
are found on the rendered text, by rendering each prefix of the conversation with the
same template, and mapped to tokens through the tokenizer's offsets. That works for any
template, with or without ``{% generation %}`` markers (most released chat templates
have none), and it checks the property it relies on: rendering is prefix-stable.

The data stages load a model's tokenizer as a ``ChatTokenizer``: the fast tokenizer
(``tokenizer.json``, the ``tokenizers`` library) and the chat template rendered the way
transformers renders it, without importing transformers or torch (seconds of start-up
per stage) and with whole batches encoded in one call. The functions here take either a
``ChatTokenizer`` or a transformers tokenizer; ``tests/test_chat.py`` checks that both
give the same text, ids and offsets.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from importlib.metadata import version
from itertools import chain
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import tokenizers

from tuneloop.data.shards import IGNORE_INDEX

if TYPE_CHECKING:
    import jinja2

Messages = Sequence[dict[str, Any]]

# The files that make a Hugging Face tokenizer and its chat template.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
)
# The named special tokens transformers passes to every chat template (its
# SPECIAL_TOKENS_ATTRIBUTES), e.g. ``{{ eos_token }}``.
SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class TemplateError(ValueError):
    """The chat template cannot be used for assistant-only labels."""


class TokenizerFilesError(ValueError):
    """A model folder lacks what a ChatTokenizer needs; the message says what."""


class ChatTemplating(Protocol):
    """What the functions here need: a transformers tokenizer and a ChatTokenizer both fit."""

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...

    def __call__(
        self, text: str, *, add_special_tokens: bool = ..., return_offsets_mapping: bool = ...
    ) -> Any: ...


@dataclass(frozen=True)
class Tokenized:
    input_ids: list[int]
    labels: list[int]


def _compile_template(template: str) -> jinja2.Template:
    """The template compiled as transformers compiles chat templates (chat_template_utils).

    The same sandbox, block trimming, loop controls, ``tojson``, ``raise_exception`` and
    ``strftime_now``; ``{% generation %}`` blocks render their body (transformers uses them
    only to track assistant spans, which ``assistant_spans`` finds for any template).
    """
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}  # noqa: RUF012 (jinja declares it an instance attribute)

        def parse(self, parser: Any) -> jinja2.nodes.Node:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(
                lineno
            )

        def _body(self, caller: Any) -> str:
            return str(caller())

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(format: str) -> str:
        return dt.datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(template)


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


class ChatTokenizer:
    """A model's fast tokenizer and chat template, as the data stages use them.

    ``apply_chat_template`` and ``__call__`` take the arguments the data stages pass to a
    transformers tokenizer and return the same results; ``encode_many`` and
    ``count_tokens`` encode a whole batch in one call into the Rust tokenizer.
    """

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        chat_template: str,
        special_tokens: dict[str, str],
        fingerprint: str,
        folder: Path | None = None,
    ) -> None:
        # transformers turns off any truncation or padding saved in tokenizer.json unless
        # a call asks for them; the stages never do.
        tokenizer.no_truncation()
        tokenizer.no_padding()
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.special_tokens = special_tokens
        self.fingerprint = fingerprint
        """A digest of the files and library versions the tokens depend on."""
        self.folder = folder
        """Where it was loaded from, so another process can load it too."""

    @classmethod
    def from_folder(cls, folder: Path) -> ChatTokenizer:
        """Load from a Hugging Face model folder: tokenizer.json plus a chat template."""
        if not (folder / "tokenizer.json").exists():
            raise TokenizerFilesError(
                f"{folder} has no tokenizer.json: the data stages need the model's fast "
                "tokenizer; save it with transformers (tokenizer.save_pretrained) first"
            )
        config = _read_json(folder / "tokenizer_config.json")
        template_file = folder / "chat_template.jinja"
        template: Any
        if template_file.exists():
            template = template_file.read_text(encoding="utf-8")
        elif (folder / "chat_template.json").exists():
            template = _read_json(folder / "chat_template.json").get("chat_template")
        else:
            template = config.get("chat_template")
        if not isinstance(template, str):
            raise TokenizerFilesError(
                f"the tokenizer of {folder} has no (single) chat template; tuneloop trains with "
                "the template used at inference, so use an instruct/chat model or add a "
                "template to its folder"
            )
        special = {
            name: _token_content(v)
            for name, v in _read_json(folder / "special_tokens_map.json").items()
        }
        special |= {name: _token_content(config.get(name)) for name in SPECIAL_TOKENS}
        tokens = {name: v for name in SPECIAL_TOKENS if (v := special.get(name)) is not None}
        if "pad_token" not in tokens and "eos_token" in tokens:
            tokens["pad_token"] = tokens["eos_token"]  # as models.load_tokenizer does
        # The template renders through jinja2: another version may render it otherwise.
        libraries = f"tokenizers {tokenizers.__version__} jinja2 {version('jinja2')}"
        digest = hashlib.md5(libraries.encode())
        for name in TOKENIZER_FILES:
            if (folder / name).exists():
                digest.update(name.encode() + b"\0" + (folder / name).read_bytes() + b"\0")
        return cls(
            tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json")),
            template,
            tokens,
            digest.hexdigest(),
            folder,
        )

    @cached_property
    def _template(self) -> jinja2.Template:
        return _compile_template(self.chat_template)

    def apply_chat_template(
        self,
        conversation: Messages,
        tokenize: bool = False,
        add_generation_prompt: bool = False,
        **kwargs: Any,
    ) -> str:
        if tokenize:
            raise ValueError("ChatTokenizer renders text only; encode it with encode_many")
        variables = dict(
            messages=conversation,
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **(self.special_tokens | kwargs),
        )
        # What Template.render does, but with the template's globals copied once, not once
        # a render: copying them (a ChainMap, walked key by key) took as long as the
        # rendering itself, and the data stages render a million chats a month.
        template = self._template
        context = template.new_context(self._globals | variables, shared=True)
        try:
            return template.environment.concat(template.root_render_func(context))
        except Exception:
            template.environment.handle_exception()
            raise  # not reached: handle_exception re-raises

    @cached_property
    def _globals(self) -> dict[str, Any]:
        return dict(self._template.globals)

    def __call__(
        self,
        text: str,
        add_special_tokens: bool = True,
        return_offsets_mapping: bool = False,
    ) -> dict[str, list[Any]]:
        encoding = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        out: dict[str, list[Any]] = {"input_ids": encoding.ids}
        if return_offsets_mapping:
            out["offset_mapping"] = encoding.offsets
        return out

    def decode(
        self,
        ids: Sequence[int],
        skip_special_tokens: bool = False,
        clean_up_tokenization_spaces: bool = False,
    ) -> str:
        """The text of ``ids``, as a transformers fast tokenizer decodes it."""
        if clean_up_tokenization_spaces:
            raise ValueError("ChatTokenizer decodes without clean-up only, as preflight needs")
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def __len__(self) -> int:
        """Tokens in the vocabulary, added ones included (``len()`` of a transformers one)."""
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    def encode_many(self, texts: list[str]) -> list[tokenizers.Encoding]:
        """Token ids and offsets of many texts, no special tokens added, in one call."""
        return self.tokenizer.encode_batch(texts, add_special_tokens=False)

    def count_tokens(self, texts: list[str]) -> np.ndarray:
        """The number of tokens of each text (no special tokens added), in one call."""
        encodings = self.tokenizer.encode_batch_fast(texts, add_special_tokens=False)
        return np.fromiter(map(len, encodings), dtype=np.int64, count=len(texts))


def load_chat_tokenizer(ref: str | Path) -> ChatTokenizer:
    """The ChatTokenizer of a local model folder or a Hugging Face id (its cached files)."""
    folder = Path(ref)
    if not folder.is_dir():
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(str(ref), allow_patterns=list(TOKENIZER_FILES)))
    return ChatTokenizer.from_folder(folder)


def render(tokenizer: ChatTemplating, messages: Messages, **kwargs: Any) -> str:
    text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    assert isinstance(text, str)  # tokenize=False always returns text
    return text


def assistant_spans(
    tokenizer: ChatTemplating, messages: Messages
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant replies."""
    full = render(tokenizer, messages)
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = render(tokenizer, messages[:index], add_generation_prompt=True)
        # The whole conversation is rendered already: not again for its last turn.
        upto = full if index == len(messages) - 1 else render(tokenizer, messages[: index + 1])
        if not (full.startswith(prompt) and full.startswith(upto) and upto.startswith(prompt)):
            raise TemplateError(
                "the chat template does not render conversations prefix-stably (turn "
                f"{index} renders differently once later turns follow), so assistant tokens "
                "cannot be located; use a template without history rewriting"
            )
        end = len(upto.rstrip())  # the reply and its end-of-turn token, not the newline after
        spans.append((len(prompt), end))
    return full, spans


def _labels(
    ids: list[int], offsets: Sequence[tuple[int, int]], spans: list[tuple[int, int]]
) -> list[int]:
    labels = [IGNORE_INDEX] * len(ids)
    for position, (start, end) in enumerate(offsets):
        if any(s <= start and end <= e and end > start for s, e in spans):
            labels[position] = ids[position]
    return labels


def tokenize_chat(tokenizer: ChatTemplating, messages: Messages) -> Tokenized:
    text, spans = assistant_spans(tokenizer, messages)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    input_ids: list[int] = list(encoded["input_ids"])
    return Tokenized(input_ids, _labels(input_ids, encoded["offset_mapping"], spans))


def tokenize_chats(
    tokenizer: ChatTokenizer, conversations: Sequence[Messages]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``tokenize_chat`` of many conversations as flat arrays: every token id, every label,
    and row offsets (sample ``i`` is ``[offsets[i], offsets[i + 1])``). One batch encode call,
    labels from the offsets in numpy: no Python list per sample is kept."""
    rendered = [assistant_spans(tokenizer, messages) for messages in conversations]
    encodings = tokenizer.encode_many([text for text, _ in rendered])
    counts = np.fromiter(map(len, encodings), dtype=np.int64, count=len(encodings))
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    total = int(offsets[-1])
    ids = np.fromiter(chain.from_iterable(e.ids for e in encodings), dtype=np.int64, count=total)
    char_spans = np.fromiter(
        chain.from_iterable(chain.from_iterable(e.offsets for e in encodings)),
        dtype=np.int64,
        count=2 * total,
    ).reshape(total, 2)
    starts, ends = char_spans[:, 0], char_spans[:, 1]
    width = max((len(spans) for _, spans in rendered), default=0)
    # Span j of each sample; (1, 0) where a sample has fewer spans: it contains no token.
    span_start = np.ones((len(rendered), max(width, 1)), dtype=np.int64)
    span_end = np.zeros_like(span_start)
    for row, (_, spans) in enumerate(rendered):
        for j, (start, end) in enumerate(spans):
            span_start[row, j], span_end[row, j] = start, end
    owner = np.repeat(np.arange(len(rendered)), counts)
    inside = np.zeros(total, dtype=bool)
    for j in range(width):
        inside |= (span_start[owner, j] <= starts) & (ends <= span_end[owner, j])
    inside &= ends > starts
    return ids, np.where(inside, ids, IGNORE_INDEX), offsets
