"""The release controller's hands on running processes: backends, load, router replicas.

- ``start_transformers_serve`` launches a CPU backend as a child process (the
  command from ``serving.backends``) and stops it again; tests and local demos
  use it, production runs backends under its own supervisor (systemd, Kubernetes).
- ``load_test`` sends a short, bounded burst of streamed chat requests straight
  to one backend and times the first token and the output throughput. On GPUs
  the reference is vLLM's own ``vllm bench serve`` (formerly
  ``benchmarks/benchmark_serving.py``), run against each backend with the same
  prompts; this generator is the CPU-sized stand-in the release flow runs itself.
- ``RouterAdmin`` drives the admin API of every router replica together:
  status, stats, weights, rollback.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from serving.backends import transformers_serve_command, transformers_served_model, wait_healthy
from serving.controller import LoadResult

logger = logging.getLogger(__name__)


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


def start_transformers_serve(model_dir: Path, port: int, log: Path) -> Backend:
    """``transformers serve`` on 127.0.0.1 for one model folder; returns before it is healthy.

    Starting returns at once so that two backends can load side by side; call
    ``wait_healthy`` on each before sending traffic.
    """
    # The `transformers` script of this interpreter's environment, not whatever is first on PATH.
    executable = str(Path(sys.executable).with_name("transformers"))
    command = transformers_serve_command(model_dir, port, executable=executable)
    # Nothing to download: the folder is local, and a hub lookup would hang offline.
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    logger.info("started %s (pid %d), log %s", " ".join(command), process.pid, log)
    return Backend(f"http://127.0.0.1:{port}", transformers_served_model(model_dir), process, log)


# --- the load test -----------------------------------------------------------------------------

# Short support questions of the demo domain; what matters is that both arms get the same ones.
LOAD_PROMPTS = (
    "Can I return the Aurora kettle?",
    "My order 81234 has not arrived yet. Where is it?",
    "Is the Nimbus blender still under warranty after 14 months?",
    "How long does shipping to Lyon take?",
    "Hello!",
    "The lid of my kettle is cracked, what can I do?",
    "Do you ship to Hong Kong?",
    "我的订单什么时候到？",
)
WARMUP_REQUESTS = 2


async def _one_request(
    client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int
) -> tuple[bool, float | None, int]:
    """(succeeded, seconds to the first content token or None, output tokens)."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "stream": True,
        # vLLM reports usage in a stream only when asked; transformers serve always does.
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first: float | None = None
    usage_tokens: int | None = None
    content_chunks = 0
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                logger.warning("load test: %s answered %d", url, response.status_code)
                return False, None, 0
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    logger.warning("load test: %s error event %s", url, event["error"])
                    return False, None, 0
                if isinstance(event.get("usage"), Mapping):
                    usage_tokens = int(event["usage"].get("completion_tokens") or 0)
                for choice in event.get("choices") or []:
                    delta = choice.get("delta") or {}
                    if delta.get("content") or choice.get("text"):
                        content_chunks += 1
                        if first is None:
                            first = time.perf_counter() - start
    except (httpx.HTTPError, ValueError) as error:
        logger.warning("load test: %s failed: %s", url, error)
        return False, None, 0
    # One chunk is one token on vLLM; usage, when given, is exact.
    return True, first, usage_tokens if usage_tokens is not None else content_chunks


async def _load(
    url: str, model: str, requests: int, concurrency: int, max_tokens: int, timeout: float
) -> LoadResult:
    base = url.rstrip("/")
    async with httpx.AsyncClient(
        timeout=timeout,
        limits=httpx.Limits(max_connections=concurrency),
        trust_env=False,  # proxy settings must not divert a loopback measurement
    ) as client:
        # Warm-ups are not measured: the first request pays for lazy initialisation.
        for i in range(WARMUP_REQUESTS):
            await _one_request(client, base, model, LOAD_PROMPTS[i % len(LOAD_PROMPTS)], max_tokens)
        gate = asyncio.Semaphore(concurrency)

        async def bounded(i: int) -> tuple[bool, float | None, int]:
            async with gate:
                prompt = LOAD_PROMPTS[i % len(LOAD_PROMPTS)]
                return await _one_request(client, base, model, prompt, max_tokens)

        start = time.perf_counter()
        results = await asyncio.gather(*(bounded(i) for i in range(requests)))
        duration = time.perf_counter() - start
    return LoadResult(
        requests=requests,
        errors=sum(1 for ok, _, _ in results if not ok),
        duration_s=duration,
        output_tokens=sum(tokens for ok, _, tokens in results if ok),
        ttft_ms=tuple(first * 1000 for ok, first, _ in results if ok and first is not None),
    )


