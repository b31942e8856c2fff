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

    lines: int  # accepted + quarantined + duplicates + blank
    accepted: int
    quarantined: int
    duplicates: int
    blank: int


class IngestMetrics(BaseModel):
    """``metrics/ingest.json``: what one ingest run did with the lines under ``paths.incoming``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    lines: int = Field(description="non-blank lines read: accepted + quarantined + duplicates")
    accepted: int
    accepted_by_source: dict[str, int]  # the record's meta.source
    accepted_by_task: dict[str, int]  # empty in a project without tasks
    quarantined: int
    duplicates: int = Field(description="lines whose record the pool already holds")
    blank_lines: int
    reject_rate: float = Field(description="quarantined / lines")
    quarantine_reasons: dict[str, int]
    pii_scrubbed: dict[str, int] = Field(description="placeholders put in, by kind of PII")
    pool_records: int = Field(
        description="records in the pool after the run (before it, when the run was refused)"
    )
    by_task_folder: dict[str, FolderCounts] = Field(
        description="by the task folder a line lay in ('elsewhere': no task's); empty in a "
        "project without tasks"
    )


class ReplayMetrics(BaseModel):
    """How much of the pool batches the start already trained on this training set sees again."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    fraction: float  # clean.replay_fraction
    seen_batches: tuple[str, ...] = Field(description="pool batches the start trained on")
    new_batches: tuple[str, ...] = Field(description="the others, trained on in full")
    replayed_train: int = Field(description="training chats of seen batches, kept at the share")
    new_train: int = Field(description="training chats of new batches")
    not_replayed: int = Field(description="training chats of seen batches left out")
    replayed_dpo_pairs: int


class CleanMetrics(BaseModel):
    """``metrics/clean.json``: every pooled record kept (train, val) or removed with a reason."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    records_in: int  # = train + val + sum(removed)
    train: int
    val: int
    train_tokens: int
    dpo_pairs: int
    removed: dict[str, int] = Field(description="records removed, by reason (clean.REASONS)")
    dpo_removed: dict[str, int] = Field(
        description="DPO pairs removed though their chat was kept, by reason"
    )
    batches: tuple[str, ...] = Field(
        description="the pool batches this training set drew from, oldest first (its lineage)"
    )
    replay: ReplayMetrics


class PackMetrics(BaseModel):
    """``metrics/pack.json``: the training split's bins, how they are dealt to the ranks, and
    the validation split's bins."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    samples: int  # training chats in
    bins: int
    real_tokens: int
    label_tokens: int = Field(description="packed tokens with a label: those trained on")
    efficiency: float = Field(description="real tokens / (bins x pack.seq_len)")
    truncated: int
    dropped_overlong: int
    split_overlong: int
    samples_without_labels: int
    world_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    micro_batches_per_rank: int
    optimizer_steps_per_epoch: int
    tokens_per_rank: tuple[int, ...]
    max_min_rank_token_ratio: float = Field(
        description="the fullest rank's tokens / the emptiest's"
    )
    bins_dropped_for_balance: int = Field(
        description="the smallest bins left out so every rank runs the same steps"
    )
    tokens_dropped_for_balance: int
    val_samples: int
    val_bins: int


class TaskNames(BaseModel):
    """``metrics/task_names.json``: the names of params.yaml's tasks, in its order; empty in a
    project without tasks. What ingest routes records by (stage ``task_names``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tasks: tuple[str, ...] = Field(description="the tasks ingest routes records to")
    count: int = Field(description="how many")
