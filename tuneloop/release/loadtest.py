"""The load test before the first canary traffic: a short, bounded burst against one backend.

``load_test`` sends streamed chat requests straight to one backend and times the
first token and the output throughput. On GPUs the reference is vLLM's own
``vllm bench serve`` (formerly ``benchmarks/benchmark_serving.py``), run against
each backend with the same prompts; this generator is the CPU-sized stand-in the
release flow runs itself. ``tuneloop.release.analysis.compare_load`` judges the
two results.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Mapping

import httpx

from tuneloop.release.analysis import LoadResult

logger = logging.getLogger(__name__)


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
