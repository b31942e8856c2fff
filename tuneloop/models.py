"""Loading the base model and tokenizer, wherever ``model.base`` points."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from tuneloop.params import Params

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def base_model_ref(params: Params) -> str:
    """The folder or hub id to load the base model from.

    ``builtin:tiny`` is built by the ``base`` stage into ``paths.base_model``;
    any other value is used as given (a hub id or a local folder).
    """
    if params.model.is_builtin:
        return str(params.paths.base_model)
    return params.model.base


def load_tokenizer(ref: str | Path) -> PreTrainedTokenizerBase:
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
    model = AutoModelForCausalLM.from_pretrained(str(ref), dtype=DTYPES[dtype])
    model.eval()
    return model


def model_limits(model_ref: str | Path) -> tuple[int, int]:
    """``(context length, embedding rows)`` from the model's config, without loading weights."""
    config = AutoConfig.from_pretrained(str(model_ref))
    text_config = config.get_text_config()
    context = int(getattr(text_config, "max_position_embeddings", 0) or 0)
    return context, int(text_config.vocab_size)
