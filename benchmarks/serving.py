"""vLLM against ``transformers serve`` on the same model, the router in front of vLLM, and the
time to switch the challenger adapter: one command, one run, ready-to-paste tables.

For each model (``tiny``: ``builtin:tiny`` as the base stage builds it, pre-training included;
``smollm2``: ``builtin:smollm2-135m-instruct`` converted from its pinned wheel as the base
stage converts it), one engine at a time, as ``tuneloop serve`` starts them
(``tuneloop.release.backends`` / ``tuneloop.release.vllm_engine``, the shipped ``serve``
params: the KV cache of ``serve.cpu_kv_cache_gib``, every core):

- start-up: from launch to ``/health`` answering 200, and to the first answer;
- throughput and TTFT: the release's own load generator (``tuneloop.release.loadtest``):
  streamed chat requests of exactly ``--max-tokens`` output tokens (vLLM: ``ignore_eos``;
  transformers: ``min_new_tokens``), ``--requests`` of them at each ``--concurrency``, after
  two unmeasured warm-ups; output tokens/s over the wall time of the batch, TTFT (first
  streamed token) p50 and p99 (nearest rank: with 16 requests p99 is the slowest).

On the model given by ``--router-on`` (default: the last of ``--models``), vLLM is started a
second time as ``tuneloop serve base`` starts it (LoRA enabled, adapters loaded at run time),
the champion's adapter loaded as ``tuneloop serve champion --on-base`` loads it, and the same
throughput runs ask for that adapter (row ``vllm, LoRA on, an adapter``: what serving a LoRA
arm costs against the merged model); then:

- router: ``python -m serving.router`` in front of it, champion arm an adapter loaded at run
  time; the same streamed requests sent one at a time straight to vLLM and through the
  router, alternating, so both see the same load; TTFT and total time p50 / p99 and the
  median of the paired differences (each routed request minus the direct one beside it);
- adapter switch: the router at 100 % challenger, the challenger's adapter not yet loaded;
  timed from ``vllm_engine.check_adapter`` + ``POST /v1/load_lora_adapter`` (as ``tuneloop
  serve challenger --on-base`` loads it) to the first streamed token of an answer through the
  router; unloaded again between trials.

Adapters are peft LoRA adapters of the model with the shipped train params' rank and target
modules, random (non-zero) weights; their answers are not what is measured.

    .venv/bin/python benchmarks/serving.py                          # tiny and smollm2, defaults
    .venv/bin/python benchmarks/serving.py --models tiny --requests 8 --max-tokens 16
    .venv/bin/python benchmarks/serving.py --models-dir /tmp/bench-models   # keep built models
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import math
import os
import platform
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere

from tuneloop.net import free_port  # noqa: E402
from tuneloop.params import Params, load_params  # noqa: E402
from tuneloop.release import backends, loadtest, vllm_engine  # noqa: E402
from tuneloop.release.backends import Backend, LoraModule  # noqa: E402

log = logging.getLogger("benchmarks.serving")

BASES = {"tiny": "builtin:tiny", "smollm2": "builtin:smollm2-135m-instruct"}
ENGINES = ("transformers", "vllm")
PROMPT = loadtest.LOAD_PROMPTS[0]
TOKEN_ENV = "TUNELOOP_ADMIN_TOKEN"
ARMS = ("champion", "challenger")
# vLLM as `tuneloop serve base` starts it, asked for an adapter loaded at run time.
ADAPTER_RUN = "vllm, LoRA on, an adapter"


def load_text() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} / {five:.2f} / {fifteen:.2f}"


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile (the slowest of fewer than 100 values is their p99)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


# --- the models -----------------------------------------------------------------------------------


def build_model(which: str, folder: Path, shipped: Params) -> float:
    """``folder`` as the base stage builds ``BASES[which]``; seconds taken (0 when reused)."""
    if (folder / "config.json").is_file():
        log.info("%s: reusing %s", which, folder)
        return 0.0
    from stages import base

    model = shipped.model.model_copy(update={"base": BASES[which]})
    paths = shipped.paths.model_copy(
        update={"base_model": folder, "downloads": ROOT / shipped.paths.downloads}
    )
    started = time.perf_counter()
    base.build(shipped.model_copy(update={"model": model, "paths": paths}))
    return time.perf_counter() - started


def save_adapter(model_dir: Path, out: Path, seed: int, shipped: Params) -> Path:
    """A peft LoRA adapter of ``model_dir`` with the train params' rank and modules, random."""
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from tuneloop.training.methods import lora_config

    if (out / "adapter_config.json").is_file():
        return out
    torch.manual_seed(seed)
    config = lora_config(shipped)
    config.init_lora_weights = False  # non-zero B: the adapter changes the answers
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), config)
    model.save_pretrained(str(out))
    return out


# --- the engines ---------------------------------------------------------------------------------


