"""pack's token cache: the same tokens as without it, and only lines it never saw tokenized."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.helpers import changed_tokenizer, chat_lines, edited_code, tokens_of
from tuneloop.data import token_cache
from tuneloop.data.chat import ChatTokenizer
from tuneloop.data.token_cache import Tokens
from tuneloop.demo import domain, tiny

# The fast tier: no pipeline, server or rank.
pytestmark = pytest.mark.fast


def write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def same(a: Tokens, b: Tokens) -> bool:
    return all(
        np.array_equal(getattr(a, name), getattr(b, name)) for name in ("ids", "labels", "offsets")
    )


def test_growing_file_tokenizes_only_its_new_lines(
    tmp_path: Path, tokenizer: ChatTokenizer
) -> None:
    lines = chat_lines(1, 300)
    path, cache = tmp_path / "train.jsonl", tmp_path / "cache"
    for end, new in ((100, 100), (100, 0), (250, 150), (300, 50)):
        write(path, lines[:end])
        cached = tokens_of(path, cache, tokenizer)
        assert cached.lines_tokenized == new
        assert same(cached, tokens_of(path, None, tokenizer))
        assert len(cached.offsets) == end + 1


def test_a_changed_line_is_the_only_one_tokenized_again(
    tmp_path: Path, tokenizer: ChatTokenizer
) -> None:
    lines = chat_lines(2, 200)
    path, cache = tmp_path / "train.jsonl", tmp_path / "cache"
    write(path, lines[:80])
    tokens_of(path, cache, tokenizer)
    write(path, lines[:150])
    tokens_of(path, cache, tokenizer)  # segments: lines 0-79, 80-149
    lines[100] = chat_lines(3, 1)[0]
    write(path, lines)
    cached = tokens_of(path, cache, tokenizer)
    assert cached.lines_tokenized == 1 + 50  # the changed line and the new tail
    assert same(cached, tokens_of(path, None, tokenizer))
    assert len(list(cache.glob("*.ids.npy"))) == 3


def test_a_replay_share_of_old_lines_in_any_order_is_not_tokenized_again(
    tmp_path: Path, tokenizer: ChatTokenizer
) -> None:
    """Month N: a new draw of last month's lines (the replay share) and the new ones."""
    old, new = chat_lines(5, 400), chat_lines(6, 30)
    path, cache = tmp_path / "train.jsonl", tmp_path / "cache"
    write(path, old)
    tokens_of(path, cache, tokenizer)
    rng = np.random.default_rng(0)
    replayed = [old[i] for i in sorted(rng.choice(len(old), 100, replace=False))]
    tokenized = []
    for month in (replayed + new, new[::-1] + replayed[::-1]):
        write(path, month)
        cached = tokens_of(path, cache, tokenizer)
        assert same(cached, tokens_of(path, None, tokenizer))
        assert len(cached.offsets) == len(month) + 1
        tokenized.append(cached.lines_tokenized)
    assert tokenized == [len(new), 0]  # the new lines, once
    assert len(list(cache.glob("*.keys.npy"))) == 2


def test_another_tokenizer_or_a_broken_segment_starts_over(
    tmp_path: Path, tokenizer: ChatTokenizer
) -> None:
    path, cache = write(tmp_path / "val.jsonl", chat_lines(4, 60)), tmp_path / "cache"
    tokens_of(path, cache, tokenizer)
    other = tiny.build_tokenizer(domain.tokenizer_corpus(1), 600)
    other.save_pretrained(tmp_path / "other")
    different = ChatTokenizer.from_folder(tmp_path / "other")
    assert tokens_of(path, cache, different).lines_tokenized == 60
    assert same(tokens_of(path, cache, different), tokens_of(path, None, different))
    next(cache.glob("*.labels.npy")).write_bytes(b"broken")
    again = tokens_of(path, cache, different)
    assert again.lines_tokenized == 60 and same(again, tokens_of(path, None, different))
    # Keys of fewer lines than the segment holds: dropped too, never a wrong line's tokens.
    keys = next(cache.glob("*.keys.npy"))
    np.save(keys, np.load(keys)[:-1])
    last = tokens_of(path, cache, different)
    assert last.lines_tokenized == 60 and same(last, tokens_of(path, None, different))
    # Lengths that add up but run backwards: dropped as well.
    lengths_file = next(cache.glob("*.lengths.npy"))
    lengths = np.load(lengths_file)
    lengths[0], lengths[1] = lengths[0] + lengths[1] + 1, -1
    np.save(lengths_file, lengths)
    again = tokens_of(path, cache, different)
    assert again.lines_tokenized == 60 and same(again, tokens_of(path, None, different))


def test_an_empty_file_has_no_tokens(tmp_path: Path, tokenizer: ChatTokenizer) -> None:
    empty = tokens_of(write(tmp_path / "val.jsonl", []), tmp_path / "cache", tokenizer)
    assert empty.offsets.tolist() == [0] and not len(empty.ids)


# (change, lines tokenized again): a line's tokens are keyed on its bytes and the tokenizer's and
# code's fingerprint (``token_cache.fingerprint``), never on where the line stands.
TOKEN_CHANGES = [
    ("nothing", 60),
    ("tokenizer.json", 0),
    ("chat template", 0),
    ("tokenizers version", 0),
    ("jinja2 version", 0),
    *((f"code {name}", 0) for name in ("chat.py", "shards.py", "token_cache.py")),
    ("one line's bytes", 59),
    ("the lines in another order, in another file", 60),
]


@pytest.mark.parametrize(("change", "reused"), TOKEN_CHANGES, ids=[c for c, _ in TOKEN_CHANGES])
def test_a_change_to_what_a_line_depends_on_misses_it(
    tmp_path: Path,
    tokenizer: ChatTokenizer,
    monkeypatch: pytest.MonkeyPatch,
    change: str,
    reused: int,
) -> None:
    lines = chat_lines(5, 60)
    path, cache = write(tmp_path / "train.jsonl", lines), tmp_path / "cache"
    tokens_of(path, cache, tokenizer)
    if (changed := changed_tokenizer(change, tokenizer, tmp_path, monkeypatch)) is not None:
        tokenizer = changed
    elif change.startswith("code "):
        names = ("chat.py", "shards.py", "token_cache.py")
        source = Path(token_cache.__file__).parent
        code = edited_code(tmp_path / "code", source, names, change.removeprefix("code "))
        monkeypatch.setattr(token_cache, "__file__", str(code / "token_cache.py"))
    elif change == "one line's bytes":
        write(path, [*lines[:30], chat_lines(6, 1)[0], *lines[31:]])
    elif change == "the lines in another order, in another file":
        path = write(tmp_path / "val.jsonl", lines[::-1])
    else:
        assert change == "nothing", change
    again = tokens_of(path, cache, tokenizer)
    assert again.lines_tokenized == 60 - reused
    assert same(again, tokens_of(path, None, tokenizer))
