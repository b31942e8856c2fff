"""Do transformers (lm-eval's hf backend) and vLLM (its OpenAI server) score a model alike?

Scores one model folder on the eval suites twice through the evaluate stage's own scoring
(``tuneloop.judge.scoring.score``): with ``hf`` in this process, and with ``vllm``, a server
started from ``serve.venv`` on the folder. Prints, per suite and metric, both figures, the
paired difference vLLM - hf with its bootstrap interval (the gate's confidence and samples),
then every item whose answer or score differs, with both answers; and the time of each
evaluation (model load or server start included), with the load average.

Without ``--folder`` it builds the tiny model the base stage builds (``builtin:tiny``, its
pre-training included, so the general suite has answers worth comparing) in a temp folder.

    .venv/bin/python benchmarks/engine_agreement.py [--folder models/merged] [--limit 50]
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from tuneloop.judge import scoring, stats
from tuneloop.params import Params, load_params

ROOT = Path(__file__).resolve().parents[1]


def build_tiny(params: Params, folder: Path) -> Path:
    """``builtin:tiny`` as the base stage builds it: tokenizer, model, pre-training."""
    from tuneloop.demo import domain, general, tiny

    shape, seed = params.model.tiny, params.model.seed
    corpus = itertools.chain(domain.tokenizer_corpus(params.demo.seed), general.corpus())
    tokenizer = tiny.build_tokenizer(corpus, shape.vocab_size)
    model = tiny.build_model(shape, tokenizer, seed)
    chats = list(general.train_chats(seed, shape.pretrain_steps * tiny.PRETRAIN_BATCH))
    tiny.pretrain(model, tokenizer, chats, shape.pretrain_steps, seed)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def timed(
    kind: str, folder: Path, params: Params, suites: list[str], log_file: Path
) -> tuple[scoring.Scored, float]:
    tasks = scoring.task_index(params.paths.eval_suites, suites)
    start = time.perf_counter()
    scored = scoring.score(folder, params, tasks, kind, log_file=log_file)
    return scored, time.perf_counter() - start


def compare(hf: scoring.Scored, vllm: scoring.Scored, params: Params) -> list[str]:
    """Figures, paired intervals and differing items, as report lines."""
    gate = params.gate
    lines = [
        f"{'suite':14} {'metric':20} {'hf':>7} {'vllm':>7} {'vllm-hf':>8}  "
        f"{gate.confidence:.0%} interval    items"
    ]
    differing: list[str] = []
    for suite, found in hf.items.items():
        other = vllm.items[suite].aligned(found.ids, f"vllm on {suite}")
        for metric in sorted(found.values):
            a, wa = found.values[metric], found.weights[metric]
            b, wb = other.values[metric], other.weights[metric]
            mean_a, mean_b = stats.weighted_mean(a, wa), stats.weighted_mean(b, wb)
            if mean_a is None or mean_b is None:
                lines.append(f"{suite:14} {metric:20} no counted item")
                continue
            replicates = stats.bootstrap_means(
                np.stack([a, b], axis=1),
                np.stack([wa, wb], axis=1),
                gate.bootstrap_samples,
                gate.seed,
            )
            found_interval = stats.interval(
                mean_b - mean_a, replicates[:, 1] - replicates[:, 0], gate.confidence
            )
            span = (
                "n/a"
                if found_interval is None
                else f"[{found_interval.low:+.3f}, {found_interval.high:+.3f}]"
            )
            changed = int(((a != b) | (wa != wb)).sum())
            lines.append(
                f"{suite:14} {metric:20} {mean_a:7.3f} {mean_b:7.3f} {mean_b - mean_a:+8.3f}  "
                f"{span:18} {len(a)} ({changed} differ)"
            )
        answers_hf = hf.answers[suite]
        order = {item: i for i, item in enumerate(vllm.items[suite].ids)}
        for i, item in enumerate(found.ids):
            j = order[item]
            scores_hf = {m: float(v[i]) for m, v in found.values.items()}
            scores_vllm = {m: float(v[j]) for m, v in vllm.items[suite].values.items()}
            if answers_hf[i] != vllm.answers[suite][j] or scores_hf != scores_vllm:
                differing += [
                    f"{suite} item {item}:",
                    f"  hf:   {answers_hf[i]!r} {scores_hf}",
                    f"  vllm: {vllm.answers[suite][j]!r} {scores_vllm}",
                ]
    total = sum(len(f.ids) for f in hf.items.values())
    same = total - len(differing) // 3
    lines += ["", f"answers identical on {same} of {total} items", *differing]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--folder", type=Path, help="model folder (default: build builtin:tiny)")
    parser.add_argument("--limit", type=int, help="items per suite (default: every item)")
    parser.add_argument(
        "--suites", nargs="+", default=["support_demo", "general_demo"], help="eval suites"
    )
    args = parser.parse_args()
    # The scoring's own lines: when vLLM answered /health, lm-eval's progress.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    params = load_params(ROOT / "params.yaml")
    evaluate = params.evaluate.model_copy(
        update={"suites": tuple(args.suites), "general_suites": (), "limit": args.limit}
    )
    paths = params.paths.model_copy(update={"eval_suites": ROOT / params.paths.eval_suites})
    params = params.model_copy(update={"evaluate": evaluate, "paths": paths})
    with tempfile.TemporaryDirectory(prefix="engine-agreement-") as tmp:
        folder = args.folder
        if folder is None:
            start = time.perf_counter()
            folder = build_tiny(params, Path(tmp) / "tiny")
            print(f"built builtin:tiny in {time.perf_counter() - start:.0f} s", flush=True)
        print(f"load average before: {os.getloadavg()}", flush=True)
        log_file = Path(tmp) / "vllm.log"
        hf, hf_s = timed("hf", folder, params, list(args.suites), log_file)
        print(f"hf ({hf.engine}): {hf_s:.1f} s", flush=True)
        vllm, vllm_s = timed("vllm", folder, params, list(args.suites), log_file)
        print(f"vllm ({vllm.engine}): {vllm_s:.1f} s (server start included)", flush=True)
        print(f"load average after: {os.getloadavg()}")
        print("\n".join(compare(hf, vllm, params)))


if __name__ == "__main__":
    main()