@dataclass
class Started:
    backend: Backend
    health_s: float  # launch to /health 200
    first_answer_s: float  # launch to the first completed answer


def first_answer(url: str, model: str) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 1}
    with httpx.Client(timeout=600, trust_env=False) as client:
        reply = client.post(f"{url}/v1/chat/completions", json=body)
    if reply.status_code != 200:
        raise RuntimeError(f"{url} refused the first request: {reply.status_code} {reply.text}")


@contextmanager
def running(
    engine: str, folder: Path, name: str, shipped: Params, logs: Path, lora: bool = False
) -> Iterator[Started]:
    """One engine on ``folder``, as ``tuneloop serve`` launches it; stopped on exit."""
    port = free_port()
    log_file = logs / f"{name}-{engine}.log"
    started = time.perf_counter()
    if engine == "transformers":
        backend = backends.start_transformers_serve(folder, port, log_file)
    else:
        found = vllm_engine.find_engine(ROOT / shipped.serve.venv)
        if found is None:
            raise SystemExit(f"{ROOT / shipped.serve.venv} holds no vLLM: run `make serve-setup`")
        launch = vllm_engine.plan_launch(
            found, folder, name, port, shipped.serve, runtime_adapters=lora
        )
        backend = vllm_engine.start_vllm(launch, f"http://127.0.0.1:{port}", name, log_file)
    try:
        try:
            backend.wait_healthy(timeout=1200)
        except (RuntimeError, TimeoutError):
            print(log_file.read_text(errors="replace")[-4000:], file=sys.stderr)
            raise
        health = time.perf_counter() - started
        first_answer(backend.url, backend.model)
        yield Started(backend, health, time.perf_counter() - started)
    finally:
        backend.stop(grace=30)


@dataclass
class Throughput:
    tokens_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    errors: int
    fixed_length: bool
    load: str


def throughput(
    url: str, model: str, concurrency: int, requests: int, max_tokens: int
) -> Throughput:
    result = loadtest.load_test(url, model, requests, concurrency, max_tokens, timeout=600)
    ttft = list(result.ttft_ms) or [float("nan")]
    return Throughput(
        result.output_tokens / result.duration_s,
        pct(ttft, 0.5),
        pct(ttft, 0.99),
        result.errors,
        result.fixed_length,
        load_text(),
    )


# --- the router and the adapter switch -----------------------------------------------------------


@dataclass
class Timed:
    ttft: float
    total: float


def stream_once(client: httpx.Client, url: str, model: str, max_tokens: int) -> Timed:
    """One streamed chat request of ``max_tokens`` tokens: seconds to its first token and end."""
    body = loadtest.request_body(model, PROMPT, max_tokens, "vllm")
    start = time.perf_counter()
    first: float | None = None
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {reply.status_code} {reply.read()[:300]!r}")
        for line in reply.iter_lines():
            if first is None and line.startswith("data:") and line[5:].strip() != "[DONE]":
                event = json.loads(line[5:])
                if any((c.get("delta") or {}).get("content") for c in event.get("choices") or []):
                    first = time.perf_counter() - start
    if first is None:
        raise RuntimeError(f"{url}: {model} streamed no token")
    return Timed(first, time.perf_counter() - start)


@dataclass
class RouterRun:
    direct: list[Timed] = field(default_factory=list)
    routed: list[Timed] = field(default_factory=list)


def router_latency(vllm: str, model: str, router: str, requests: int, max_tokens: int) -> RouterRun:
    out = RouterRun()
    with httpx.Client(timeout=600, trust_env=False) as client:
        sides: list[tuple[str, str, list[Timed]]] = [
            (vllm, model, out.direct),
            (router, "tuneloop", out.routed),
        ]
        for url, name, _ in sides:  # warm-up: connections, the router's pool
            stream_once(client, url, name, max_tokens)
        for i in range(requests):
            for url, name, sink in sides if i % 2 == 0 else sides[::-1]:
                sink.append(stream_once(client, url, name, max_tokens))
    return out


@contextmanager
def router_process(config: dict[str, Any], folder: Path, token: str) -> Iterator[str]:
    """``python -m serving.router`` as a user runs it, on a free port; its URL."""
    path = folder / "router.yaml"
    path.write_text(yaml.safe_dump(config))
    port = free_port()
    command = [sys.executable, "-m", "serving.router", "--config", str(path), "--port", str(port)]
    command += ["--log-level", "warning"]
    env = {**os.environ, TOKEN_ENV: token}
    with (folder / "router.log").open("wb") as out:
        process = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        backends.wait_healthy(url, timeout=120, process=process)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


