"""Preflight's data checks: the packed shards against the batch plan, the model and the chat.

The shards are read once into flat numpy arrays (pyarrow list columns flattened), so no
check loops over tokens in Python; only the template round trip, on a few sampled sequences,
tokenizes anything.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, overload

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pa_json
import pyarrow.parquet as pq

from tuneloop.data import text, turn_keys
from tuneloop.data.chat import ChatTokenizer, render, tokenize_chat
from tuneloop.data.shards import IGNORE_INDEX as IGNORE
from tuneloop.data.shards import (
    INPUT_IDS,
    LABELS,
    REQUIRED_COLUMNS,
    SEQ_LENGTHS,
    SHARD_GLOB,
    SOURCE_COLUMN,
    shard_name,
)
from tuneloop.data.shards import list_column as _list_column
from tuneloop.judge.verdict import Check
from tuneloop.params import BatchParams

if TYPE_CHECKING:  # the stage reads with a ChatTokenizer; a transformers one works as well
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    Tokenizer = ChatTokenizer | PreTrainedTokenizerBase

log = logging.getLogger(__name__)

# Fixed, so a rerun checks the same sequences and a failure reproduces.
ROUNDTRIP_SEED = 0
# Rank listings longer than this are grouped by count, or a 512-rank failure is unreadable.
LIST_RANKS_UP_TO = 16

# --- reading the shards ----------------------------------------------------------------


@dataclass(frozen=True)
class RankShard:
    """One rank's packed shard as flat numpy arrays, bin after bin.

    ``input_ids`` and ``labels`` hold every token of the shard; ``seq_lengths`` and
    ``sample_indices`` one entry per packed sequence; the ``bin_*`` arrays one per row.
    """

    rank: int
    bin_tokens: np.ndarray
    bin_labels: np.ndarray
    seqs_per_bin: np.ndarray
    seq_lengths: np.ndarray
    input_ids: np.ndarray
    labels: np.ndarray
    sample_indices: np.ndarray | None

    @property
    def n_bins(self) -> int:
        return len(self.bin_tokens)

    @property
    def consistent(self) -> bool:
        """Labels and sequence lengths line up with the tokens, so sequences can be located."""
        return bool(
            np.array_equal(self.bin_tokens, self.bin_labels)
            and (not len(self.seq_lengths) or self.seq_lengths.min() > 0)
            and int(self.seq_lengths.sum()) == len(self.input_ids)
            and np.array_equal(self.bin_tokens, self.seq_tokens_per_bin())
        )

    def seq_tokens_per_bin(self) -> np.ndarray:
        ends = np.concatenate([[0], np.cumsum(self.seq_lengths)])
        bounds = np.concatenate([[0], np.cumsum(self.seqs_per_bin)])
        return ends[bounds[1:]] - ends[bounds[:-1]]

    def seq_starts(self) -> np.ndarray:
        return np.cumsum(self.seq_lengths) - self.seq_lengths

    def bin_of_seq(self, seq: int) -> int:
        return int(np.searchsorted(np.cumsum(self.seqs_per_bin), seq, side="right"))


def read_shard(path: Path, rank: int) -> RankShard | str:
    """The shard, or why it cannot be used (a line for the report)."""
    try:
        names = pq.read_schema(path).names
        missing = [c for c in REQUIRED_COLUMNS if c not in names]
        if missing:
            return f"{path.name} lacks column(s) {missing}"
        columns = [*REQUIRED_COLUMNS, *([SOURCE_COLUMN] if SOURCE_COLUMN in names else [])]
        table = pq.read_table(path, columns=columns)
    except (OSError, pa.ArrowException) as exc:
        return f"{path.name} is unreadable ({exc})"
    nulls = [c for c in columns if table.column(c).null_count]
    if nulls:
        return f"{path.name} has null rows in {nulls}"
    bin_tokens, input_ids = _list_column(table, INPUT_IDS)
    bin_labels, labels = _list_column(table, LABELS)
    seqs_per_bin, seq_lengths = _list_column(table, SEQ_LENGTHS)
    sample_indices = None
    if SOURCE_COLUMN in columns:
        sources_per_bin, sample_indices = _list_column(table, SOURCE_COLUMN)
        if not np.array_equal(sources_per_bin, seqs_per_bin):
            return f"{path.name}: {SOURCE_COLUMN} and seq_lengths differ in length on some bins"
    return RankShard(
        rank, bin_tokens, bin_labels, seqs_per_bin, seq_lengths, input_ids, labels, sample_indices
    )


@dataclass(frozen=True)
class Shards:
    """Every training rank's shard that could be read, and what is wrong with the others."""

    world_size: int
    ranks: dict[int, RankShard]
    problems: list[str]

    @classmethod
    def read(cls, folder: Path, world_size: int) -> Shards:
        ranks: dict[int, RankShard] = {}
        problems: list[str] = []
        for rank in range(world_size):
            path = folder / shard_name(rank)
            if not path.exists():
                problems.append(f"rank {rank}: {path} is missing")
                continue
            shard = read_shard(path, rank)
            if isinstance(shard, str):
                problems.append(f"rank {rank}: {shard}")
            else:
                ranks[rank] = shard
        expected = {shard_name(r) for r in range(world_size)}
        for extra in sorted(p.name for p in folder.glob(SHARD_GLOB) if p.name not in expected):
            # Left by a pack for more ranks: a trainer reading them would mix two layouts.
            problems.append(
                f"{folder / extra} is beyond batch.world_size={world_size} (a pack for another "
                "world size left it)"
            )
        return cls(world_size, ranks, problems)

    @property
    def n_bins(self) -> int:
        return sum(s.n_bins for s in self.ranks.values())

    @property
    def n_sequences(self) -> int:
        return sum(len(s.seq_lengths) for s in self.ranks.values())


