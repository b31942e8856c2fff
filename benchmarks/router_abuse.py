"""The canary router under abuse: every attack answered right, nothing written it should not be.

Starts, each in its own process on 127.0.0.1, two fast OpenAI-compatible
backends and the router in front of them (one feedback producer configured,
request ids signed), then from this process:

1. times plain chat requests through the router (the baseline);
2. runs the attacks while a second client keeps timing plain chat requests:
   oversized bodies on every endpoint (with and without ``Content-Length``),
   flags without or with the wrong credential, forged and reused request ids,
   a flood of flags from one producer, JSON nested 100,000 deep, lone
   surrogates, wrong types, personal data in every field of a flag;
3. checks each answer's status, then what reached the disk: exactly the
   accepted flags, every line one that ingest accepts, no planted value, the
   weight unchanged and the router still serving.

Exit status 0 when every check held, 1 otherwise; the table says which.

    python benchmarks/router_abuse.py            # full run
    python benchmarks/router_abuse.py --quick    # fewer requests (the test suite's run)
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import logging
import multiprocessing
import os
import secrets
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI
from fastapi.responses import Response

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from serving.app import create_app
from serving.config import RouterConfig
from tuneloop.data.records import parse_record
from tuneloop.net import free_port

logger = logging.getLogger("benchmarks.router_abuse")

ADMIN_ENV, SECRET_ENV, PRODUCER_ENV = (
    "TUNELOOP_ADMIN_TOKEN",
    "TUNELOOP_ROUTER_SECRET",
    "TUNELOOP_FEEDBACK_SUPPORT",
)
BURST, RATE_PER_S = 20, 10.0  # the producer's rate limit in this run
QUESTION = [{"role": "user", "content": "Can I return the Aurora kettle?"}]
BODY = {"model": "tuneloop", "messages": QUESTION, "max_tokens": 16}
FLAG = {"messages": QUESTION, "bad_response": "No.", "corrected_response": "[return] Yes."}
PLANTED = ("zhang.san@example.com", "13912345678", "4111 1111 1111 1111", "198.51.100.23")


def _backend_app(arm: str) -> FastAPI:
    app = FastAPI()
    payload = json.dumps(
        {
            "id": f"chatcmpl-{arm}",
            "object": "chat.completion",
            "model": arm,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "[return] Yes."}}],
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
    logging.basicConfig(level=logging.ERROR)
    config = RouterConfig.model_validate_json(config_json)
    uvicorn.run(
        create_app(config), host="127.0.0.1", port=port, log_level="warning", access_log=False
    )


def _wait_up(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url + "/health", timeout=1, trust_env=False).status_code == 200:
                return
        except httpx.TransportError:
            pass  # not listening yet
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not come up within {timeout} s")
        time.sleep(0.05)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, round(q * len(ordered)) - 1))]


@dataclass
class Outcome:
    """One attack: what it expected, what came back, and whether each answer was right."""

    name: str
    expected: str
    got: Counter[int] = field(default_factory=Counter)
    ok: bool = True
    note: str = ""


@dataclass
class Probe:
    """Plain chat requests timed in a thread; every one must succeed."""

    url: str
    seconds: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self, limit: int) -> None:
        with httpx.Client(base_url=self.url, timeout=30, trust_env=False) as client:
            for i in range(limit):
                if self.stop.is_set():
                    return
                start = time.perf_counter()
                reply = client.post("/v1/chat/completions", json={**BODY, "user": f"probe-{i}"})
                self.seconds.append(time.perf_counter() - start)
                if reply.status_code != 200:
                    self.failures.append(f"{reply.status_code}: {reply.text[:100]}")


def forge(request_id: str, arm: str | None = None, version: str | None = None) -> str:
    """The id with its arm or model version edited and the old signature kept."""
    prefix, payload, signature = request_id.split(".")
    fields = base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)).decode().split("|", 4)
    fields[2] = arm or fields[2]
    fields[4] = version or fields[4]
    edited = base64.urlsafe_b64encode("|".join(fields).encode()).rstrip(b"=").decode()
    return f"{prefix}.{edited}.{signature}"


async def attacks(url: str, admin: str, producer: str, flood: int) -> tuple[list[Outcome], int]:
    """Every attack in turn; (outcomes, flags the router should have written)."""
    outcomes: list[Outcome] = []
    accepted = 0
    as_admin = {"Authorization": f"Bearer {admin}"}
    as_producer = {"Authorization": f"Bearer {producer}"}

    def expect(
        name: str, expected: set[int], replies: list[httpx.Response], note: str = ""
    ) -> None:
        got = Counter(r.status_code for r in replies)
        outcomes.append(
            Outcome(name, "/".join(map(str, sorted(expected))), got, set(got) <= expected, note)
        )

    async with httpx.AsyncClient(base_url=url, timeout=60, trust_env=False) as client:
        # Oversized bodies, declared and chunked, on every endpoint that takes one.
        big = {"messages": [{"role": "user", "content": "x" * 8_000_000}]}
        for path, headers in (
            ("/v1/chat/completions", {}),
            ("/v1/feedback", as_producer),
            ("/admin/weights", as_admin),
        ):
            declared = await client.post(path, json=big, headers=headers)

            async def chunks() -> Any:
                for _ in range(100):
                    yield b"x" * 100_000

            chunked = await client.post(path, content=chunks(), headers=headers)
            expect(f"8 MB body to {path}", {413}, [declared, chunked])

        # Credentials.
        replies = [
            await client.post("/v1/feedback", json=FLAG),
            await client.post("/v1/feedback", json=FLAG, headers={"Authorization": "Bearer x"}),
            await client.post("/v1/feedback", json=FLAG, headers=as_admin),
            await client.post("/admin/weights", json={"challenger_percent": 100}),
        ]
        expect("feedback without a producer token; admin without its token", {401}, replies)

        # Forged and reused request ids.
        ids: dict[str, str] = {}
        for i in range(200):
            reply = await client.post("/v1/chat/completions", json={**BODY, "user": f"u{i}"})
            ids.setdefault(reply.headers["x-tuneloop-arm"], reply.headers["x-request-id"])
        target = ids.get("champion") or next(iter(ids.values()))
        forged = [
            forge(target, arm="challenger"),
            forge(target, version="999"),
            target[:-6] + "AAAAAA",
        ]
        replies = [
            await client.post("/v1/feedback", json={**FLAG, "request_id": rid}, headers=as_producer)
            for rid in (*forged, target, target, target)
        ]
        attributed = [r.json().get("attributed") for r in replies]
        accepted += sum(r.status_code == 201 for r in replies)
        right = attributed == [False, False, False, True, False, False]
        expect(
            "forged ids (3), then one genuine id flagged 3 times",
            {201},
            replies,
            f"attributed {attributed}" + ("" if right else " (WRONG: expected only the 4th)"),
        )
        outcomes[-1].ok = outcomes[-1].ok and right

        # Personal data in every stored field.
        text = " / ".join(PLANTED)
        pii_flag = {
            "messages": [{"role": "user", "content": text}],
            "bad_response": text,
            "corrected_response": text,
            "tags": [PLANTED[0]],
        }
        reply = await client.post("/v1/feedback", json=pii_flag, headers=as_producer)
        accepted += reply.status_code == 201
        expect(
            "personal data in every field",
            {201},
            [reply],
            f"scrubbed {reply.json().get('pii_scrubbed')}",
        )

        # Hostile JSON on every endpoint.
        shapes = {
            "nested 100,000 deep": b"[" * 100_000 + b"]" * 100_000,
            "lone surrogate": b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
            "wrong types": b'{"messages": "hi", "bad_response": 5, "challenger_percent": "x"}',
            "not UTF-8": b'{"messages": "\xff"}',
        }
        for shape, body in shapes.items():
            # The schema of a completion request is the backend's to check (vLLM answers
            # 400); the router checks the JSON itself, and the schema of its own endpoints.
            paths = [("/v1/feedback", as_producer), ("/admin/weights", as_admin)]
            if shape != "wrong types":
                paths.append(("/v1/chat/completions", {}))
            replies = [
                await client.post(
                    path, content=body, headers={**headers, "content-type": "application/json"}
                )
                for path, headers in paths
            ]
            # 100k deep is 200 kB: over the admin body limit, so 413 there is right too.
            allowed = {400, 413} if shape.startswith("nested") else {400}
            expect(f"JSON {shape}", allowed, replies)

        # A flood from one producer: its burst passes, then only what its rate refills.
        await asyncio.sleep(BURST / RATE_PER_S)  # a full bucket after the flags above
        start = time.monotonic()
        replies = list(
            await asyncio.gather(
                *(client.post("/v1/feedback", json=FLAG, headers=as_producer) for _ in range(flood))
            )
        )
        elapsed = time.monotonic() - start
        passed = sum(r.status_code == 201 for r in replies)
        accepted += passed
        most = BURST + int(RATE_PER_S * elapsed) + 1
        right = BURST <= passed <= most
        expect(
            f"flood of {flood} flags from one producer",
            {201, 429},
            replies,
            f"{passed} passed in {elapsed:.1f} s (burst {BURST}, then {RATE_PER_S:g}/s: "
            f"at most {most})",
        )
        outcomes[-1].ok = outcomes[-1].ok and right
    return outcomes, accepted


def check_disk(folder: Path, accepted: int) -> list[tuple[str, bool, str]]:
    files = sorted(folder.glob("router-feedback-*.jsonl"))
    raw = b"".join(path.read_bytes() for path in files)
    lines = raw.splitlines()
    valid = 0
    for line in lines:
        try:
            parse_record(json.loads(line))
            valid += 1
        except ValueError:
            pass
    text = raw.decode("utf-8", errors="replace")
    leaked = [value for value in PLANTED if value in text]
    modes = {oct(path.stat().st_mode & 0o777) for path in files}
    return [
        ("lines written = flags accepted", len(lines) == accepted, f"{len(lines)} / {accepted}"),
        ("every line one ingest accepts", valid == len(lines), f"{valid} / {len(lines)}"),
        ("no planted personal data", not leaked, f"found {leaked}" if leaked else "none found"),
        ("files not world-readable", all(int(m, 8) & 0o007 == 0 for m in modes), str(modes)),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer probe and flood requests")
    parser.add_argument(
        "--max-p99-ms", type=float, default=500.0, help="probe p99 under attack must stay below"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    probes, flood = (100, 100) if args.quick else (400, 400)

    tokens = {name: secrets.token_hex(16) for name in (ADMIN_ENV, SECRET_ENV, PRODUCER_ENV)}
    os.environ.update(tokens)  # inherited by the router process
    ports = {"champion": free_port(), "challenger": free_port(), "router": free_port()}
    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    work = Path(tempfile.mkdtemp(prefix="tuneloop-router-abuse-"))
    config = RouterConfig.model_validate(
        {
            "arms": {
                arm: {"base_url": urls[arm], "model": f"{arm}-model", "model_version": version}
                for arm, version in (("champion", "1"), ("challenger", "2"))
            },
            "challenger_percent": 50,
            "feedback_dir": work / "incoming",
            "state_file": work / "state.json",
            "feedback_producers": [
                {"name": "support-tool", "token_env": PRODUCER_ENV,
                 "rate_per_minute": RATE_PER_S * 60, "burst": BURST}
            ],
        }
    )  # fmt: skip
    ctx = multiprocessing.get_context("spawn")
    processes = [
        ctx.Process(target=_run_backend, args=(arm, ports[arm]), daemon=True)
        for arm in ("champion", "challenger")
    ]
    processes.append(
        ctx.Process(
            target=_run_router, args=(config.model_dump_json(), ports["router"]), daemon=True
        )
    )
    for process in processes:
        process.start()
    load_before = os.getloadavg()[0]
    try:
        for url in urls.values():
            _wait_up(url)
        logger.info("baseline: %d chat requests through the router", probes)
        baseline = Probe(urls["router"])
        baseline.run(probes)
        logger.info("attacks, with %d chat requests timed beside them", probes)
        during = Probe(urls["router"])
        thread = threading.Thread(target=during.run, args=(probes * 10,), daemon=True)
        thread.start()
        outcomes, accepted = asyncio.run(
            attacks(urls["router"], tokens[ADMIN_ENV], tokens[PRODUCER_ENV], flood)
        )
        during.stop.set()
        thread.join(timeout=60)
        admin = {"Authorization": f"Bearer {tokens[ADMIN_ENV]}"}
        status = httpx.get(f"{urls['router']}/admin/status", headers=admin, trust_env=False)
        after = httpx.post(f"{urls['router']}/v1/chat/completions", json=BODY, trust_env=False)
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.join(timeout=10)
    load_after = os.getloadavg()[0]

    checks = check_disk(work / "incoming", accepted)
    p99 = _pct(during.seconds, 0.99) * 1e3 if during.seconds else float("inf")
    checks += [
        ("weight unchanged (50 %)", status.json()["challenger_percent"] == 50, ""),
        ("still serving after the attacks", after.status_code == 200, str(after.status_code)),
        ("every plain request under attack served", not during.failures, str(during.failures[:3])),
        (f"probe p99 under attack < {args.max_p99_ms:g} ms", p99 < args.max_p99_ms, f"{p99:.1f}"),
    ]
    rows = [
        f"| {o.name} | {o.expected} | {dict(sorted(o.got.items()))} | "
        f"{'ok' if o.ok else 'WRONG'} | {o.note[:120]} |"
        for o in outcomes
    ]
    print("\n| attack | expected | got | verdict | note |\n|---|---|---|---|---|")
    print("\n".join(rows))
    print("\n| check | verdict | detail |\n|---|---|---|")
    print(
        "\n".join(
            f"| {name} | {'ok' if ok else 'WRONG'} | {detail} |" for name, ok, detail in checks
        )
    )
    for name, values in (("baseline", baseline.seconds), ("under attack", during.seconds)):
        if values:
            print(
                f"\nplain chat {name}: {len(values)} requests, "
                f"p50 {_pct(values, 0.5) * 1e3:.1f} ms, p99 {_pct(values, 0.99) * 1e3:.1f} ms"
            )
    print(f"load average {load_before:.2f} before, {load_after:.2f} after ({os.cpu_count()} CPUs)")
    failed = [o.name for o in outcomes if not o.ok] + [name for name, ok, _ in checks if not ok]
    if failed:
        print(f"\nFAILED: {failed}")
        return 1
    print("\nall answers and checks as expected")
    return 0


if __name__ == "__main__":
    sys.exit(main())
