"""Loading the base model and tokenizer, wherever ``model.base`` points.

torch and transformers are imported by the functions that load weights or a transformers
tokenizer, not by this module: the data stages import it for ``base_model_ref`` only and
start seconds sooner for it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

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


def base_model_ref(params: Params) -> str:
    """The folder or hub id to load the base model from.

    ``builtin:tiny`` is built by the ``base`` stage into ``paths.base_model``;
    any other value is used as given (a hub id or a local folder).
    """
    if params.model.is_builtin:
        return str(params.paths.base_model)
    return params.model.base


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
    """``(context length, embedding rows)`` from the model's config, without loading weights."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model_ref))
    text_config = config.get_text_config()
    context = int(getattr(text_config, "max_position_embeddings", 0) or 0)
    return context, int(text_config.vocab_size)
