"""Stage ``preflight``: refuse, in about a second, a run that would hang or waste GPU hours.

Reads:  ``paths.packed`` shards (``rank-NNNNN.parquet``) and manifest; ``paths.clean``/train.jsonl
        (the packed samples' sources); the eval suites under ``paths.eval_suites``; the base
        model's config, tokenizer and weight files; the machine (NVML, disks, ``NCCL_*``).
Writes: ``reports/preflight.json`` and ``reports/preflight.md`` (every check with its status,
        detail and duration); ``metrics/preflight.json``; the same to the MLflow run.
Params: ``preflight``, ``pack``, ``batch``, ``train``, ``model.base``, ``paths``.

Every check is a small function that returns a ``CheckResult``: ``pass``, ``warn`` (the run
will work, but the detail says what to look at), ``fail`` (the run would hang, crash or train
on the wrong thing) or ``skip`` (does not apply here, and why). All of them run, so one
failure never hides the next; the stage exits non-zero when any check fails, so ``train``
never starts after it, under ``dvc repro`` or the retrain flow.

The data checks read the shards once into flat numpy arrays (pyarrow list columns flattened),
so no check loops over tokens in Python; only the template round trip, on a few sampled
sequences, tokenizes anything.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import mlflow
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pa_json
import pyarrow.parquet as pq
import pynvml
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from tuneloop import doctor, suites
from tuneloop.chat import render, tokenize_chat
from tuneloop.io import read_json, write_json, write_text
from tuneloop.models import base_model_ref, load_tokenizer, model_limits
from tuneloop.params import BatchParams, Params, TrainParams, load_params
from tuneloop.shards import IGNORE_INDEX as IGNORE
from tuneloop.shards import (
    INPUT_IDS,
    LABELS,
    REQUIRED_COLUMNS,
    SEQ_LENGTHS,
    SHARD_GLOB,
    SOURCE_COLUMN,
    shard_name,
)
from tuneloop.shards import list_column as _list_column
from tuneloop.stage import setup_logging, write_metrics
from tuneloop.tracking import stage_run
from tuneloop.training.plan import CHECKPOINTS, Environment, TrainSetupError, resolve_plan

STAGE = "preflight"
log = logging.getLogger(__name__)

Status = Literal["pass", "warn", "fail", "skip"]

# Fixed, so a rerun checks the same sequences and a failure reproduces.
ROUNDTRIP_SEED = 0
# Rank listings longer than this are grouped by count, or a 512-rank failure is unreadable.
LIST_RANKS_UP_TO = 16


@dataclass(frozen=True)
class LrBand:
    low: float
    high: float
    absurd: float
    source: str


# Learning-rate starting points per (phase, method). Outside [low, high] warns (a tiny model
# from random init, like the demo's, wants more); at or above ``absurd`` the run diverges on
# any pretrained model, so it fails. A new method or phase adds its rows here.
_GUIDE = "references/b300-finetuning-guide"
LR_BANDS: dict[tuple[str, str], LrBand] = {
    ("sft", "lora"): LrBand(1e-4, 2e-4, 0.1, f"{_GUIDE}, LoRA"),
    ("sft", "qlora"): LrBand(1e-4, 2e-4, 0.1, f"{_GUIDE}, LoRA; QLoRA trains the same adapter"),
    ("sft", "full"): LrBand(1e-5, 2e-5, 1e-2, f"{_GUIDE}, full fine-tuning"),
    # DPO moves a model that already follows instructions: ~10x below SFT (TRL's default 1e-6
    # is a full-weight value).
    ("dpo", "lora"): LrBand(5e-6, 5e-5, 1e-2, "params.yaml, DPO with LoRA"),
    ("dpo", "qlora"): LrBand(5e-6, 5e-5, 1e-2, "params.yaml, DPO with LoRA"),
    ("dpo", "full"): LrBand(5e-7, 5e-6, 1e-3, "params.yaml, full-weight DPO; TRL default 1e-6"),
}
# Methods that train an adapter on a frozen base: checkpoints hold the adapter, not the model.
ADAPTER_METHODS = frozenset({"lora", "qlora"})
# A full-weight checkpoint keeps bf16 weights (2 bytes/param) plus fp32 master weights and two
# Adam moments (12 bytes/param): 7x the weights. An adapter method's run writes at most a merged
# model's worth (the merge stage), so 1x the weights is its conservative bound.
FULL_CHECKPOINT_FACTOR = 7
WARMUP_BAND = (0.03, 0.10)  # guide: warmup 3-10 %
WARMUP_ABSURD = 0.5  # half the run ramping up is a units mistake (steps given as a ratio)
LORA_RANK_BAND = (16, 64)  # guide: r = 16-64
LORA_ALPHA_RATIO_BAND = (1.0, 4.0)  # guide: alpha = 2 r
LORA_ALPHA_RATIO_ABSURD = 16.0  # the update scale is alpha / r: 16x the usual multiplies the LR
SAMPLES_PER_STEP_BAND = (64, 256)  # guide: effective batch 64-256 samples
EPOCH_BAND = (1.0, 3.0)  # guide: 1-3 epochs, watch val loss after the 2nd
EPOCHS_ABSURD = 10.0  # past this an SFT run memorises its data; usually steps given as epochs


@dataclass(frozen=True)
class CheckResult:
    name: str
    status: Status
    detail: str
    seconds: float = 0.0


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


def check_shards_complete(shards: Shards, min_bins: int) -> CheckResult:
    name = "shards_complete"
    if shards.problems:
        shown = "; ".join(shards.problems[:5])
        more = f" (and {len(shards.problems) - 5} more)" if len(shards.problems) > 5 else ""
        return CheckResult(name, "fail", f"{shown}{more}. Re-run `pack`.")
    if shards.n_bins < min_bins:
        return CheckResult(
            name,
            "fail",
            f"{shards.n_bins} packed bins < preflight.min_train_bins={min_bins}; add data or "
            "lower the threshold",
        )
    return CheckResult(
        name,
        "pass",
        f"{shards.world_size} shard(s), {shards.n_bins} bins, {shards.n_sequences} "
        "packed sequences",
    )


def check_ranks_balanced(shards: Shards, batch: BatchParams, plan: StepPlan) -> CheckResult:
    """Every rank must run the same number of micro-batches, or DDP waits forever at epoch end."""
    name = "ranks_balanced"
    micro = batch.micro_batch_size
    counts: dict[int, int | str] = {
        r: (-(-shards.ranks[r].n_bins // micro) if r in shards.ranks else "no shard")
        for r in range(shards.world_size)
    }
    if len(set(counts.values())) > 1 or len(shards.ranks) < shards.world_size:
        return CheckResult(
            name,
            "fail",
            f"micro-batches per rank differ ({_ranks(counts)}): a rank with fewer batches "
            "leaves the others waiting in a gradient all-reduce at the epoch end, a silent "
            "hang until the collective timeout. Re-run `pack` with the batch params "
            "training uses.",
        )
    partial = [r for r, s in shards.ranks.items() if s.n_bins % micro]
    if partial:
        return CheckResult(
            name,
            "fail",
            f"ranks {partial} end on a partial micro-batch ({shards.ranks[partial[0]].n_bins} "
            f"bins, batch.micro_batch_size={micro}): the shards were packed for other batch "
            "params; re-run `pack`",
        )
    accumulation = batch.gradient_accumulation_steps
    if plan.micro_batches_per_rank % accumulation:
        return CheckResult(
            name,
            "fail",
            f"{plan.micro_batches_per_rank} micro-batches per rank is not a multiple of "
            f"gradient accumulation ({accumulation}, from batch.effective_batch): the shards "
            "were packed for other batch params; re-run `pack`",
        )
    return CheckResult(
        name,
        "pass",
        f"{plan.micro_batches_per_rank} micro-batches on each of {shards.world_size} rank(s) "
        f"(micro_batch_size {micro}, gradient accumulation {accumulation}) = "
        f"{plan.steps_per_epoch} optimizer steps per epoch, {plan.total_steps} in all",
    )


def _first(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def check_lengths(shards: Shards, seq_len: int, context: int) -> CheckResult:
    """Bins within pack.seq_len, sequences within the model's context, lengths that add up."""
    name = "lengths_fit"
    limit = min(seq_len, context) if context else seq_len
    longest_bin = longest_seq = 0
    for rank, s in shards.ranks.items():
        where = f"rank {rank} bin"
        if not np.array_equal(s.bin_tokens, s.bin_labels):
            b = _first(s.bin_tokens != s.bin_labels)
            return CheckResult(
                name,
                "fail",
                f"{where} {b}: {s.bin_tokens[b]} input ids but {s.bin_labels[b]} labels; "
                "re-run `pack`",
            )
        summed = s.seq_tokens_per_bin()
        if not np.array_equal(summed, s.bin_tokens):
            b = _first(summed != s.bin_tokens)
            return CheckResult(
                name,
                "fail",
                f"{where} {b}: seq_lengths add up to {summed[b]} but the bin holds "
                f"{s.bin_tokens[b]} tokens, so position ids would restart in the wrong places "
                "and samples attend to each other; re-run `pack`",
            )
        if len(s.seq_lengths) and s.seq_lengths.min() <= 0:
            b = s.bin_of_seq(_first(s.seq_lengths <= 0))
            return CheckResult(name, "fail", f"{where} {b}: a sequence of length <= 0")
        if s.n_bins:
            longest_bin = max(longest_bin, int(s.bin_tokens.max()))
            longest_seq = max(longest_seq, int(s.seq_lengths.max(initial=0)))
            if longest_bin > limit:
                b = _first(s.bin_tokens > limit)
                return CheckResult(
                    name,
                    "fail",
                    f"{where} {b} holds {s.bin_tokens[b]} tokens > {limit} (pack.seq_len="
                    f"{seq_len}, model context={context}): lower pack.seq_len and re-run `pack`",
                )
    if context and seq_len > context:
        return CheckResult(
            name,
            "warn",
            f"pack.seq_len={seq_len} exceeds the model context {context}; the bins fit "
            f"(longest {longest_bin}), but a later pack may not",
        )
    return CheckResult(
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


def check_labels_present(shards: Shards) -> CheckResult:
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
        return CheckResult(
            name,
            "fail",
            f"{empty} packed sequence(s) have no label tokens (first: {first}): no assistant "
            "reply survived tokenization or truncation; check the chat template and "
            "pack.overlong, then re-run `pack`",
        )
    if skipped:
        return CheckResult(name, "skip", f"ranks {skipped}: lengths inconsistent, see lengths_fit")
    return CheckResult(name, "pass", f"all {shards.n_sequences} packed sequences carry labels")


def check_labels_aligned(shards: Shards) -> CheckResult:
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
            return CheckResult(
                name,
                "fail",
                f"{int(wrong.sum())} label(s) are neither their token's id nor {IGNORE} (first: "
                f"{_source(s, seq)}: label {s.labels[token]}, input id {s.input_ids[token]}); "
                "labels shifted or built by another tokenizer; re-run `pack`",
            )
    if skipped:
        return CheckResult(name, "skip", f"ranks {skipped}: labels misaligned, see lengths_fit")
    return CheckResult(name, "pass", f"every label is its token's id or {IGNORE}")


def check_vocab(shards: Shards, embedding_rows: int, tokenizer_size: int) -> CheckResult:
    name = "vocab_fits"
    if tokenizer_size > embedding_rows:
        return CheckResult(
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
        return CheckResult(
            name,
            "fail",
            f"token id {bad} is outside the embedding's {embedding_rows} rows: the data was "
            "tokenized with another tokenizer; re-run `pack`",
        )
    return CheckResult(
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
    tokenizer: PreTrainedTokenizerBase,
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
    tokenizer: PreTrainedTokenizerBase,
    seq_len: int,
    n_checked: int,
) -> CheckResult:
    """Sampled packed sequences decode to the chat-template rendering of their source chat."""
    name = "template_roundtrip"
    without = [r for r, s in shards.ranks.items() if s.sample_indices is None]
    if without:
        return CheckResult(
            name,
            "fail",
            f"ranks {without}: no {SOURCE_COLUMN} column, so packed sequences cannot be traced "
            "to their source; re-run `pack`",
        )
    if packed_samples is not None and packed_samples != len(source_lines):
        return CheckResult(
            name,
            "fail",
            f"pack packed {packed_samples} samples but train.jsonl has {len(source_lines)} "
            "rows: the packed data is stale; re-run `pack`",
        )
    usable = [s for s in shards.ranks.values() if s.consistent and len(s.seq_lengths)]
    sizes = np.array([len(s.seq_lengths) for s in usable], dtype=np.int64)
    if not sizes.sum():
        return CheckResult(name, "skip", "no consistent shard to sample (see lengths_fit)")
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
        return CheckResult(
            name,
            "fail",
            f"{len(failures)} of {len(picks)} sampled packed sequences do not round-trip "
            f"(first: {failures[0]}); re-run `pack` with the base model's tokenizer",
        )
    return CheckResult(
        name,
        "pass",
        f"{len(picks)} sampled packed sequences decode to their train.jsonl chat's template "
        "rendering, tokens and assistant-only labels included",
    )


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


def user_turns(train_jsonl: Path) -> tuple[pa.ChunkedArray, np.ndarray]:
    """Every user turn of a chats file and the row it is on, read in C++ (no per-line json)."""
    if not train_jsonl.stat().st_size:
        return pa.chunked_array([], pa.string()), np.zeros(0, dtype=np.int64)
    table = pa_json.read_json(
        train_jsonl,
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
    train_jsonl: Path, eval_questions: Sequence[tuple[str, str]]
) -> CheckResult:
    """No eval-suite question among the training data's user turns (normalised, hash lookup)."""
    name = "no_eval_contamination"
    if not eval_questions:
        return CheckResult(name, "warn", "no eval suite found: contamination cannot be checked")
    turns, rows = user_turns(train_jsonl)
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
        return CheckResult(
            name,
            "fail",
            f"{hits.size} user turn(s) in {train_jsonl} are eval items (first: row "
            f"{int(rows[first])} = {item_of[question]}, {question!r}); training on them "
            "inflates the gate's score. Re-run `clean`, which decontaminates against eval/",
        )
    return CheckResult(
        name,
        "pass",
        f"none of {len(turns)} user turns matches the {len(eval_questions)} eval questions",
    )


# --- config checks ---------------------------------------------------------------------


_WORST: tuple[Status, ...] = ("fail", "warn", "skip", "pass")


def _worst(statuses: Sequence[Status]) -> Status:
    return min(statuses, key=_WORST.index, default="pass")


def check_learning_rate(method: str, rates: Mapping[str, tuple[str, float]]) -> CheckResult:
    """``rates``: phase -> (its param key, its learning rate), for each phase the run trains."""
    name = "learning_rate"
    statuses: list[Status] = []
    notes = []
    for phase, (key, rate) in rates.items():
        band = LR_BANDS.get((phase, method))
        if band is None:
            statuses.append("fail")
            notes.append(f"no learning-rate band for {phase} with {method}; add it to LR_BANDS")
            continue
        usual = f"usual {band.low:g}-{band.high:g} ({band.source})"
        if rate >= band.absurd:
            statuses.append("fail")
            notes.append(f"{key}={rate:g} >= {band.absurd:g} diverges ({usual})")
        elif not band.low <= rate <= band.high:
            statuses.append("warn")
            notes.append(
                f"{key}={rate:g} is outside the {usual}: fine for a tiny model from random "
                "init, otherwise expect a forgetful or unmoved model"
            )
        else:
            statuses.append("pass")
            notes.append(f"{key}={rate:g} within the {usual}")
    return CheckResult(name, _worst(statuses), "; ".join(notes))


def check_warmup(warmup_ratio: float, total_steps: int) -> CheckResult:
    name = "warmup"
    steps = math.ceil(warmup_ratio * total_steps)
    shown = f"train.warmup_ratio={warmup_ratio:g} ({steps} of {total_steps} steps)"
    low, high = WARMUP_BAND
    if warmup_ratio >= WARMUP_ABSURD:
        return CheckResult(
            name, "fail", f"{shown}: the learning rate would ramp for most of the run"
        )
    if not low <= warmup_ratio <= high:
        return CheckResult(name, "warn", f"{shown} is outside the usual {low:g}-{high:g}")
    return CheckResult(name, "pass", shown)


def check_lora_shape(method: str, rank: int, alpha: int) -> CheckResult:
    name = "lora_shape"
    if method not in ADAPTER_METHODS:
        return CheckResult(name, "skip", f"method {method!r} trains no adapter")
    shown = f"train.lora_r={rank}, alpha={alpha} (alpha/r {alpha / rank:g})"
    if alpha <= 0 or alpha / rank >= LORA_ALPHA_RATIO_ABSURD:
        return CheckResult(
            name,
            "fail",
            f"{shown}: the adapter's update is scaled by alpha/r, so this "
            f"{'freezes it' if alpha <= 0 else 'multiplies the learning rate'}; "
            "usual alpha = 2 x r (leave train.lora_alpha null)",
        )
    ratio_low, ratio_high = LORA_ALPHA_RATIO_BAND
    rank_low, rank_high = LORA_RANK_BAND
    notes = []
    if not ratio_low <= alpha / rank <= ratio_high:
        notes.append(f"alpha/r outside the usual {ratio_low:g}-{ratio_high:g} (guide: 2)")
    if not rank_low <= rank <= rank_high:
        notes.append(f"r outside the guide's {rank_low}-{rank_high}")
    if notes:
        return CheckResult(name, "warn", f"{shown}: {'; '.join(notes)}")
    return CheckResult(name, "pass", shown)


def check_effective_batch(batch: BatchParams, plan: StepPlan) -> CheckResult:
    name = "effective_batch"
    shown = (
        f"batch.effective_batch={batch.effective_batch} bins x "
        f"{plan.samples_per_step / batch.effective_batch if batch.effective_batch else 0:.1f} "
        f"samples per bin = {plan.samples_per_step:.0f} samples per optimizer step"
    )
    if plan.steps_per_epoch == 0:
        return CheckResult(
            name, "fail", f"{shown}, but the shards give no whole optimizer step; add data"
        )
    low, high = SAMPLES_PER_STEP_BAND
    if not low <= plan.samples_per_step <= high:
        return CheckResult(
            name,
            "warn",
            f"{shown}, outside the usual {low}-{high} (guide); raise or lower "
            "batch.effective_batch (gradient accumulation follows)",
        )
    return CheckResult(name, "pass", shown)


def check_epochs(epochs: float, max_steps: int, plan: StepPlan) -> CheckResult:
    name = "epochs"
    if not plan.steps_per_epoch:
        return CheckResult(name, "skip", "the shards give no optimizer step (see effective_batch)")
    if max_steps > 0:
        shown = (
            f"train.max_steps={max_steps} = {plan.epochs:.2f} epochs of "
            f"{plan.steps_per_epoch} steps"
        )
    else:
        shown = f"train.epochs={epochs:g} = {plan.total_steps} optimizer steps"
    if plan.epochs > EPOCHS_ABSURD:
        return CheckResult(
            name,
            "fail",
            f"{shown}: more than {EPOCHS_ABSURD:g} passes memorise the data (steps given as "
            "epochs?)",
        )
    low, high = EPOCH_BAND
    if not low <= plan.epochs <= high:
        return CheckResult(
            name, "warn", f"{shown}, outside the usual {low:g}-{high:g}; watch the val loss"
        )
    return CheckResult(name, "pass", shown)


# --- environment checks ----------------------------------------------------------------


PRECISIONS = ("auto", "fp32", "bf16", "fp16", "fp8")
# The lowest compute capability each precision needs (bf16 arrived with Ampere, FP8 with Ada).
MIN_CC = {"bf16": doctor.BF16_MIN_CC, "fp8": doctor.FP8_MIN_CC}


def check_precision(requested: str, decided: str | None, inv: doctor.GpuInventory) -> CheckResult:
    """The precision asked for and the one train decided, against every GPU's capability.

    ``decided`` is None when train could not plan the run (see train_plan). torch answers
    "bf16?" for GPU 0 only; NVML sees every GPU, so a mixed node is caught here.
    """
    name = "precision"
    if requested not in PRECISIONS:
        return CheckResult(name, "fail", f"unknown precision {requested!r}; one of {PRECISIONS}")
    if inv.fault:
        return CheckResult(name, "fail", f"GPU inventory failed: {inv.fault}")
    shown = f"requested {requested}, train decided {decided or '(no plan)'}"
    wanted = requested if requested != "auto" else decided
    if not inv.gpus:
        if wanted not in (None, "fp32"):
            return CheckResult(name, "fail", f"{shown}, but there is no CUDA device ({inv.error})")
        return CheckResult(
            name, "pass", f"{shown}: no CUDA device (bf16 needs sm 8.0+, FP8 sm 8.9+)"
        )
    lowest = min(g.compute_capability for g in inv.gpus)
    sm = f"sm {lowest[0]}.{lowest[1]}"
    if wanted in MIN_CC and lowest < MIN_CC[wanted]:
        need = MIN_CC[wanted]
        return CheckResult(
            name,
            "fail",
            f"{shown}, but the lowest GPU is {sm}; {wanted} needs sm {need[0]}.{need[1]}+",
        )
    if lowest < doctor.BF16_MIN_CC:
        return CheckResult(
            name,
            "warn",
            f"{shown} on {sm}: no bf16, so fp16 with loss scaling, or fp32 at half speed",
        )
    fp8 = "and FP8" if lowest >= doctor.FP8_MIN_CC else "(FP8 needs sm 8.9+)"
    return CheckResult(name, "pass", f"{shown} on {sm}: bf16 {fp8} available")


def training_environment(world_size: int) -> Environment:
    """The machine as train will see it (``Environment.probe``), launched as it will be.

    One node: ``dvc repro`` starts train without a launcher and it re-execs under torchrun.
    More ranks than this node's GPUs: a launcher starts every rank on every node with
    WORLD_SIZE = world_size, so the plan is judged as those ranks will see it (whole nodes
    are the devices check's business).
    """
    env = Environment.probe()
    if env.cuda and world_size > env.cuda_devices:
        return dataclasses.replace(env, launcher_world_size=world_size)
    return env


def decided_precision(params: Params, env: Environment) -> str | None:
    try:
        return resolve_plan(params, env).precision
    except TrainSetupError:
        return None


def check_train_plan(params: Params, env: Environment) -> CheckResult:
    """What train itself would refuse at start, after minutes of loading: refused now."""
    name = "train_plan"
    try:
        plan = resolve_plan(params, env)
    except TrainSetupError as error:
        return CheckResult(name, "fail", str(error).replace("\n", "; "))
    shown = ", ".join(f"{k} {v}" for k, v in plan.describe().items() if v is not None)
    return CheckResult(name, "pass", shown)


def visible_gpus(inv: doctor.GpuInventory, env: Mapping[str, str]) -> int:
    """GPUs a launched process can use: CUDA_VISIBLE_DEVICES narrows NVML's list."""
    listed = env.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return len(inv.gpus)
    entries = [e.strip() for e in listed.split(",") if e.strip()]
    # CUDA stops at the first invalid entry; "-1" is the usual way to hide every GPU.
    valid = len(entries) if "-1" not in entries else entries.index("-1")
    return min(valid, len(inv.gpus))


def check_devices(
    world_size: int, inv: doctor.GpuInventory, visible: int, cuda_available: bool
) -> CheckResult:
    """batch.world_size against the GPUs NVML sees and a process here may use.

    (How train.distributed fits world_size is train's own rule: see train_plan.)
    """
    name = "devices"
    if inv.fault:
        return CheckResult(name, "fail", f"GPU inventory failed: {inv.fault}")
    if not inv.gpus:
        if world_size > 1:
            return CheckResult(
                name,
                "warn",
                f"batch.world_size={world_size} on a host without GPU: gloo runs it on CPU, "
                "for tests, not for training",
            )
        return CheckResult(name, "pass", f"no GPU ({inv.error}): one CPU process")
    if not cuda_available:
        return CheckResult(
            name,
            "fail",
            f"NVML sees {len(inv.gpus)} GPU(s) but torch cannot use CUDA (a CPU-only torch build "
            "or a driver too old for it): training would run on the CPU",
        )
    if visible == 0:
        return CheckResult(name, "fail", "CUDA_VISIBLE_DEVICES hides every GPU")
    if world_size < visible:
        return CheckResult(
            name,
            "warn",
            f"batch.world_size={world_size} leaves {visible - world_size} of {visible} visible "
            "GPUs idle; raise it or narrow CUDA_VISIBLE_DEVICES",
        )
    if world_size % visible:
        return CheckResult(
            name,
            "fail",
            f"batch.world_size={world_size} is no whole number of nodes of {visible} GPUs",
        )
    nodes = world_size // visible
    return CheckResult(
        name,
        "pass",
        f"{world_size} rank(s) = {nodes} node(s) x {visible} GPU(s)"
        + (f"; launch with torchrun --nnodes {nodes}" if nodes > 1 else ""),
    )


_DOCTOR_STATUS: dict[str, Status] = {
    "ok": "pass",
    "warn": "warn",
    "fail": "fail",
    "skipped": "skip",
}


def check_interconnect(
    inv: doctor.GpuInventory, env: Mapping[str, str], multi_node: bool
) -> CheckResult:
    """NVLink as NVML sees it, and NCCL settings that slow collectives or keep a hang silent."""
    name = "interconnect"
    if not inv.gpus and not inv.fault:
        return CheckResult(name, "skip", f"no GPU ({inv.error}): NVLink and NCCL do not apply")
    nvlink = doctor.check_nvlink(inv)
    status, notes = _DOCTOR_STATUS[nvlink.status], [nvlink.detail]
    if inv.fault:
        status = "fail"
    if env.get("NCCL_P2P_DISABLE") == "1" and len(inv.gpus) > 1:
        status = "warn" if status == "pass" else status
        notes.append("NCCL_P2P_DISABLE=1 sends every transfer through host memory, not NVLink")
    if env.get("NCCL_IB_DISABLE") == "1" and multi_node:
        status = "warn" if status == "pass" else status
        notes.append("NCCL_IB_DISABLE=1 puts inter-node traffic on TCP sockets")
    if env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING") == "0":
        status = "warn" if status == "pass" else status
        notes.append("TORCH_NCCL_ASYNC_ERROR_HANDLING=0: a hung collective never raises")
    settings = sorted(f"{k}={v}" for k, v in env.items() if k.startswith(("NCCL_", "TORCH_NCCL_")))
    notes.append(f"NCCL settings: {', '.join(settings) or 'none set'}")
    return CheckResult(name, status, "; ".join(notes))


def model_weight_bytes(model_ref: str) -> int | None:
    """Size of the base model's weights, from its files (local or in the HF cache), no download."""
    folder = Path(model_ref)
    if folder.is_dir():
        index = next(iter(sorted(folder.glob("*.safetensors.index.json"))), None)
        if index is not None:
            return int(read_json(index)["metadata"]["total_size"])
        weights = [*folder.glob("*.safetensors"), *folder.glob("pytorch_model*.bin")]
        return sum(p.stat().st_size for p in weights) or None
    from huggingface_hub import try_to_load_from_cache

    for filename in ("model.safetensors.index.json", "model.safetensors"):
        cached = try_to_load_from_cache(model_ref, filename)
        if isinstance(cached, str):
            path = Path(cached)
            return (
                int(read_json(path)["metadata"]["total_size"])
                if filename.endswith(".json")
                else path.stat().st_size
            )
    return None


def _size(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def checkpoint_bytes(method: str, weight_bytes: int, save_total_limit: int, phases: int) -> int:
    """What train keeps per phase: the newest ``save_total_limit`` checkpoints and the best one
    (with optimizer state), and the phase's final weights."""
    factor = 1 if method in ADAPTER_METHODS else FULL_CHECKPOINT_FACTOR
    return phases * ((save_total_limit + 1) * factor * weight_bytes + weight_bytes)


def existing_parent(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def check_checkpoint_disk(
    folder: Path,
    method: str,
    weight_bytes: int | None,
    save_total_limit: int,
    phases: int,
    free_bytes: int,
) -> CheckResult:
    name = "checkpoint_disk"
    if weight_bytes is None:
        return CheckResult(
            name, "skip", "cannot size the base model's weights offline (not local, not cached)"
        )
    needed = checkpoint_bytes(method, weight_bytes, save_total_limit, phases)
    shown = (
        f"{folder}: {_size(free_bytes)} free; a {method} run on {_size(weight_bytes)} of weights "
        f"keeps ~{_size(needed)} ({phases} phase(s) x {save_total_limit} newest + best "
        "checkpoints + final weights)"
    )
    if free_bytes < needed:
        return CheckResult(
            name, "fail", f"{shown}: the run would die at its first save; free space first"
        )
    return CheckResult(name, "pass", shown)


def check_checkpoint_dir(folder: Path, dvc_outs: Sequence[Path], packed: Path) -> CheckResult:
    """Writable, outside every DVC-managed folder, ideally on another disk than the data."""
    name = "checkpoint_dir"
    resolved = folder.resolve()
    for out in dvc_outs:
        if resolved.is_relative_to(out.resolve()):
            return CheckResult(
                name,
                "fail",
                f"{folder} is inside {out}, a DVC out: the next stage run replaces that "
                "folder and the checkpoints with it",
            )
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".preflight-"):
            pass
    except OSError as exc:
        return CheckResult(name, "fail", f"{folder} is not writable ({exc})")
    if packed.exists() and os.stat(folder).st_dev == os.stat(packed).st_dev:
        return CheckResult(
            name,
            "warn",
            f"{folder} is writable, on the same device as {packed}: checkpoint saves (tens of "
            "GB at once) stall data reads; put checkpoints on another disk",
        )
    return CheckResult(name, "pass", f"{folder} is writable, on another device than the data")


def check_stop_loss(max_wall_hours: float | None, world_size: int, on_gpu: bool) -> CheckResult:
    name = "stop_loss"
    if max_wall_hours is None:
        # On GPUs an unbounded run burns rented hours; on a CPU (the demo, tests) it costs none.
        return CheckResult(
            name,
            "fail" if on_gpu else "warn",
            "no stop-loss budget: set train.max_wall_hours, so a run that hangs or overruns is "
            "ended instead of burning GPU hours until someone notices",
        )
    return CheckResult(
        name,
        "pass",
        f"train.max_wall_hours={max_wall_hours:g}: at most "
        f"{max_wall_hours * world_size:g} device-hours on {world_size} rank(s)",
    )


# --- running them ----------------------------------------------------------------------


@dataclass(frozen=True)
class Report:
    checks: list[CheckResult]
    seconds: float
    """The whole gate: reading everything and every check."""
    read_seconds: float
    """Reading the shards, the tokenizer, the model config and the GPU inventory."""
    plan: StepPlan

    @property
    def failed(self) -> list[CheckResult]:
        return [c for c in self.checks if c.status == "fail"]

    def counts(self) -> dict[str, int]:
        return {
            s: sum(c.status == s for c in self.checks) for s in ("pass", "warn", "fail", "skip")
        }

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": not self.failed,
            "seconds": round(self.seconds, 4),
            "read_seconds": round(self.read_seconds, 4),
            "counts": self.counts(),
            "plan": asdict(self.plan),
            "checks": [asdict(c) for c in self.checks],
        }


def run_checks(checks: Sequence[Callable[[], CheckResult]]) -> list[CheckResult]:
    results = []
    for check in checks:
        start = time.perf_counter()
        result = check()
        results.append(
            CheckResult(result.name, result.status, result.detail, time.perf_counter() - start)
        )
    return results


def phase_rates(train: TrainParams) -> dict[str, tuple[str, float]]:
    keys = {
        "sft": ("train.learning_rate", train.learning_rate),
        "dpo": ("train.dpo_learning_rate", train.dpo_learning_rate),
    }
    return {phase: keys[phase] for phase in train.phases}


def dvc_out_folders(params: Params) -> list[Path]:
    p = params.paths
    return [p.incoming, p.pool, p.clean, p.packed, p.base_model, p.adapter, p.merged, p.fp8]


def run_preflight(
    params: Params, env: Mapping[str, str] = os.environ, nvml: doctor.Nvml = pynvml
) -> Report:
    """Every check on this project's data, config and machine."""
    started = time.perf_counter()
    paths, train, batch = params.paths, params.train, params.batch
    ref = base_model_ref(params)
    shards = Shards.read(paths.packed, batch.world_size)
    context, embedding_rows = model_limits(ref)
    tokenizer = load_tokenizer(ref)
    inv = doctor.read_gpus(nvml)
    machine = training_environment(batch.world_size)
    plan = StepPlan.of(shards, batch, train.epochs, train.max_steps)
    read_seconds = time.perf_counter() - started

    def roundtrip() -> CheckResult:
        lines = [
            line for line in (paths.clean / "train.jsonl").read_bytes().split(b"\n") if line.strip()
        ]
        manifest = paths.packed / "manifest.json"
        packed_samples = read_json(manifest).get("samples") if manifest.exists() else None
        return check_template_roundtrip(
            shards,
            lines,
            packed_samples,
            tokenizer,
            params.pack.seq_len,
            params.preflight.roundtrip_samples,
        )

    def disk() -> CheckResult:
        free = shutil.disk_usage(existing_parent(CHECKPOINTS)).free
        return check_checkpoint_disk(
            CHECKPOINTS,
            train.method,
            model_weight_bytes(ref),
            train.save_total_limit,
            len(train.phases),
            free,
        )

    visible = visible_gpus(inv, env)
    checks: list[Callable[[], CheckResult]] = [
        lambda: check_shards_complete(shards, params.preflight.min_train_bins),
        lambda: check_ranks_balanced(shards, batch, plan),
        lambda: check_lengths(shards, params.pack.seq_len, context),
        lambda: check_labels_present(shards),
        lambda: check_labels_aligned(shards),
        lambda: check_vocab(shards, embedding_rows, len(tokenizer)),
        roundtrip,
        lambda: check_eval_contamination(
            paths.clean / "train.jsonl", list(suites.questions(paths.eval_suites))
        ),
        lambda: check_learning_rate(train.method, phase_rates(train)),
        lambda: check_warmup(train.warmup_ratio, plan.total_steps),
        lambda: check_lora_shape(train.method, train.lora_r, train.resolved_lora_alpha),
        lambda: check_effective_batch(batch, plan),
        lambda: check_epochs(train.epochs, train.max_steps, plan),
        lambda: check_train_plan(params, machine),
        # train has no precision knob: it decides (bf16 where the GPUs have it).
        lambda: check_precision("auto", decided_precision(params, machine), inv),
        lambda: check_devices(batch.world_size, inv, visible, machine.cuda),
        lambda: check_interconnect(inv, env, multi_node=batch.world_size > max(visible, 1)),
        disk,
        lambda: check_checkpoint_dir(CHECKPOINTS, dvc_out_folders(params), paths.packed),
        lambda: check_stop_loss(train.max_wall_hours, batch.world_size, bool(inv.gpus)),
    ]
    results = run_checks(checks)
    return Report(results, time.perf_counter() - started, read_seconds, plan)


def report_markdown(report: Report) -> str:
    counts = report.counts()
    verdict = "REFUSED" if report.failed else "passed"
    lines = [
        f"# preflight {verdict}",
        "",
        f"{counts['fail']} failed, {counts['warn']} warnings, {counts['pass']} passed, "
        f"{counts['skip']} skipped in {report.seconds:.2f} s "
        f"({report.read_seconds:.2f} s reading).",
        "",
        "| check | status | time | detail |",
        "|---|---|---|---|",
    ]
    for c in report.checks:
        detail = c.detail.replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {c.name} | {c.status} | {c.seconds * 1000:.1f} ms | {detail} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    setup_logging()
    params = load_params()
    with stage_run(STAGE, params):
        report = run_preflight(params)
        data = report.as_dict()
        table = report_markdown(report)
        write_json(params.paths.reports / "preflight.json", data)
        write_text(params.paths.reports / "preflight.md", table)
        write_metrics(
            params,
            STAGE,
            {
                "seconds": data["seconds"],
                "read_seconds": data["read_seconds"],
                "passed": data["counts"]["pass"],
                "warnings": data["counts"]["warn"],
                "failed": data["counts"]["fail"],
                "skipped": data["counts"]["skip"],
                "optimizer_steps": report.plan.total_steps,
            },
        )
        mlflow.log_dict(data, "preflight/preflight.json")
        mlflow.log_text(table, "preflight/preflight.md")
        mlflow.set_tags({f"preflight.{c.name}": c.status for c in report.checks})
        print(table)
        for c in report.checks:
            if c.status == "warn":
                log.warning("%s: %s", c.name, c.detail)
        if report.failed:
            raise SystemExit(
                "preflight refused the run:\n"
                + "\n".join(f"  {c.name}: {c.detail}" for c in report.failed)
            )
        log.info("preflight passed in %.2f s", report.seconds)


if __name__ == "__main__":
    main()