def load_test(
    url: str,
    model: str,
    requests: int,
    concurrency: int,
    max_tokens: int,
    timeout: float = 60.0,
) -> LoadResult:
    """Stream ``requests`` chat completions (``concurrency`` at a time) to one backend directly."""
    result = asyncio.run(_load(url, model, requests, concurrency, max_tokens, timeout))
    logger.info("load test of %s: %s", url, result.summary())
    return result


# --- the routers' admin API --------------------------------------------------------------------


class AdminError(RuntimeError):
    """A router replica refused or failed an admin call; the message names it and the fix."""


class RouterAdmin:
    """The admin API of every router replica, called together.

    Each replica holds its own weight in memory, so every change goes to all of
    them; a change that fails on any replica raises, naming the replicas.
    """

    def __init__(self, urls: Sequence[str], token: str, timeout: float = 5.0) -> None:
        if not urls:
            raise AdminError("no router URLs given (params: release.routers)")
        self.urls = tuple(u.rstrip("/") for u in urls)
        self._client = httpx.Client(
            timeout=timeout,
            headers={"Authorization": f"Bearer {token}"},
            trust_env=False,
        )

    @classmethod
    def from_env(cls, urls: Sequence[str], token_env: str, timeout: float = 5.0) -> RouterAdmin:
        token = os.environ.get(token_env, "")
        if not token:
            raise AdminError(
                f"${token_env} is not set; the routers' admin API needs it "
                "(the same value the routers were started with)"
            )
        return cls(urls, token, timeout)

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> RouterAdmin:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _call(self, url: str, method: str, path: str, body: Mapping[str, Any] | None) -> Any:
        try:
            response = self._client.request(method, url + path, json=body)
        except httpx.HTTPError as error:
            raise AdminError(f"{method} {url}{path}: {type(error).__name__}: {error}") from None
        if response.status_code == 401:
            raise AdminError(
                f"{url} refused the admin token (401): the token in the environment is not "
                "the router's"
            )
        if response.status_code != 200:
            raise AdminError(
                f"{method} {url}{path}: HTTP {response.status_code}: {response.text[:300]}"
            )
        return response.json()

    def _each(
        self, method: str, path: str, body: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """Call every replica at once; raise with all failures if any failed."""
        if len(self.urls) == 1:
            return {self.urls[0]: self._call(self.urls[0], method, path, body)}
        with ThreadPoolExecutor(max_workers=len(self.urls)) as pool:
            futures = {url: pool.submit(self._call, url, method, path, body) for url in self.urls}
        results: dict[str, Any] = {}
        failures: list[str] = []
        for url, future in futures.items():
            error = future.exception()
            if error is None:
                results[url] = future.result()
            else:
                failures.append(str(error))
        if failures:
            raise AdminError("; ".join(failures))
        return results

    def status(self) -> dict[str, Any]:
        return self._each("GET", "/admin/status")

    def stats(self) -> dict[str, Any]:
        return self._each("GET", "/admin/stats")

    def set_weight(self, percent: int, reason: str) -> None:
        """Move every replica to ``percent``. Not retried: a person or the flow decides again."""
        self._each("POST", "/admin/weights", {"challenger_percent": percent, "reason": reason})

    def rollback(self, reason: str, attempts: int = 3) -> float:
        """Challenger to 0 on every replica; returns the seconds it took.

        Retried (a rollback is idempotent and must land); replicas that already
        took it are not called again.
        """
        start = time.perf_counter()
        body = {"reason": reason}
        pending = list(self.urls)
        errors: list[str] = []
        for _ in range(attempts):
            # All replicas at once: one slow or dead replica must not delay the others.
            with ThreadPoolExecutor(max_workers=len(pending)) as pool:
                futures = {
                    url: pool.submit(self._call, url, "POST", "/admin/rollback", body)
                    for url in pending
                }
            errors = [str(f.exception()) for f in futures.values() if f.exception()]
            pending = [url for url, f in futures.items() if f.exception()]
            if not pending:
                return time.perf_counter() - start
        raise AdminError(
            f"ROLLBACK DID NOT LAND on {pending}: {'; '.join(errors)}. Roll back by hand: "
            "curl -X POST -H 'Authorization: Bearer $TOKEN' -H 'content-type: application/json' "
            '-d \'{"reason": "manual"}\' <router>/admin/rollback'
        )
