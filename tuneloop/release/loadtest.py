"""The load test before the first canary traffic: candidate against champion, like with like.

``load_test`` sends the same streamed chat requests, ``concurrency`` at a time, straight to
one backend, and times each one's first token (TTFT) and the time per output token after it
(TPOT). ``compare_load`` judges the candidate against the champion on the medians of both.

Like with like: a fine-tuned candidate that stops at its EOS after 12 tokens while the
champion runs on to ``max_tokens`` would look ten times slower by total tokens over wall
time, and its first tokens would queue behind the champion's long answers. So every request
asks for exactly ``max_tokens`` output tokens, in the form the backend understands (found by
the warm-up requests):

- vLLM: ``min_tokens`` = ``max_tokens`` and ``ignore_eos`` (its extra sampling params);
- ``transformers serve``: a ``generation_config`` with ``min_new_tokens`` = ``max_new_tokens``
  (it refuses unknown fields with a 422, so the vLLM form is tried first and only once);
- anything else: the plain request, and the result says ``fixed_length: false``.

TPOT is per token, so it stays comparable even where the length could not be fixed; TTFT is
compared at the same concurrency on both. On GPUs the reference is vLLM's own ``vllm bench
serve``, run against each backend with the same prompts; this generator is the small stand-in
the release flow runs itself. ``release.loadtest.enabled: false`` skips it (a backend this
test cannot drive), and the release records that it did.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import httpx

from tuneloop.judge.verdict import FAIL, PASS
from tuneloop.params import LoadTestParams
from tuneloop.release.analysis import Verdict
from tuneloop.release.checks import comparison, ratio_check

logger = logging.getLogger(__name__)

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
WARMUP_ROUNDS = 2  # unmeasured rounds of `concurrency` requests before the measured ones
Style = Literal["vllm", "transformers", "plain"]
STYLES: tuple[Style, ...] = ("vllm", "transformers", "plain")


@dataclass(frozen=True)
class LoadResult:
    """One backend under the load test: per request, the first token and the tokens after it."""

    requests: int
    errors: int
    duration_s: float
    output_tokens: int
    ttft_ms: tuple[float, ...]
    tpot_ms: tuple[float, ...] = ()
    fixed_length: bool = False
    style: str = "plain"

    @property
    def ttft_p50_ms(self) -> float | None:
        return _median(self.ttft_ms)

    @property
    def tpot_p50_ms(self) -> float | None:
        return _median(self.tpot_ms)

    def summary(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "errors": self.errors,
            "duration_s": round(self.duration_s, 3),
            "output_tokens": self.output_tokens,
            "ttft_p50_ms": self.ttft_p50_ms,
            "tpot_p50_ms": self.tpot_p50_ms,
            "fixed_length": self.fixed_length,
            "style": self.style,
        }


def _median(values: Sequence[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[math.ceil(0.5 * len(ordered)) - 1]


def compare_load(champion: LoadResult, candidate: LoadResult, params: LoadTestParams) -> Verdict:
    """Block the release on candidate errors, a slower first token or slower tokens after it."""
    errors = comparison(
        "loadtest_errors",
        FAIL if candidate.errors else PASS,
        float(candidate.errors),
        float(champion.errors),
        "== 0",
    )
    # Without a single first token there is nothing to release on.
    ttft = ratio_check(
        "loadtest_ttft_p50_ms",
        candidate.ttft_p50_ms,
        champion.ttft_p50_ms,
        params.max_ttft_ratio,
        missing=FAIL,
    )
    # The champion streamed several tokens per answer and the candidate never did: a failure;
    # neither did (one-token answers): nothing to compare.
    never = candidate.tpot_p50_ms is None and champion.tpot_p50_ms is not None
    tpot = ratio_check(
        "loadtest_tpot_p50_ms",
        candidate.tpot_p50_ms,
        champion.tpot_p50_ms,
        params.max_tpot_ratio,
        missing=FAIL if never else "skip",
    )
    return Verdict((errors, ttft, tpot))


# --- the load generator ------------------------------------------------------------------------


def request_body(model: str, prompt: str, max_tokens: int, style: Style) -> dict[str, Any]:
    """A streamed chat request for exactly ``max_tokens`` output tokens, in ``style``'s form."""
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        # vLLM reports usage in a stream only when asked; transformers serve ignores it.
        "stream_options": {"include_usage": True},
    }
    if style == "vllm":
        body.update(min_tokens=max_tokens, ignore_eos=True)
    elif style == "transformers":
        config = {"max_new_tokens": max_tokens, "min_new_tokens": max_tokens, "do_sample": False}
        body["generation_config"] = json.dumps(config)
    return body


