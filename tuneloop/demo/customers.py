"""Demo customers for trying a release: sticky users asking the demo domain's questions.

Each user has a stable id (``X-User-Id``), so the router's bucketing keeps them on one arm,
as real users are. Every answer is checked against the one right answer the demo catalogue
gives; a wrong one is flagged through the router's ``/v1/feedback`` with the correction, as a
support tool would, so the router records it as a badcase attributed to the arm and model
version that answered. Those lines are next month's training data.

Used by ``tuneloop demo`` during each release, and by hand (``tuneloop traffic``) to try a
release on one machine (docs/how-to/release-by-hand.md).
"""

from __future__ import annotations

import functools
import json
import logging
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx

from tuneloop.demo import domain, orders

log = logging.getLogger(__name__)

# What the demo's customers of each demo task ask, from a seed and the month: one right
# answer each. Support customers ask the shop's questions (a tenth about products it does not
# sell); the order intake's callers send orders.
ASKS: dict[str, Callable[[int, int], Callable[[], domain.Item]]] = {
    "support": lambda seed, month: functools.partial(
        domain.Generator(seed, "train", month).item, unknown_rate=0.1
    ),
    "orders": lambda seed, month: orders.Generator(seed, "train", month).item,
}

ARM_HEADER = "X-Tuneloop-Arm"
REQUEST_ID_HEADER = "X-Request-Id"
USER_HEADER = "X-User-Id"


@dataclass
class ArmTally:
    requests: int = 0
    wrong: int = 0
    flagged: int = 0
    errors: int = 0


@dataclass
class TrafficReport:
    """What the demo's customers saw, per arm."""

    arms: dict[str, ArmTally] = field(default_factory=dict)
    seconds: float = 0.0
    feedback_refused: Counter[int] = field(default_factory=Counter)

    def tally(self, arm: str) -> ArmTally:
        return self.arms.setdefault(arm, ArmTally())

    def as_dict(self) -> dict[str, Any]:
        return {
            "seconds": round(self.seconds, 2),
            "arms": {arm: vars(t) for arm, t in sorted(self.arms.items())},
            "feedback_refused": {str(k): v for k, v in self.feedback_refused.items()},
        }


def normalise_answer(text: str) -> str:
    return " ".join(text.split())


def streamed_text(payload: str) -> str:
    """The answer of a streamed chat completion (server-sent events of OpenAI's form)."""
    parts: list[str] = []
    for line in payload.splitlines():
        data = line.removeprefix("data:").strip()
        if not line.startswith("data:") or data == "[DONE]":
            continue
        for choice in json.loads(data).get("choices") or []:
            parts.append(str((choice.get("delta") or {}).get("content") or ""))
    return "".join(parts)


def _spacing(rate: float | None) -> float:
    """Seconds between the starts of two requests at ``rate`` a second (None: no wait)."""
    if rate is None:
        return 0.0
    if not rate > 0:
        raise ValueError(f"rate must be a positive number of requests a second, not {rate}")
    return 1 / rate


def _turn_comes(at: float, stop: threading.Event | None) -> bool:
    """Whether a request is sent: it waits until ``at`` (``time.monotonic``), and is not sent
    once ``stop`` is set."""
    wait = max(0.0, at - time.monotonic())
    if stop is None:
        time.sleep(wait)
        return True
    return not stop.wait(wait)


def _flag(
    messages: list[dict[str, str]], said: str, item: domain.Item, request_id: str | None
) -> dict[str, Any]:
    """A wrong answer flagged with its correction, as a support tool sends it."""
    return {
        "messages": messages,
        "bad_response": said.strip() or "(empty answer)",
        "corrected_response": item.answer,
        "request_id": request_id,
        "tags": ["demo-support-tool"],
    }


def run(
    router_url: str,
    *,
    requests: int,
    users: int = 200,
    seed: int = 0,
    month: int = 1,
    model: str = "tuneloop",
    feedback_token: str | None = None,
    concurrency: int = 2,
    max_tokens: int = 48,
    timeout_s: float = 60.0,
    stop: threading.Event | None = None,
    stream: bool = False,
    task: str = "support",
    feedback_path: str = "/v1/feedback",
    rate: float | None = None,
) -> TrafficReport:
    """Send ``requests`` chat requests from ``users`` sticky demo users; flag wrong answers.

    Without ``feedback_token`` nothing is flagged (traffic only). ``stop`` ends it early.
    ``stream``: the answers come streamed, as a chat window shows them, so the router times
    each arm's first token (TTFT) for the release analysis. ``task``: what they ask
    (``ASKS``), as ``model`` (a router of tasks: the task's public name); ``feedback_path``:
    where flags go on the router (a router of tasks: ``/tasks/<task>/v1/feedback``).
    ``rate``: requests a second, all users together, started evenly as users arrive (still at
    most ``concurrency`` waiting at once); None: each as soon as an answer comes back, which
    keeps every served model busy for as long as the traffic lasts.
    """
    spacing = _spacing(rate)
    rng = random.Random(f"traffic/{seed}/{month}")
    ask = ASKS[task](seed + 11, month)
    plan = [(f"demo-user-{rng.randrange(users):04d}", ask()) for _ in range(requests)]
    report = TrafficReport()
    lock = threading.Lock()
    started = time.monotonic()
    headers = {"Authorization": f"Bearer {feedback_token}"} if feedback_token else {}

    def one(client: httpx.Client, index: int, user: str, item: domain.Item) -> None:
        if not _turn_comes(started + index * spacing, stop):
            return
        messages = [{"role": "user", "content": item.question}]
        body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
        if stream:
            body["stream"] = True
        try:
            response = client.post(
                f"{router_url}/v1/chat/completions", json=body, headers={USER_HEADER: user}
            )
        except httpx.HTTPError as exc:
            with lock:
                report.tally("unknown").errors += 1
            log.debug("traffic: %s: %s", user, exc)
            return
        arm = response.headers.get(ARM_HEADER, "unknown")
        if response.status_code != 200:
            with lock:
                t = report.tally(arm)
                t.requests += 1
                t.errors += 1
            return
        if stream:
            said = streamed_text(response.text)
        else:
            said = str(response.json()["choices"][0]["message"]["content"] or "")
        wrong = normalise_answer(said) != normalise_answer(item.answer)
        flagged = False
        if wrong and feedback_token:
            flag = _flag(messages, said, item, response.headers.get(REQUEST_ID_HEADER))
            answer = client.post(f"{router_url}{feedback_path}", json=flag, headers=headers)
            flagged = answer.status_code in (200, 201, 202)
            if not flagged:
                with lock:
                    report.feedback_refused[answer.status_code] += 1
        with lock:
            t = report.tally(arm)
            t.requests += 1
            t.wrong += wrong
            t.flagged += flagged

    with (
        httpx.Client(timeout=timeout_s) as client,
        ThreadPoolExecutor(max_workers=concurrency) as pool,
    ):
        for done in pool.map(lambda job: one(client, job[0], *job[1]), enumerate(plan)):
            del done
    report.seconds = time.monotonic() - started
    return report
