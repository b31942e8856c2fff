"""What the canary router costs: added latency per request, and how fast a rollback holds.

Starts, each in its own process on 127.0.0.1, two fast OpenAI-compatible
backends (champion and challenger: a fixed chat completion, no model) and the
router in front of them, then measures from this process:

- added latency: the same bounded run of chat completions sent straight to the
  champion backend and through the router (pinned to the champion), one at a
  time and with modest concurrency; added = router percentile - direct percentile;
- rollback time: from sending ``POST /admin/rollback`` to the first response
  served by the champion for a user whose bucket is on the challenger, while a
  concurrent load checks that no request sent after the rollback returned
  still lands on the challenger.

Goals (DESIGN.md): p99 added <= 2 ms; rollback <= 1 s.

    python benchmarks/router.py                      # prints the table
    python benchmarks/router.py --results benchmarks/RESULTS.md   # and appends it there
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import importlib.util
import json
import logging
import multiprocessing
import os
import platform
import secrets
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import httpx
import uvicorn
from fastapi import FastAPI
from fastapi.responses import Response

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from serving.app import create_app
from serving.config import RouterConfig
from serving.routing import arm_for_bucket, bucket
from tuneloop.net import free_port

logger = logging.getLogger("benchmarks.router")

GOAL_P99_ADDED_MS = 2.0
GOAL_ROLLBACK_S = 1.0
TOKEN_ENV = "TUNELOOP_ADMIN_TOKEN"
ANSWER = "[return] The Aurora kettle can be returned within 30 days."
BODY = {
    "model": "tuneloop",
    "messages": [{"role": "user", "content": "Can I return the Aurora kettle?"}],
    "max_tokens": 32,
}


def _backend_app(arm: str) -> FastAPI:
    app = FastAPI()
    # A typical small completion, serialised once: the backend should cost
    # next to nothing so the difference is the router.
    payload = json.dumps(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 1,
            "model": arm,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": ANSWER},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 12, "completion_tokens": 14, "total_tokens": 26},
        }
    ).encode()

    @app.post("/v1/chat/completions")
    async def chat() -> Response:
        return Response(payload, media_type="application/json")

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    return app


def _run_backend(arm: str, port: int) -> None:
    uvicorn.run(
        _backend_app(arm), host="127.0.0.1", port=port, log_level="warning", access_log=False
    )


def _run_router(config_json: str, port: int) -> None:
    logging.basicConfig(level=logging.ERROR)  # not one ROLLBACK warning per trial
    config = RouterConfig.model_validate_json(config_json)
    uvicorn.run(
        create_app(config), host="127.0.0.1", port=port, log_level="warning", access_log=False
    )


def _wait_up(url: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass  # not listening yet
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not come up within {timeout} s")
        time.sleep(0.05)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, round(q * len(ordered)) - 1))]


def sequential(direct: str, routed: str, n: int, headers: dict[str, str]) -> Latencies:
    """One request at a time, alternating direct and routed so both see the same machine load."""
    out = Latencies([], [])
    with (
        httpx.Client(base_url=direct, timeout=10) as to_direct,
        httpx.Client(base_url=routed, timeout=10) as to_router,
    ):
        pairs = ((to_direct, out.direct), (to_router, out.routed))
        for _ in range(min(n, 200)):  # warm up connections, pools and both servers
            for client, _sink in pairs:
                client.post("/v1/chat/completions", json=BODY, headers=headers)
        for _ in range(n):
            for client, sink in pairs:
                start = time.perf_counter()
                reply = client.post("/v1/chat/completions", json=BODY, headers=headers)
                sink.append(time.perf_counter() - start)
                reply.raise_for_status()
    return out


async def concurrent(
    direct: str, routed: str, n: int, concurrency: int, headers: dict[str, str], blocks: int = 8
) -> Latencies:
    """``concurrency`` clients at once, alternating blocks of direct and routed requests."""
    out = Latencies([], [])
    limits = httpx.Limits(max_connections=concurrency)
    async with (
        httpx.AsyncClient(base_url=direct, timeout=10, limits=limits) as to_direct,
        httpx.AsyncClient(base_url=routed, timeout=10, limits=limits) as to_router,
    ):

        async def worker(client: httpx.AsyncClient, count: int, sink: list[float] | None) -> None:
            for _ in range(count):
                start = time.perf_counter()
                reply = await client.post("/v1/chat/completions", json=BODY, headers=headers)
                if sink is not None:
                    sink.append(time.perf_counter() - start)
                reply.raise_for_status()

        for client in (to_direct, to_router):
            await asyncio.gather(*(worker(client, 25, None) for _ in range(concurrency)))
        per_worker = max(1, n // (concurrency * blocks))
        for _ in range(blocks):
            for client, sink in ((to_direct, out.direct), (to_router, out.routed)):
                await asyncio.gather(
                    *(worker(client, per_worker, sink) for _ in range(concurrency))
                )
    return out


@dataclass
class Latencies:
    direct: list[float]
    routed: list[float]


@dataclass
class Rollback:
    seconds: list[float]
    late_challenger: int  # requests sent after the rollback returned that still hit the challenger
    load_requests: int


async def rollbacks(url: str, trials: int, admin: dict[str, str]) -> Rollback:
    # Users whose bucket is on the challenger at 50 %: before the rollback they
    # must land there, after it never.
    names = (f"bench-{i}" for i in range(1000))
    users = [u for u in names if arm_for_bucket(bucket(u), 50) == "challenger"][:64]
    seconds: list[float] = []
    late = 0
    total = 0
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:

        async def arm_of(user: str) -> str:
            reply = await client.post(
                "/v1/chat/completions", json=BODY, headers={"X-User-Id": user}
            )
            reply.raise_for_status()
            return reply.headers["x-tuneloop-arm"]

        async def load(offset: int, stop: asyncio.Event, sent: list[tuple[float, str]]) -> None:
            # A steady stream of challenger-bucket users beside the timed probe.
            i = offset
            while not stop.is_set():
                at = time.perf_counter()
                sent.append((at, await arm_of(users[i % len(users)])))
                i += 4

        for trial in range(trials):
            r = await client.post("/admin/weights", json={"challenger_percent": 50}, headers=admin)
            r.raise_for_status()
            if await arm_of(users[0]) != "challenger":
                raise RuntimeError("challenger-bucket user not on the challenger at 50 %")
            sent: list[tuple[float, str]] = []
            stop = asyncio.Event()

            loaders = [asyncio.create_task(load(k, stop, sent)) for k in range(4)]
            await asyncio.sleep(0.05)
            start = time.perf_counter()
            r = await client.post(
                "/admin/rollback", json={"reason": f"benchmark trial {trial}"}, headers=admin
            )
            r.raise_for_status()
            returned = time.perf_counter()
            probe = await arm_of(users[trial % len(users)])
            landed = time.perf_counter()
            if probe != "champion":
                raise RuntimeError("request after rollback landed on the challenger")
            seconds.append(landed - start)
            await asyncio.sleep(0.05)
            stop.set()
            await asyncio.gather(*loaders)
            late += sum(1 for at, arm in sent if at > returned and arm != "champion")
            total += len(sent)
    return Rollback(seconds, late, total)


def _row(name: str, run: Latencies) -> list[str]:
    cells = [name, str(len(run.routed))]
    for q in (0.5, 0.99):
        d, r = _pct(run.direct, q) * 1e3, _pct(run.routed, q) * 1e3
        cells += [f"{d:.2f}", f"{r:.2f}", f"{r - d:+.2f}"]
    return cells


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000, help="measured requests per run")
    parser.add_argument(
        "--concurrency", type=int, nargs="+", default=[4, 8], help="clients in each concurrent run"
    )
    parser.add_argument("--trials", type=int, default=20, help="rollbacks to time")
    parser.add_argument("--results", type=Path, help="append a '## router' section to this file")
    args = parser.parse_args(argv)
    if not 1 <= args.requests <= 20_000 or not all(1 <= c <= 64 for c in args.concurrency):
        parser.error("--requests must be in [1, 20000] and --concurrency in [1, 64]")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise

    token = secrets.token_hex(16)
    os.environ[TOKEN_ENV] = token  # inherited by the router process
    admin = {"Authorization": f"Bearer {token}"}
    ports = {"champion": free_port(), "challenger": free_port(), "router": free_port()}
    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    feedback_dir = Path(tempfile.mkdtemp(prefix="tuneloop-router-bench-"))  # stays empty
    load_before = os.getloadavg()[0]
    config = RouterConfig.model_validate(
        {
            "arms": {
                arm: {"base_url": urls[arm], "model": f"{arm}-model", "model_version": "1"}
                for arm in ("champion", "challenger")
            },
            "challenger_percent": 0,
            "feedback_dir": feedback_dir,
        }
    )
    ctx = multiprocessing.get_context("spawn")
    processes = [
        ctx.Process(target=_run_backend, args=("champion", ports["champion"]), daemon=True),
        ctx.Process(target=_run_backend, args=("challenger", ports["challenger"]), daemon=True),
        ctx.Process(
            target=_run_router, args=(config.model_dump_json(), ports["router"]), daemon=True
        ),
    ]
    for process in processes:
        process.start()
    try:
        for url in urls.values():
            _wait_up(url)
        user = {"X-User-Id": "bench-user"}
        logger.info("sequential: %d requests direct and through the router", args.requests)
        seq = sequential(urls["champion"], urls["router"], args.requests, user)
        con = {}
        for clients in args.concurrency:
            logger.info("concurrent (%d clients)", clients)
            con[clients] = asyncio.run(
                concurrent(urls["champion"], urls["router"], args.requests, clients, user)
            )
        logger.info("rollback: %d trials", args.trials)
        rb = asyncio.run(rollbacks(urls["router"], args.trials, admin))
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.join(timeout=10)
        feedback_dir.rmdir()
    load_after = os.getloadavg()[0]

    header = ["run", "requests", "direct p50 ms", "router p50 ms", "added p50 ms",
              "direct p99 ms", "router p99 ms", "added p99 ms"]  # fmt: skip
    runs = {"sequential": seq, **{f"concurrency {c}": run for c, run in con.items()}}
    rows = [_row(name, run) for name, run in runs.items()]
    added_p99 = {
        name: (_pct(run.routed, 0.99) - _pct(run.direct, 0.99)) * 1e3 for name, run in runs.items()
    }
    rb_ms = [s * 1e3 for s in rb.seconds]
    rollback_table = _table(
        ["rollback trials", "median ms", "max ms", "requests under load", "late on challenger"],
        [[str(len(rb_ms)), f"{statistics.median(rb_ms):.2f}", f"{max(rb_ms):.2f}",
          str(rb.load_requests), str(rb.late_challenger)]],
    )  # fmt: skip
    latency = ", ".join(
        f"{name} {ms:+.2f} ms ({'met' if ms <= GOAL_P99_ADDED_MS else 'NOT met'})"
        for name, ms in added_p99.items()
    )
    rollback_met = max(rb_ms) <= GOAL_ROLLBACK_S * 1e3 and rb.late_challenger == 0
    verdict = (
        f"p99 added, goal <= {GOAL_P99_ADDED_MS} ms: {latency}. "
        f"Rollback, goal <= {GOAL_ROLLBACK_S * 1e3:.0f} ms: max {max(rb_ms):.1f} ms, "
        f"{rb.late_challenger} late requests ({'met' if rollback_met else 'NOT met'})."
    )
    stack = (
        "uvicorn "
        + uvicorn.__version__
        + " with "
        + ("uvloop + httptools" if _have("uvloop") and _have("httptools") else "asyncio + h11")
    )
    machine = (
        f"{os.cpu_count()} CPU cores shared by client, router and backends (load average "
        f"{load_before:.1f} before, {load_after:.1f} after, other jobs included); "
        f"{platform.python_implementation()} {platform.python_version()}; {stack}"
    )
    report = "\n\n".join([_table(header, rows), rollback_table, verdict])
    print(report)
    if args.results is not None:
        section = (
            f"\n## router\n\n"
            f"`python benchmarks/router.py --requests {args.requests} --concurrency "
            f"{' '.join(map(str, args.concurrency))} --trials {args.trials}`, "
            f"{datetime.now(UTC):%Y-%m-%d}; {machine}.\n\n{report}\n"
        )
        _append(args.results, section)
        print(f"appended to {args.results}")


def _have(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _append(path: Path, text: str) -> None:
    """Append under an exclusive lock: other benchmarks append their sections to the same file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as out:
        fcntl.flock(out, fcntl.LOCK_EX)
        if out.tell() == 0:
            out.write("# Benchmark results\n")
        out.write(text)


if __name__ == "__main__":
    main()
