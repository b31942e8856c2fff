"""Two tasks on one vLLM base with an adapter each, against two servers of their own: one run.

For each model (``tiny``, ``smollm2``: as ``benchmarks/serving.py`` builds them), two tasks'
LoRA adapters (the shipped train params' rank and modules, random non-zero weights: their
answers are not what is measured), served two ways, one after the other:

- **one base, two adapters**: one vLLM as ``tuneloop serve base`` starts it (LoRA on,
  adapters loaded at run time), both adapters loaded; every core;
- **two servers**: each task's adapter merged into its own copy of the base (what a team
  without adapters serves), one vLLM per task, launched together, each given half the cores
  (``serve.cpu_threads``: two engines on every core fight for them).

Measured for each:

- start-up: from the first launch until both tasks have answered a first request;
- memory: the resident memory (RSS) of every serving process and its children, summed, once
  both answered (vLLM's CPU KV cache, ``serve.cpu_kv_cache_gib``, is allocated per server);
- throughput at concurrency 8: both tasks at once, 4 clients each, streamed requests of
  exactly ``--max-tokens`` tokens (``tuneloop.release.loadtest``, two warm-up rounds each);
  output tokens/s of both over the wall time, TTFT p50 / p99 over both.

    .venv/bin/python benchmarks/tasks_serving.py                     # tiny and smollm2
    .venv/bin/python benchmarks/tasks_serving.py --models tiny --requests 16
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import platform
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere

from benchmarks.serving import (  # noqa: E402
    BASES,
    build_model,
    first_answer,
    free_port,
    load_text,
    pct,
    save_adapter,
    table,
)
from tuneloop.params import Params, load_params  # noqa: E402
from tuneloop.release import loadtest, vllm_engine  # noqa: E402
from tuneloop.release.backends import Backend, LoraModule  # noqa: E402

log = logging.getLogger("benchmarks.tasks_serving")

TASKS = ("support", "copy")
LAYOUTS = ("one base, two adapters", "two servers, merged")


def merged_copy(base: Path, adapter: Path, out: Path) -> Path:
    """``adapter`` merged into a copy of ``base``: the folder a server without LoRA serves."""
    if (out / "config.json").is_file():
        return out
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter)
    model.merge_and_unload().save_pretrained(out)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)
    return out


def rss_gib(pids: list[int]) -> float:
    """Resident memory of these processes and all their children, in GiB."""
    seen: set[int] = set()
    total = 0
    for pid in pids:
        try:
            root = psutil.Process(pid)
            for process in (root, *root.children(recursive=True)):
                if process.pid not in seen:
                    seen.add(process.pid)
                    total += process.memory_info().rss
        except psutil.NoSuchProcess:
            continue
    return total / 2**30


def launch(folder: Path, name: str, serve: Params, logs: Path, adapters: bool) -> Backend:
    engine = vllm_engine.find_engine(ROOT / serve.serve.venv)
    if engine is None:
        raise SystemExit(f"{ROOT / serve.serve.venv} holds no vLLM: run `make serve-setup`")
    port = free_port()
    plan = vllm_engine.plan_launch(
        engine, folder, name, port, serve.serve, runtime_adapters=adapters
    )
    return vllm_engine.start_vllm(plan, f"http://127.0.0.1:{port}", name, logs / f"{name}.log")


@dataclass
class Layout:
    """What one way of serving both tasks measured."""

    start_s: float
    rss_gib: float
    tokens_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    errors: int
    load: str


@contextmanager
def serving(
    layout: str,
    folder: Path,
    adapters: dict[str, Path],
    merged: dict[str, Path],
    shipped: Params,
    logs: Path,
) -> Iterator[tuple[dict[str, tuple[str, str]], float, list[int]]]:
    """Both tasks served as ``layout`` says: (task -> (url, model)), seconds to both answering,
    and the serving processes' pids."""
    with ExitStack() as stack:
        started = time.perf_counter()
        if layout == LAYOUTS[0]:
            base = launch(folder, "base", shipped, logs, adapters=True)
            stack.callback(base.stop, 30)
            base.wait_healthy(timeout=1200)
            for task, path in adapters.items():
                vllm_engine.check_adapter(path, folder, shipped.serve.max_lora_rank)
                vllm_engine.load_adapter(base.url, LoraModule(task, path))
            where = {task: (base.url, task) for task in adapters}
            pids = [base.process.pid]
        else:
            half = max(1, (os.cpu_count() or 2) // 2)
            own = shipped.model_copy(
                update={"serve": shipped.serve.model_copy(update={"cpu_threads": half})}
            )
            servers = {
                task: launch(path, task, own, logs, adapters=False) for task, path in merged.items()
            }
            for server in servers.values():
                stack.callback(server.stop, 30)
            for server in servers.values():
                server.wait_healthy(timeout=1200)
            where = {task: (server.url, task) for task, server in servers.items()}
            pids = [server.process.pid for server in servers.values()]
        for url, model in where.values():
            first_answer(url, model)
        yield where, time.perf_counter() - started, pids


def both_at_once(
    where: dict[str, tuple[str, str]], requests: int, max_tokens: int
) -> tuple[float, list[float], int]:
    """Both tasks under load together, 4 clients each: tokens/s over the wall, TTFTs, errors."""
    with ThreadPoolExecutor(max_workers=len(where)) as pool:
        runs = [
            pool.submit(loadtest.load_test, url, model, requests, 4, max_tokens, 600)
            for url, model in where.values()
        ]
        results = [run.result() for run in runs]
    tokens = sum(r.output_tokens for r in results)
    # Each side's measured span, after its own two warm-up rounds; the two overlap.
    measured = max(r.duration_s for r in results)
    ttft = [t for r in results for t in r.ttft_ms]
    return tokens / measured, ttft, sum(r.errors for r in results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=list(BASES), default=list(BASES))
    parser.add_argument("--requests", type=int, default=16, help="measured per task")
    parser.add_argument("--max-tokens", type=int, default=32, help="output tokens per request")
    parser.add_argument("--models-dir", type=Path, help="build models here and reuse them")
    args = parser.parse_args()
    if args.requests < 1 or args.max_tokens < 2:
        parser.error("--requests must be >= 1, --max-tokens >= 2")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    shipped = load_params(ROOT / "params.yaml")
    engine = vllm_engine.find_engine(ROOT / shipped.serve.venv)
    if engine is None:
        parser.error(f"{ROOT / shipped.serve.venv} holds no vLLM: run `make serve-setup`")
    before = load_text()
    rows: list[list[str]] = []
    with tempfile.TemporaryDirectory(prefix="tuneloop-bench-tasks-") as tmp:
        scratch = Path(tmp)
        models_dir = args.models_dir.resolve() if args.models_dir else scratch / "models"
        models_dir.mkdir(parents=True, exist_ok=True)
        os.chdir(scratch)  # the base stage's build runs outside the repository
        for which in args.models:
            folder = models_dir / which
            build_model(which, folder, shipped)
            adapters = {
                task: save_adapter(folder, models_dir / f"{which}-{task}-adapter", seed, shipped)
                for seed, task in enumerate(TASKS, start=11)
            }
            merged = {
                task: merged_copy(folder, path, models_dir / f"{which}-{task}-merged")
                for task, path in adapters.items()
            }
            for layout in LAYOUTS:
                with serving(layout, folder, adapters, merged, shipped, scratch) as up:
                    where, start_s, pids = up
                    memory = rss_gib(pids)
                    tokens_per_s, ttft, errors = both_at_once(where, args.requests, args.max_tokens)
                    found = Layout(
                        start_s,
                        memory,
                        tokens_per_s,
                        pct(ttft, 0.5) if ttft else float("nan"),
                        pct(ttft, 0.99) if ttft else float("nan"),
                        errors,
                        load_text(),
                    )
                print(f"{which} {layout}: {dataclasses.asdict(found)}", flush=True)
                rows.append(
                    [
                        which,
                        layout,
                        f"{found.start_s:.1f}",
                        f"{found.rss_gib:.2f}",
                        f"{found.tokens_per_s:.1f}",
                        f"{found.ttft_p50_ms:.0f} / {found.ttft_p99_ms:.0f}",
                        str(found.errors),
                        found.load,
                    ]
                )
            shared, apart = rows[-2], rows[-1]
            rows.append(
                [
                    which,
                    "**two servers / one base**",
                    f"{float(apart[2]) / float(shared[2]):.2f}x",
                    f"{float(apart[3]) / float(shared[3]):.2f}x",
                    f"{float(apart[4]) / float(shared[4]):.2f}x",
                    "",
                    "",
                    "",
                ]
            )
    machine = (
        f"{os.cpu_count()} CPU cores ({platform.machine()}), {engine.version}, "
        f"KV cache {shipped.serve.cpu_kv_cache_gib} GiB per server"
    )
    print(
        f"\n`python benchmarks/tasks_serving.py {' '.join(sys.argv[1:])}`".replace(" `", "`")
        + f", {datetime.now(UTC):%Y-%m-%d %H:%M} UTC; {machine}; load average (1 / 5 / 15 min) "
        f"{before} before, {load_text()} after. Both tasks at once, 4 clients each "
        f"(concurrency 8), {args.requests} streamed requests of {args.max_tokens} output "
        "tokens per task.\n\n"
        + table(
            [
                "model",
                "serving",
                "launch to both answering s",
                "RSS GiB",
                "output tokens/s, c=8",
                "TTFT p50 / p99 ms",
                "errors",
                "load average then",
            ],
            rows,
        )
    )


if __name__ == "__main__":
    main()
