"""What the data stages record: ``metrics/ingest.json``, ``clean.json`` and ``pack.json``.

``tuneloop.data.ingest``, ``clean_cache`` and ``pack`` compute them; they are defined here, apart,
so that a reader in another stage (the cards that ``evaluate`` writes, the registration tags)
depends on this file alone, not on the code that ingests, cleans and packs.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class FolderCounts(BaseModel):
    """One task's folder under ``paths.incoming``: its lines, each ending in one outcome."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    lines: int = Field(description="every line: accepted + quarantined + duplicates + blank")
    accepted: int = Field(description="lines whose record joined the pool")
    quarantined: int = Field(description="invalid lines, set aside in quarantine with a reason")
    duplicates: int = Field(description="lines whose record the pool already holds")
    blank: int = Field(description="lines of whitespace only")


class IngestMetrics(BaseModel):
    """``metrics/ingest.json``: what one ingest run did with the lines under ``paths.incoming``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    lines: int = Field(description="non-blank lines read: accepted + quarantined + duplicates")
    accepted: int = Field(description="lines whose record joined the pool")
    accepted_by_source: dict[str, int] = Field(description="accepted records by their meta.source")
    accepted_by_task: dict[str, int] = Field(
        description="accepted records by the task they are for (not counting the copies a "
        "task on every task's records gets)"
    )
    quarantined: int = Field(description="invalid lines, set aside in quarantine with a reason")
    duplicates: int = Field(description="lines whose record the pool already holds")
    blank_lines: int = Field(description="lines of whitespace only, not counted in lines")
    reject_rate: float = Field(description="quarantined / lines")
    quarantine_reasons: dict[str, int] = Field(description="quarantined lines by kind of error")
    pii_scrubbed: dict[str, int] = Field(description="placeholders put in, by kind of PII")
    pool_records: int = Field(
        description="records in the pool after the run (before it, when the run was refused)"
    )
    by_task_folder: dict[str, FolderCounts] = Field(
        description="by the task folder a line lay in ('elsewhere': no task's); in a project "
        "of one task, every line is that task's"
    )


class ReplayMetrics(BaseModel):
    """How much of the pool batches the start already trained on this training set sees again."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    fraction: float = Field(
        description="clean.replay_fraction: the share of seen batches' training chats kept"
    )
    seen_batches: tuple[str, ...] = Field(description="pool batches the start trained on")
    new_batches: tuple[str, ...] = Field(description="the others, trained on in full")
    replayed_train: int = Field(description="training chats of seen batches, kept at the share")
    new_train: int = Field(description="training chats of new batches")
    not_replayed: int = Field(description="training chats of seen batches left out")
    replayed_dpo_pairs: int = Field(description="DPO pairs of seen batches kept")


class CleanMetrics(BaseModel):
    """``metrics/clean.json``: every pooled record kept (train, val) or removed with a reason."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    records_in: int = Field(description="pooled records read: train + val + sum(removed)")
    train: int = Field(description="chats kept for training")
    val: int = Field(description="chats kept for validation")
    train_tokens: int = Field(description="tokens of the training chats, chat template applied")
    dpo_pairs: int = Field(description="DPO pairs kept")
    removed: dict[str, int] = Field(description="records removed, by reason (clean.REASONS)")
    dpo_removed: dict[str, int] = Field(
        description="DPO pairs removed though their chat was kept, by reason"
    )
    batches: tuple[str, ...] = Field(
        description="the pool batches this training set drew from, oldest first (its lineage)"
    )
    replay: ReplayMetrics = Field(
        description="how much of the batches the start trained on this training set sees again"
    )


class PackMetrics(BaseModel):
    """``metrics/pack.json``: the training split's bins, how they are dealt to the ranks, and
    the validation split's bins."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    samples: int = Field(description="training chats in")
    bins: int = Field(description="bins of at most pack.seq_len tokens the chats were packed into")
    real_tokens: int = Field(description="packed tokens, padding left out")
    label_tokens: int = Field(description="packed tokens with a label: those trained on")
    efficiency: float = Field(description="real tokens / (bins x pack.seq_len)")
    truncated: int = Field(description="chats cut to pack.seq_len (pack.overlong: truncate)")
    dropped_overlong: int = Field(
        description="chats longer than pack.seq_len left out (pack.overlong: drop)"
    )
    split_overlong: int = Field(
        description="chats cut into pack.seq_len chunks (pack.overlong: split)"
    )
    samples_without_labels: int = Field(
        description="packed sequences with no token to train on (packed anyway)"
    )
    world_size: int = Field(description="batch.world_size: the ranks the bins are dealt to")
    micro_batch_size: int = Field(description="batch.micro_batch_size: bins per rank per pass")
    gradient_accumulation_steps: int = Field(
        description="micro-batches per optimizer step: batch.effective_batch / (world_size x "
        "micro_batch_size)"
    )
    micro_batches_per_rank: int = Field(description="micro-batches each rank runs in an epoch")
    optimizer_steps_per_epoch: int = Field(description="optimizer steps in one epoch")
    tokens_per_rank: tuple[int, ...] = Field(
        description="tokens each rank trains on in an epoch, by rank"
    )
    max_min_rank_token_ratio: float = Field(
        description="the fullest rank's tokens / the emptiest's"
    )
    bins_dropped_for_balance: int = Field(
        description="the smallest bins left out so every rank runs the same steps"
    )
    tokens_dropped_for_balance: int = Field(description="the tokens in those bins")
    val_samples: int = Field(description="validation chats in")
    val_bins: int = Field(description="bins the validation chats were packed into")


class TaskNames(BaseModel):
    """``metrics/task_names.json``: the names of params.yaml's tasks, in its order. What
    ingest routes records by (stage ``task_names``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tasks: tuple[str, ...] = Field(description="the tasks ingest routes records to")
    count: int = Field(description="how many")
    all_records: tuple[str, ...] = Field(
        default=(),
        description="the tasks that train on every task's records (`records: all`): ingest "
        "copies each batch's records into their folders too",
    )
