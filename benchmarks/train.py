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

    python benchmarks/train.py                        # builds the demo project in a temp dir
    python benchmarks/train.py --project . --steps 500
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
from trl import SFTTrainer

from stages import base, clean, ingest, pack
from tuneloop.demo import domain
from tuneloop.models import base_model_ref, load_tokenizer
from tuneloop.params import Params, load_params
from tuneloop.training import methods, run
from tuneloop.training.plan import Environment, resolve_plan

ROOT = Path(__file__).resolve().parents[1]
log = logging.getLogger("benchmarks.train")


def build_project(folder: Path, samples: int, seq_len: int) -> None:
    """The demo domain through base, ingest, clean and pack, in ``folder``."""
    shutil.copytree(ROOT / "eval", folder / "eval")
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["demo"]["n_support"] = samples
    params["pack"]["seq_len"] = seq_len
    (folder / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    loaded = load_params()
    domain.seed_month(loaded.paths.incoming, loaded.demo)
    for stage in (base, ingest, clean, pack):
        stage.main()


def config(params: Params, output_dir: Path) -> Any:
    planned = resolve_plan(params, Environment.probe())
    has_val = methods.val_set(params.paths.packed) is not None
    args = methods.sft_args(params, planned, output_dir, has_val)
    args.report_to = []
    return args, planned


def timed(trainer: Any) -> tuple[float, int]:
    started = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - started
    tokens = [e["num_tokens"] for e in trainer.state.log_history if "num_tokens" in e]
    return seconds, int(tokens[-1])


def run_stage(params: Params, output_dir: Path) -> tuple[float, int]:
    args, planned = config(params, output_dir)
    built = run.build_trainer("sft", args, params, planned, None, 0, time.time())
    seconds, tokens = timed(built.trainer)
    if built.meter.tokens() != tokens:  # the stage's own count must agree with TRL's
        raise RuntimeError(f"stage counted {built.meter.tokens()} tokens, TRL {tokens}")
    return seconds, tokens


def run_bare(params: Params, output_dir: Path) -> tuple[float, int]:
    args, planned = config(params, output_dir)
    ref = base_model_ref(params)
    trainer = SFTTrainer(
        model=methods.load_model(ref, planned),
        args=args,
        train_dataset=methods.rank_shard(params.paths.packed, 0),
        eval_dataset=methods.val_set(params.paths.packed),
        processing_class=load_tokenizer(ref),
        peft_config=methods.lora_config(params) if planned.uses_lora else None,
    )
    return timed(trainer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--project", type=Path, help="a project with data/packed (default: build)")
    parser.add_argument("--samples", type=int, default=4000, help="demo chats when building")
    parser.add_argument("--seq-len", type=int, default=256, help="pack.seq_len when building")
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps per run")
    parser.add_argument("--rounds", type=int, default=7, help="timed runs of each side")
    parser.add_argument("--method", choices=["lora", "full"], help="override train.method")
    parser.add_argument(
        "--threads", type=int, help="torch threads (default: torch's); 1 is steadier on a busy host"
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

    with tempfile.TemporaryDirectory(prefix="tuneloop-bench-train-") as scratch:
        folder = args.project.resolve() if args.project else Path(scratch) / "project"
        folder.mkdir(exist_ok=True)
        os.chdir(folder)
        if args.project is None:
            build_project(folder, args.samples, args.seq_len)
        params = load_params()
        logging_steps = params.train.logging_steps
        steps = max(logging_steps, args.steps - args.steps % logging_steps)
        overrides: dict[str, Any] = {"max_steps": steps}
        if args.method:
            overrides["method"] = args.method
        params = params.model_copy(update={"train": params.train.model_copy(update=overrides)})
        sides = {"stage": run_stage, "bare trl": run_bare}
        for name, run in sides.items():  # warm-up: first-use costs land on neither side
            run(params, Path(scratch) / f"warmup-{name}")
        results: dict[str, list[float]] = {name: [] for name in sides}
        for i in range(args.rounds):
            order = list(sides) if i % 2 == 0 else list(reversed(sides))
            for name in order:
                seconds, tokens = sides[name](params, Path(scratch) / f"run-{i}-{name}")
                results[name].append(tokens / seconds)
                rate = tokens / seconds
                print(f"round {i} {name:9s} {tokens} tokens in {seconds:.2f} s = {rate:.0f}/s")

    median = {name: statistics.median(values) for name, values in results.items()}
    print(f"\n{steps} steps, {params.train.method}, torch threads {torch.get_num_threads()}\n")
    print("| trainer | tokens/s (median) | runs |")
    print("|---|---|---|")
    for name, values in results.items():
        print(f"| {name} | {median[name]:.0f} | {', '.join(f'{v:.0f}' for v in values)} |")
    print(f"\nratio stage / bare: {median['stage'] / median['bare trl']:.3f}")


if __name__ == "__main__":
    main()