@dataclass(frozen=True)
class _Timing:
    ok: bool
    status: int = 0
    ttft_s: float | None = None
    total_s: float = 0.0
    tokens: int = 0


async def _one_request(
    client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int, style: Style
) -> _Timing:
    body = request_body(model, prompt, max_tokens, style)
    start = time.perf_counter()
    first: float | None = None
    usage_tokens: int | None = None
    chunks = 0
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread())[:300]
                logger.info("load test: %s answered %d: %r", url, response.status_code, text)
                return _Timing(False, response.status_code)
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    logger.warning("load test: %s error event %s", url, event["error"])
                    return _Timing(False, 200)
                if isinstance(event.get("usage"), Mapping):
                    usage_tokens = int(event["usage"].get("completion_tokens") or 0)
                for choice in event.get("choices") or []:
                    delta = choice.get("delta") or {}
                    if delta.get("content") or choice.get("text"):
                        chunks += 1
                        if first is None:
                            first = time.perf_counter() - start
    except (httpx.HTTPError, ValueError) as error:
        logger.warning("load test: %s failed: %s", url, error)
        return _Timing(False)
    # One chunk is one token on vLLM and transformers serve; usage, when given, is exact.
    tokens = usage_tokens if usage_tokens is not None else chunks
    return _Timing(True, 200, first, time.perf_counter() - start, tokens)


async def _find_style(
    client: httpx.AsyncClient, url: str, model: str, max_tokens: int
) -> tuple[Style, list[_Timing]]:
    """The first request form the backend accepts, found with the (unmeasured) warm-ups."""
    tried: list[_Timing] = []
    for style in STYLES:
        timing = await _one_request(client, url, model, LOAD_PROMPTS[0], max_tokens, style)
        tried.append(timing)
        # 400/422: the backend refused a field of this form; anything else is the backend's.
        if timing.ok or timing.status not in (400, 422):
            return style, tried
    return "plain", tried


async def _load(
    url: str, model: str, requests: int, concurrency: int, max_tokens: int, timeout: float
) -> LoadResult:
    base = url.rstrip("/")
    async with httpx.AsyncClient(
        timeout=timeout,
        limits=httpx.Limits(max_connections=concurrency),
        trust_env=False,  # proxy settings must not divert a loopback measurement
    ) as client:
        # Warm-ups are not measured: the first request pays for lazy initialisation, and the
        # first concurrent ones for the server's concurrent path. A cold transformers serve
        # answered its first 8 requests at 2 at a time with 8x the TTFT and 4x the TPOT of the
        # next 8, so a challenger started for the release lost to a champion that had been
        # serving traffic; hence a round of ``concurrency`` requests at a time as well.
        style, _ = await _find_style(client, base, model, max_tokens)
        gate = asyncio.Semaphore(concurrency)

        async def bounded(i: int) -> _Timing:
            async with gate:
                prompt = LOAD_PROMPTS[i % len(LOAD_PROMPTS)]
                return await _one_request(client, base, model, prompt, max_tokens, style)

        await asyncio.gather(*(bounded(i) for i in range(WARMUP_ROUNDS * concurrency)))
        start = time.perf_counter()
        results = await asyncio.gather(*(bounded(i) for i in range(requests)))
        duration = time.perf_counter() - start
    done = [r for r in results if r.ok]
    timed = [r for r in done if r.ttft_s is not None]
    return LoadResult(
        requests=requests,
        errors=requests - len(done),
        duration_s=duration,
        output_tokens=sum(r.tokens for r in done),
        ttft_ms=tuple(r.ttft_s * 1000 for r in timed if r.ttft_s is not None),
        tpot_ms=tuple(
            (r.total_s - r.ttft_s) * 1000 / (r.tokens - 1)
            for r in timed
            if r.ttft_s is not None and r.tokens > 1
        ),
        fixed_length=bool(done) and all(r.tokens == max_tokens for r in done),
        style=style,
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