@dataclass(frozen=True)
class StepPlan:
    """How many steps the shards give the trainer: the count every rank must agree on."""

    micro_batches_per_rank: int
    steps_per_epoch: int
    total_steps: int
    epochs: float
    """Passes over the data the run makes (``max_steps`` converted when it is set)."""
    samples_per_step: float

    @classmethod
    def of(cls, shards: Shards, batch: BatchParams, epochs: float, max_steps: int) -> StepPlan:
        counts = [-(-s.n_bins // batch.micro_batch_size) for s in shards.ranks.values()]
        micro = min(counts, default=0)
        steps = micro // batch.gradient_accumulation_steps
        if max_steps > 0:
            total = max_steps
            passes = max_steps / steps if steps else math.inf
        else:
            # As the transformers Trainer rounds a fractional epoch count.
            total = math.ceil(epochs * steps)
            passes = epochs
        per_bin = shards.n_sequences / shards.n_bins if shards.n_bins else 0.0
        return cls(micro, steps, total, passes, batch.effective_batch * per_bin)


# --- data checks -----------------------------------------------------------------------


def _ranks(counts: Mapping[int, int | str]) -> str:
    if len(counts) <= LIST_RANKS_UP_TO:
        return ", ".join(f"rank {r}: {c}" for r, c in counts.items())
    by_count: dict[int | str, list[int]] = {}
    for rank, count in counts.items():
        by_count.setdefault(count, []).append(rank)
    return "; ".join(
        f"{count}: {len(ranks)} rank(s) ({', '.join(map(str, ranks[:8]))}"
        f"{', ...' if len(ranks) > 8 else ''})"
        for count, ranks in sorted(by_count.items(), key=lambda item: len(item[1]))
    )


def check_shards_complete(shards: Shards, min_bins: int) -> Check:
    name = "shards_complete"
    if shards.problems:
        shown = "; ".join(shards.problems[:5])
        more = f" (and {len(shards.problems) - 5} more)" if len(shards.problems) > 5 else ""
        return Check(name, "fail", f"{shown}{more}. Re-run `pack`.")
    if shards.n_bins < min_bins:
        return Check(
            name,
            "fail",
            f"{shards.n_bins} packed bins < preflight.min_train_bins={min_bins}; add data or "
            "lower the threshold",
        )
    return Check(
        name,
        "pass",
        f"{shards.world_size} shard(s), {shards.n_bins} bins, {shards.n_sequences} "
        "packed sequences",
    )


def check_ranks_balanced(shards: Shards, batch: BatchParams, plan: StepPlan) -> Check:
    """Every rank must run the same number of micro-batches, or DDP waits forever at epoch end."""
    name = "ranks_balanced"
    micro = batch.micro_batch_size
    counts: dict[int, int | str] = {
        r: (-(-shards.ranks[r].n_bins // micro) if r in shards.ranks else "no shard")
        for r in range(shards.world_size)
    }
    if len(set(counts.values())) > 1 or len(shards.ranks) < shards.world_size:
        return Check(
            name,
            "fail",
            f"micro-batches per rank differ ({_ranks(counts)}): a rank with fewer batches "
            "leaves the others waiting in a gradient all-reduce at the epoch end, a silent "
            "hang until the collective timeout. Re-run `pack` with the batch params "
            "training uses.",
        )
    partial = [r for r, s in shards.ranks.items() if s.n_bins % micro]
    if partial:
        return Check(
            name,
            "fail",
            f"ranks {partial} end on a partial micro-batch ({shards.ranks[partial[0]].n_bins} "
            f"bins, batch.micro_batch_size={micro}): the shards were packed for other batch "
            "params; re-run `pack`",
        )
    accumulation = batch.gradient_accumulation_steps
    if plan.micro_batches_per_rank % accumulation:
        return Check(
            name,
            "fail",
            f"{plan.micro_batches_per_rank} micro-batches per rank is not a multiple of "
            f"gradient accumulation ({accumulation}, from batch.effective_batch): the shards "
            "were packed for other batch params; re-run `pack`",
        )
    return Check(
        name,
        "pass",
        f"{plan.micro_batches_per_rank} micro-batches on each of {shards.world_size} rank(s) "
        f"(micro_batch_size {micro}, gradient accumulation {accumulation}) = "
        f"{plan.steps_per_epoch} optimizer steps per epoch, {plan.total_steps} in all",
    )


def _first(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def check_lengths(shards: Shards, seq_len: int, context: int) -> Check:
    """Bins within pack.seq_len, sequences within the model's context, lengths that add up."""
    name = "lengths_fit"
    limit = min(seq_len, context) if context else seq_len
    longest_bin = longest_seq = 0
    for rank, s in shards.ranks.items():
        where = f"rank {rank} bin"
        if not np.array_equal(s.bin_tokens, s.bin_labels):
            b = _first(s.bin_tokens != s.bin_labels)
            return Check(
                name,
                "fail",
                f"{where} {b}: {s.bin_tokens[b]} input ids but {s.bin_labels[b]} labels; "
                "re-run `pack`",
            )
        summed = s.seq_tokens_per_bin()
        if not np.array_equal(summed, s.bin_tokens):
            b = _first(summed != s.bin_tokens)
            return Check(
                name,
                "fail",
                f"{where} {b}: seq_lengths add up to {summed[b]} but the bin holds "
                f"{s.bin_tokens[b]} tokens, so position ids would restart in the wrong places "
                "and samples attend to each other; re-run `pack`",
            )
        if len(s.seq_lengths) and s.seq_lengths.min() <= 0:
            b = s.bin_of_seq(_first(s.seq_lengths <= 0))
            return Check(name, "fail", f"{where} {b}: a sequence of length <= 0")
        if s.n_bins:
            longest_bin = max(longest_bin, int(s.bin_tokens.max()))
            longest_seq = max(longest_seq, int(s.seq_lengths.max(initial=0)))
            if longest_bin > limit:
                b = _first(s.bin_tokens > limit)
                return Check(
                    name,
                    "fail",
                    f"{where} {b} holds {s.bin_tokens[b]} tokens > {limit} (pack.seq_len="
                    f"{seq_len}, model context={context}): lower pack.seq_len and re-run `pack`",
                )
    if context and seq_len > context:
        return Check(
            name,
            "warn",
            f"pack.seq_len={seq_len} exceeds the model context {context}; the bins fit "
            f"(longest {longest_bin}), but a later pack may not",
        )
    return Check(
        name,
        "pass",
        f"longest bin {longest_bin}, longest sequence {longest_seq} <= {limit} tokens "
        f"(pack.seq_len {seq_len}, context {context})",
    )


def _source(shard: RankShard, seq: int) -> str:
    where = f"rank {shard.rank} bin {shard.bin_of_seq(seq)}"
    if shard.sample_indices is not None:
        where += f", train.jsonl row {int(shard.sample_indices[seq])}"
    return where


def check_labels_present(shards: Shards) -> Check:
    """A sample whose labels are all masked trains nothing and hides a template bug."""
    name = "labels_present"
    empty = 0
    first = ""
    skipped = []
    for rank, s in shards.ranks.items():
        if not s.consistent:
            skipped.append(rank)
            continue
        if not len(s.seq_lengths):
            continue
        # Label ids are >= 0 and IGNORE is negative: a sequence's largest label is IGNORE
        # exactly when none of its tokens carries a label. One pass, no per-token temporaries.
        best = np.maximum.reduceat(s.labels, s.seq_starts())
        no_label = best == IGNORE
        if no_label.any():
            empty += int(no_label.sum())
            first = first or _source(s, _first(no_label))
    if empty:
        return Check(
            name,
            "fail",
            f"{empty} packed sequence(s) have no label tokens (first: {first}): no assistant "
            "reply survived tokenization or truncation; check the chat template and "
            "pack.overlong, then re-run `pack`",
        )
    if skipped:
        return Check(name, "skip", f"ranks {skipped}: lengths inconsistent, see lengths_fit")
    return Check(name, "pass", f"all {shards.n_sequences} packed sequences carry labels")


def check_labels_aligned(shards: Shards) -> Check:
    """Labels must be the input ids themselves or IGNORE: the trainer does the shift."""
    name = "labels_aligned"
    skipped = []
    for rank, s in shards.ranks.items():
        if not np.array_equal(s.bin_tokens, s.bin_labels):
            skipped.append(rank)
            continue
        wrong = (s.labels != s.input_ids) & (s.labels != IGNORE)
        if wrong.any():
            token = _first(wrong)
            seq = int(np.searchsorted(np.cumsum(s.seq_lengths), token, side="right"))
            return Check(
                name,
                "fail",
                f"{int(wrong.sum())} label(s) are neither their token's id nor {IGNORE} (first: "
                f"{_source(s, seq)}: label {s.labels[token]}, input id {s.input_ids[token]}); "
                "labels shifted or built by another tokenizer; re-run `pack`",
            )
    if skipped:
        return Check(name, "skip", f"ranks {skipped}: labels misaligned, see lengths_fit")
    return Check(name, "pass", f"every label is its token's id or {IGNORE}")


def check_vocab(shards: Shards, embedding_rows: int, tokenizer_size: int) -> Check:
    name = "vocab_fits"
    if tokenizer_size > embedding_rows:
        return Check(
            name,
            "fail",
            f"the tokenizer has {tokenizer_size} tokens but the model's embedding "
            f"{embedding_rows} rows: an added token would index past it (a CUDA device-side "
            "assert mid-run); resize the embeddings or use the model's own tokenizer",
        )
    lowest = min(
        (int(s.input_ids.min()) for s in shards.ranks.values() if len(s.input_ids)), default=0
    )
    highest = max(
        (int(s.input_ids.max()) for s in shards.ranks.values() if len(s.input_ids)), default=-1
    )
    if highest >= embedding_rows or lowest < 0:
        bad = highest if highest >= embedding_rows else lowest
        return Check(
            name,
            "fail",
            f"token id {bad} is outside the embedding's {embedding_rows} rows: the data was "
            "tokenized with another tokenizer; re-run `pack`",
        )
    return Check(
        name,
        "pass",
        f"token ids {lowest}..{highest} and the tokenizer's {tokenizer_size} tokens fit "
        f"{embedding_rows} embedding rows",
    )


def _difference(decoded: str, rendered: str) -> str:
    at = next(
        (i for i, (a, b) in enumerate(zip(decoded, rendered, strict=False)) if a != b),
        min(len(decoded), len(rendered)),
    )
    return (
        f"differ at character {at}: decoded {decoded[max(0, at - 20) : at + 20]!r}, "
        f"rendered {rendered[max(0, at - 20) : at + 20]!r}"
    )


def roundtrip_one(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    ids: list[int],
    labels: list[int],
    seq_len: int,
) -> str | None:
    """Why a packed sequence is not its source chat as pack should have written it, or None."""
    rendered = render(tokenizer, messages)
    fresh = tokenize_chat(tokenizer, messages)
    # A piece cut by pack.overlong (truncate, split) starts at a multiple of seq_len.
    offset = next(
        (
            start
            for start in range(0, len(fresh.input_ids), seq_len)
            if fresh.input_ids[start : start + len(ids)] == ids
        ),
        -1,
    )
    whole = offset == 0 and len(ids) == len(fresh.input_ids)
    # A cut piece's text is not compared: the cut can fall inside a multi-byte character.
    if whole or offset < 0:
        decoded = tokenizer.decode(
            ids, skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
        assert isinstance(decoded, str)  # one sequence in, one string out
        if decoded != rendered:
            return f"decoded text and chat-template rendering {_difference(decoded, rendered)}"
    if offset < 0:
        return "the tokens differ from tokenizing the rendering (another tokenizer or template)"
    if fresh.labels[offset : offset + len(ids)] != labels:
        return "the labels differ from the assistant-only mask of the rendering"
    return None


def check_template_roundtrip(
    shards: Shards,
    source_lines: Sequence[bytes],
    packed_samples: int | None,
    tokenizer: Tokenizer,
    seq_len: int,
    n_checked: int,
) -> Check:
    """Sampled packed sequences decode to the chat-template rendering of their source chat."""
    name = "template_roundtrip"
    without = [r for r, s in shards.ranks.items() if s.sample_indices is None]
    if without:
        return Check(
            name,
            "fail",
            f"ranks {without}: no {SOURCE_COLUMN} column, so packed sequences cannot be traced "
            "to their source; re-run `pack`",
        )
    if packed_samples is not None and packed_samples != len(source_lines):
        return Check(
            name,
            "fail",
            f"pack packed {packed_samples} samples but train.jsonl has {len(source_lines)} "
            "rows: the packed data is stale; re-run `pack`",
        )
    usable = [s for s in shards.ranks.values() if s.consistent and len(s.seq_lengths)]
    sizes = np.array([len(s.seq_lengths) for s in usable], dtype=np.int64)
    if not sizes.sum():
        return Check(name, "skip", "no consistent shard to sample (see lengths_fit)")
    rng = np.random.default_rng(ROUNDTRIP_SEED)
    picks = np.sort(
        rng.choice(int(sizes.sum()), size=min(n_checked, int(sizes.sum())), replace=False)
    )
    bounds = np.cumsum(sizes)
    failures: list[str] = []
    for pick in picks.tolist():
        which = int(np.searchsorted(bounds, pick, side="right"))
        s = usable[which]
        seq = pick - (int(bounds[which - 1]) if which else 0)
        assert s.sample_indices is not None  # every usable shard has them (checked above)
        row = int(s.sample_indices[seq])
        if not 0 <= row < len(source_lines):
            failures.append(f"{_source(s, seq)}: no such row in train.jsonl")
            continue
        start = int(s.seq_starts()[seq])
        end = start + int(s.seq_lengths[seq])
        try:
            messages = json.loads(source_lines[row])["messages"]
        except (ValueError, KeyError, TypeError) as exc:
            failures.append(f"{_source(s, seq)}: not a chat record ({exc!r})")
            continue
        why = roundtrip_one(
            tokenizer,
            messages,
            s.input_ids[start:end].tolist(),
            s.labels[start:end].tolist(),
            seq_len,
        )
        if why:
            failures.append(f"{_source(s, seq)}: {why}")
    if failures:
        return Check(
            name,
            "fail",
            f"{len(failures)} of {len(picks)} sampled packed sequences do not round-trip "
            f"(first: {failures[0]}); re-run `pack` with the base model's tokenizer",
        )
    return Check(
        name,
        "pass",
        f"{len(picks)} sampled packed sequences decode to their train.jsonl chat's template "
        "rendering, tokens and assistant-only labels included",
    )


class JsonLines(Sequence[bytes]):
    """The non-blank lines of a JSON-lines file's bytes, found without splitting them all.

    The round trip needs a handful of rows and the row count of a file of hundreds of MB;
    ``bytes.split`` made a Python object of every line (a third of a second at 100k lines).
    Line ends are found by ``bytes.find`` (memchr: 64 ms for 219 MB in 100k lines here, where
    comparing every byte in numpy and ``flatnonzero`` took 1.35 s); a line is blank (skipped,
    as pack skips it) when its first byte is whitespace and it strips to nothing.
    """

    _WHITESPACE = np.frombuffer(b" \t\n\r\x0b\x0c", dtype=np.uint8)

    def __init__(self, data: bytes) -> None:
        self.data = data
        view = np.frombuffer(data, dtype=np.uint8)
        found: list[int] = []
        find, end = data.find, data.find(b"\n")
        while end >= 0:
            found.append(end)
            end = find(b"\n", end + 1)
        ends = np.array(found, dtype=np.int64)
        starts = np.concatenate([[0], ends + 1])
        ends = np.concatenate([ends, [len(data)]])
        first = view[np.minimum(starts, max(len(data) - 1, 0))] if len(data) else starts
        maybe_blank = np.flatnonzero((starts >= ends) | np.isin(first, self._WHITESPACE))
        blank = [i for i in maybe_blank.tolist() if not data[starts[i] : ends[i]].strip()]
        keep = np.ones(len(starts), dtype=bool)
        keep[blank] = False
        self._starts, self._ends = starts[keep], ends[keep]

    def __len__(self) -> int:
        return len(self._starts)

    @overload
    def __getitem__(self, row: int) -> bytes: ...

    @overload
    def __getitem__(self, row: slice) -> list[bytes]: ...

    def __getitem__(self, row: int | slice) -> bytes | list[bytes]:
        if isinstance(row, slice):
            return [self[i] for i in range(*row.indices(len(self)))]
        return self.data[int(self._starts[row]) : int(self._ends[row])]


def normalise_texts(texts: pa.Array | pa.ChunkedArray) -> pa.Array | pa.ChunkedArray:
    """NFKC, lower case, whitespace runs to one space, trimmed: the clean stage's normalisation,
    vectorised. Both sides of the contamination check go through this one function. Arrow's
    Unicode whitespace is Python's ``\\s``; splitting and joining is 3-5x faster than a regex.
    """
    folded = pc.utf8_trim_whitespace(pc.utf8_lower(pc.utf8_normalize(texts, "NFKC")))
    return pc.binary_join(pc.utf8_split_whitespace(folded), " ")


_CHAT_SCHEMA = pa.schema(
    [("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())])))]
)


def user_turns(train_jsonl: Path | bytes) -> tuple[pa.ChunkedArray, np.ndarray]:
    """Every user turn of a chats file (a path, or its bytes already read) and the row it is
    on, read in C++ (no per-line json)."""
    if isinstance(train_jsonl, bytes):
        if not train_jsonl:
            return pa.chunked_array([], pa.string()), np.zeros(0, dtype=np.int64)
        source: Path | pa.BufferReader = pa.BufferReader(pa.py_buffer(train_jsonl))
    elif not train_jsonl.stat().st_size:
        return pa.chunked_array([], pa.string()), np.zeros(0, dtype=np.int64)
    else:
        source = train_jsonl
    table = pa_json.read_json(
        source,
        # A block must hold a whole line; ingest caps lines at 1 MB, this leaves room.
        read_options=pa_json.ReadOptions(block_size=16 << 20),
        parse_options=pa_json.ParseOptions(
            explicit_schema=_CHAT_SCHEMA, unexpected_field_behavior="ignore"
        ),
    )
    # Chunk by chunk: combining the chunks first would copy every message once more.
    messages = table.column("messages")
    turns = pc.list_flatten(messages)
    is_user = pc.equal(pc.struct_field(turns, "role"), "user")
    rows = pc.filter(pc.list_parent_indices(messages), is_user).to_numpy()
    return pc.filter(pc.struct_field(turns, "content"), is_user), rows


def check_eval_contamination(
    train_jsonl: Path, eval_questions: Sequence[tuple[str, str]], data: bytes | None = None
) -> Check:
    """No eval-suite question among the training data's user turns (normalised, hash lookup).

    The turns' keys come from what clean wrote beside the file (``tuneloop.data.turn_keys``) when
    that was written for exactly these bytes; otherwise the file is parsed and normalised
    here. ``data`` is the file's content when the caller has read it already.
    """
    name = _CONTAMINATION
    if not eval_questions:
        return Check(name, "warn", "no eval suite found: contamination cannot be checked")
    if data is None and train_jsonl.exists():
        data = train_jsonl.read_bytes()
    keys = turn_keys.read(train_jsonl.parent / turn_keys.NAME, data) if data is not None else None
    if keys is not None:  # clean's keys of exactly these bytes: no JSON to parse
        by_key = {text.key(q): (item, text.normalise(q)) for item, q in eval_questions}
        found = keys.find(set(by_key))
        if found.size:
            item, question = by_key[keys.keys[found[0]].tobytes()]
            return _contaminated(train_jsonl, found.size, int(keys.rows[found[0]]), item, question)
        return Check(
            name,
            "pass",
            f"none of {len(keys.keys)} user turns matches the {len(eval_questions)} eval "
            f"questions (by the keys clean wrote for this file, {turn_keys.NAME})",
        )
    turns, rows = user_turns(train_jsonl if data is None else data)
    normalised_eval = normalise_texts(pa.array([q for _, q in eval_questions], pa.string()))
    hits = np.flatnonzero(
        pc.is_in(normalise_texts(turns), value_set=normalised_eval).to_numpy(zero_copy_only=False)
    )
    if hits.size:
        item_of = dict(
            zip(normalised_eval.to_pylist(), (i for i, _ in eval_questions), strict=True)
        )
        first = int(hits[0])
        question = normalise_texts(pa.array([turns[first].as_py()], pa.string()))[0].as_py()
        return _contaminated(train_jsonl, hits.size, int(rows[first]), item_of[question], question)
    return Check(
        name,
        "pass",
        f"none of {len(turns)} user turns matches the {len(eval_questions)} eval questions "
        f"(parsed from the file: no keys of clean's for these bytes)",
    )


_CONTAMINATION = "no_eval_contamination"


def _contaminated(train_jsonl: Path, hits: int, row: int, item: str, question: str) -> Check:
    return Check(
        _CONTAMINATION,
        "fail",
        f"{hits} user turn(s) in {train_jsonl} are eval items (first: row {row} = {item}, "
        f"{question!r}); training on them inflates the gate's score. Re-run `clean`, which "
        "decontaminates against eval/",
    )
