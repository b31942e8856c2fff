"""Typed, frozen view of ``params.yaml``: the one source of every knob.

``load_params()`` reads the file once and validates it into the models below.
Unknown keys are an error (a typo must not silently fall back to a default),
and a wrong value fails here, naming its key, before any stage does work.
Values derived from others (LoRA alpha, gradient accumulation) are computed
here and nowhere else.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

# Relative to the working directory, as in DVC: stages run from the project root.
PARAMS_FILE = Path("params.yaml")


class ParamsError(ValueError):
    """params.yaml is missing, malformed or holds a wrong value; the message names the key."""


class _Group(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TinyModel(_Group):
    """Shape of the embedded default model (``model.base: builtin:tiny``)."""

    hidden_size: int = Field(gt=0)
    num_hidden_layers: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    vocab_size: int = Field(ge=512, description="target size of the locally trained tokenizer")
    max_position_embeddings: int = Field(gt=0)

    @model_validator(mode="after")
    def _heads_divide(self) -> TinyModel:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        return self


class ModelParams(_Group):
    base: str = Field(
        description="'builtin:tiny', a Hugging Face model id, or a local model folder",
        min_length=1,
    )
    seed: int
    tiny: TinyModel

    @property
    def is_builtin(self) -> bool:
        return self.base.startswith("builtin:")

    @model_validator(mode="after")
    def _known_builtin(self) -> ModelParams:
        if self.is_builtin and self.base != "builtin:tiny":
            raise ValueError(f"unknown builtin model {self.base!r}; the only one is 'builtin:tiny'")
        return self


class PathsParams(_Group):
    incoming: Path
    pool: Path
    clean: Path
    packed: Path
    base_model: Path
    adapter: Path
    merged: Path
    fp8: Path
    metrics: Path
    reports: Path
    eval_suites: Path


class DemoParams(_Group):
    """The synthetic customer-service domain that the embedded default ships."""

    seed: int
    n_support: int = Field(gt=0, description="support-tool chats seeded into incoming/")
    n_badcases: int = Field(ge=0, description="router badcases (wrong answer + correction)")
    n_eval: int = Field(gt=0, description="items of the demo business eval suite")


class IngestParams(_Group):
    max_reject_rate: float = Field(ge=0, le=1)
    max_line_bytes: int = Field(gt=0)


class CleanParams(_Group):
    val_fraction: float = Field(gt=0, lt=0.5)
    min_response_chars: int = Field(ge=1)
    max_tokens: int = Field(ge=16, description="a conversation longer than this is filtered")
    min_distinct_ngrams: float = Field(
        ge=0, le=1, description="below this share of distinct 4-grams a reply is degenerate"
    )
    near_dup_threshold: float = Field(gt=0, le=1, description="MinHash Jaccard for near-dups")
    decontam_threshold: float = Field(
        gt=0, le=1, description="MinHash Jaccard at which a user turn matches an eval item"
    )
    pilot_fraction: float = Field(gt=0, le=1, description="1.0 = the full data set")


class BatchParams(_Group):
    """How packed bins are laid out over ranks and steps; shared by pack, preflight, train."""

    world_size: int = Field(ge=1, description="training processes (GPUs)")
    micro_batch_size: int = Field(ge=1, description="packed bins per rank per forward pass")
    effective_batch: int = Field(ge=1, description="packed bins per optimizer step, all ranks")

    @model_validator(mode="after")
    def _divisible(self) -> BatchParams:
        per_pass = self.world_size * self.micro_batch_size
        if self.effective_batch % per_pass:
            raise ValueError(
                f"effective_batch ({self.effective_batch}) must be a multiple of "
                f"world_size x micro_batch_size ({per_pass})"
            )
        return self

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.effective_batch // (self.world_size * self.micro_batch_size)


class PackParams(_Group):
    seq_len: int = Field(ge=16)
    overlong: Literal["truncate", "drop", "split"]


class PreflightParams(_Group):
    min_train_bins: int = Field(ge=1)


class TrainParams(_Group):
    method: Literal["lora"]
    learning_rate: float = Field(gt=0, lt=1)
    epochs: float = Field(gt=0)
    max_steps: int = Field(ge=-1, description="-1 = run the epochs")
    warmup_ratio: float = Field(ge=0, lt=1)
    lr_scheduler: Literal["cosine", "linear", "constant_with_warmup"]
    weight_decay: float = Field(ge=0)
    lora_r: int = Field(ge=1)
    lora_alpha: int | None = Field(default=None, description="null = 2 x lora_r")
    lora_dropout: float = Field(ge=0, lt=1)
    target_modules: tuple[str, ...] = Field(min_length=1)
    logging_steps: int = Field(ge=1)
    seed: int

    @property
    def resolved_lora_alpha(self) -> int:
        return self.lora_alpha if self.lora_alpha is not None else 2 * self.lora_r


class MergeParams(_Group):
    dtype: Literal["float32", "bfloat16", "float16"]
    max_abs_logit_diff: float = Field(gt=0)


class ExportParams(_Group):
    scheme: Literal["FP8_DYNAMIC"]
    ignore: tuple[str, ...]


class EvaluateParams(_Group):
    suites: tuple[str, ...] = Field(min_length=1)
    batch_size: int = Field(ge=1)
    limit: int | None = Field(default=None, ge=1, description="null = every item")


class GateParams(_Group):
    primary_metric: str
    min_gain: float = Field(ge=0)


class TrackingParams(_Group):
    experiment: str = Field(min_length=1)
    registered_model: str = Field(min_length=1)


class Params(_Group):
    model: ModelParams
    paths: PathsParams
    demo: DemoParams
    ingest: IngestParams
    clean: CleanParams
    batch: BatchParams
    pack: PackParams
    preflight: PreflightParams
    train: TrainParams
    merge: MergeParams
    export: ExportParams
    evaluate: EvaluateParams
    gate: GateParams
    tracking: TrackingParams


def _describe(error: ValidationError, source: Path) -> str:
    lines = [f"{source}: {error.error_count()} invalid value(s):"]
    for item in error.errors():
        key = ".".join(str(part) for part in item["loc"])
        if item["type"] == "extra_forbidden":
            lines.append(f"  {key}: unknown key (a typo? remove it or fix its spelling)")
        elif item["type"] == "missing":
            lines.append(f"  {key}: required key is missing")
        else:
            lines.append(f"  {key}: {item['msg']} (got {item.get('input')!r})")
    return "\n".join(lines)


def parse_params(data: object, source: Path = PARAMS_FILE) -> Params:
    try:
        return Params.model_validate(data)
    except ValidationError as error:
        raise ParamsError(_describe(error, source)) from None


def load_params(path: Path | None = None) -> Params:
    """Read and validate params.yaml (the project's own unless ``path`` is given)."""
    source = path or PARAMS_FILE
    try:
        data = yaml.safe_load(source.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ParamsError(f"{source} not found") from None
    except yaml.YAMLError as error:
        raise ParamsError(f"{source} is not valid YAML: {error}") from None
    return parse_params(data, source)