def switch_trial(
    vllm: str, router: str, adapter: LoraModule, base_dir: Path, max_rank: int
) -> tuple[float, float]:
    """(check + load seconds, load to the first token through the router)."""
    with httpx.Client(timeout=600, trust_env=False) as client:
        start = time.perf_counter()
        vllm_engine.check_adapter(adapter.path, base_dir, max_rank)
        vllm_engine.load_adapter(vllm, adapter)
        loaded = time.perf_counter() - start
        stream_once(client, router, "tuneloop", 4)
        answered = time.perf_counter() - start
    vllm_engine.unload_adapter(vllm, adapter.name)
    return loaded, answered


@dataclass
class SwitchRun:
    load_s: list[float] = field(default_factory=list)
    answer_s: list[float] = field(default_factory=list)


def router_and_switch(
    vllm: str,
    folder: Path,
    champion: str,
    challenger_dir: Path,
    shipped: Params,
    args: argparse.Namespace,
    scratch: Path,
) -> tuple[RouterRun, SwitchRun, str, str]:
    """The router in front of ``vllm`` (champion: the loaded adapter ``champion``), then the
    challenger's adapter switched in, ``args.switch_trials`` times."""
    arms = {"champion": champion, "challenger": f"{shipped.tracking.registered_model}-v2"}
    token = secrets.token_hex(16)
    config = {
        "arms": {
            arm: {"base_url": vllm, "model": model, "model_version": model[-1]}
            for arm, model in arms.items()
        },
        "challenger_percent": 0,
        "feedback_dir": str(scratch / "feedback"),
        "state_file": str(scratch / "router-state.json"),
    }
    with router_process(config, scratch, token) as router:
        before = load_text()
        latency = router_latency(vllm, arms["champion"], router, args.router_requests, 8)
        admin = {"Authorization": f"Bearer {token}"}
        reply = httpx.post(
            f"{router}/admin/weights",
            json={"challenger_percent": 100, "reason": "benchmark: the switch"},
            headers=admin,
            trust_env=False,
        )
        reply.raise_for_status()
        switch = SwitchRun()
        challenger = LoraModule(arms["challenger"], challenger_dir)
        for _ in range(args.switch_trials):
            loaded, answered = switch_trial(
                vllm, router, challenger, folder, shipped.serve.max_lora_rank
            )
            switch.load_s.append(loaded)
            switch.answer_s.append(answered)
        after = load_text()
    return latency, switch, before, after


# --- the report ----------------------------------------------------------------------------------


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def router_table(run: RouterRun) -> str:
    rows = []
    picks: dict[str, Callable[[Timed], float]] = {
        "TTFT": lambda t: t.ttft,
        "total": lambda t: t.total,
    }
    for what, pick in picks.items():
        direct, routed = [pick(t) for t in run.direct], [pick(t) for t in run.routed]
        paired = statistics.median(r - d for d, r in zip(direct, routed, strict=True))
        row = [what, str(len(direct))]
        for q in (0.5, 0.99):
            d, r = pct(direct, q), pct(routed, q)
            row += [ms(d), ms(r), f"{(r - d) * 1e3:+.1f}"]
        rows.append([*row, f"{paired * 1e3:+.1f}"])
    header = ["time", "requests", "direct p50 ms", "router p50 ms", "added p50 ms",
              "direct p99 ms", "router p99 ms", "added p99 ms", "added, paired median"]  # fmt: skip
    return table(header, rows)


def throughput_table(
    models: list[str], labels: list[str], concurrency: list[int], loads: dict[Any, Throughput]
) -> str:
    rows = []
    for which in models:
        for label in labels:
            for clients in concurrency:
                found = loads.get((which, label, clients))
                if found is None:
                    continue
                reference = loads.get((which, "transformers", clients))
                ratio = (
                    "-"
                    if reference is None
                    else f"{found.tokens_per_s / reference.tokens_per_s:.2f}"
                )
                errors = str(found.errors) + ("" if found.fixed_length else " (length not fixed)")
                rows.append([which, label, str(clients), f"{found.tokens_per_s:.1f}", ratio,
                             f"{found.ttft_p50_ms:.0f}", f"{found.ttft_p99_ms:.0f}", errors,
                             found.load])  # fmt: skip
    header = ["model", "engine", "concurrency", "output tok/s", "x transformers",
              "TTFT p50 ms", "TTFT p99 ms", "errors", "load average then"]  # fmt: skip
    return table(header, rows)


def switch_table(run: SwitchRun) -> str:
    cells = [str(len(run.load_s))]
    for values in (run.load_s, run.answer_s):
        cells += [f"{statistics.median(values):.3f}", f"{max(values):.3f}"]
    header = ["trials", "check + load, median s", "max s",
              "load to first token via the router, median s", "max s"]  # fmt: skip
    return table(header, [cells])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=list(BASES), default=list(BASES))
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--requests", type=int, default=16, help="measured per concurrency")
    parser.add_argument("--max-tokens", type=int, default=32, help="output tokens per request")
    parser.add_argument(
        "--router-on", choices=list(BASES), help="model for router and switch (default: last)"
    )
    parser.add_argument("--router-requests", type=int, default=20, help="pairs, 8 tokens each")
    parser.add_argument("--switch-trials", type=int, default=3, help="adapter switches timed")
    parser.add_argument(
        "--models-dir", type=Path, help="build models (and adapters) here and reuse them"
    )
    args = parser.parse_args()
    if args.requests < 1 or args.max_tokens < 2 or min(args.concurrency) < 1:
        parser.error("--requests and --concurrency must be >= 1, --max-tokens >= 2")
    if args.router_requests < 1 or args.switch_trials < 1:
        parser.error("--router-requests and --switch-trials must be >= 1")
    router_on = args.router_on or args.models[-1]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    shipped = load_params(ROOT / "params.yaml")
    engine = vllm_engine.find_engine(ROOT / shipped.serve.venv)
    if "vllm" in args.engines and engine is None:
        parser.error(f"{ROOT / shipped.serve.venv} holds no vLLM: run `make serve-setup`")
    overall_before = load_text()

    starts: list[list[str]] = []
    loads: dict[tuple[str, str, int], Throughput] = {}
    router_report = ""
    with tempfile.TemporaryDirectory(prefix="tuneloop-bench-serving-") as tmp:
        scratch = Path(tmp)
        models_dir = args.models_dir.resolve() if args.models_dir else scratch / "models"
        models_dir.mkdir(parents=True, exist_ok=True)
        os.chdir(scratch)  # the base stage's build runs outside the repository
        for which in args.models:
            folder = models_dir / which
            took = build_model(which, folder, shipped)
            print(f"{which}: model at {folder} (built in {took:.0f} s)", flush=True)
            runs = [(kind, kind, False) for kind in args.engines]
            if "vllm" in args.engines and which == router_on:
                runs.append((ADAPTER_RUN, "vllm", True))
            for label, kind, lora in runs:
                with running(kind, folder, which, shipped, scratch, lora) as up:
                    times = [f"{up.health_s:.1f}", f"{up.first_answer_s:.1f}"]
                    starts.append([which, label, *times, load_text()])
                    print(f"{which} {label}: /health, first answer (s): {times}", flush=True)
                    model = up.backend.model
                    if lora:
                        adapters = {
                            arm: save_adapter(
                                folder, models_dir / f"{which}-adapter-{arm}", seed, shipped
                            )
                            for seed, arm in enumerate(ARMS, start=1)
                        }
                        model = f"{shipped.tracking.registered_model}-v1"
                        vllm_engine.check_adapter(
                            adapters["champion"], folder, shipped.serve.max_lora_rank
                        )
                        vllm_engine.load_adapter(
                            up.backend.url, LoraModule(model, adapters["champion"])
                        )
                    for clients in args.concurrency:
                        found = throughput(
                            up.backend.url, model, clients, args.requests, args.max_tokens
                        )
                        loads[which, label, clients] = found
                        print(f"{which} {label} c={clients}: {found}", flush=True)
                    if lora:
                        latency, switch, before, after = router_and_switch(
                            up.backend.url,
                            folder,
                            model,
                            adapters["challenger"],
                            shipped,
                            args,
                            scratch,
                        )
                        router_report = (
                            f"Router in front of vLLM ({which}, LoRA on, the champion arm an "
                            f"adapter loaded at run time; streamed requests of 8 tokens, one at "
                            f"a time; load average {before} before, {after} after):\n\n"
                            f"{router_table(latency)}\n\nChallenger adapter switch ({which}, "
                            f"rank {shipped.train.lora_r}, {shipped.train.target_modules}):\n\n"
                            f"{switch_table(switch)}"
                        )
    overall_after = load_text()

    machine = (
        f"{os.cpu_count()} CPU cores ({platform.machine()}), CPython "
        f"{platform.python_version()}, {engine.version if engine else 'no vLLM'}, transformers "
        f"{importlib.metadata.version('transformers')}"
    )
    print(
        f"\n`python benchmarks/serving.py {' '.join(sys.argv[1:])}`".replace(" `", "`")
        + f", {datetime.now(UTC):%Y-%m-%d %H:%M} UTC; {machine}; load average (1 / 5 / 15 min) "
        f"{overall_before} before, {overall_after} after. {args.requests} streamed requests of "
        f"{args.max_tokens} output tokens at each concurrency.\n\n"
        + table(
            [
                "model",
                "engine",
                "launch to /health s",
                "launch to first answer s",
                "load average then",
            ],
            starts,
        )
        + "\n\n"
        + throughput_table(args.models, [*args.engines, ADAPTER_RUN], args.concurrency, loads)
        + ("\n\n" + router_report if router_report else "")
    )


if __name__ == "__main__":
    main()
