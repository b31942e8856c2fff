"""Time the whole preflight gate on 100k packed samples: every check, as the stage runs them.

Builds a throwaway project: the tiny model and its tokenizer, ``--distinct`` multi-turn demo
chats whose token lengths follow the pack benchmark's long tail (lognormal, mean 5.5, sigma
1.1 in log space, clipped to [8, seq_len]), repeated to ``--samples`` rows of train.jsonl,
tokenized with the chat template and packed by pack's own code for ``--world-size`` ranks,
plus the demo eval suite. None of that is timed. Then ``run_preflight`` runs once to warm the
page cache and ``--repeats`` times timed; the best and the median are reported, total and per
check. Imports (torch, transformers) are measured apart, in a fresh interpreter.

    python benchmarks/preflight.py                 # 100k samples, seq_len 4096, 8 ranks
    python benchmarks/preflight.py --samples 20000
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from tuneloop.data import text, turn_keys
from tuneloop.data.chat import tokenize_chat
from tuneloop.data.pack import balance_ranks, pack_samples
from tuneloop.data.shards import VAL_SHARD, shard_name, write_shard
from tuneloop.demo import domain, tiny
from tuneloop.judge import suites
from tuneloop.params import load_params
from tuneloop.preflight import data as pf_data
from tuneloop.preflight import run as pf_run

ROOT = Path(__file__).resolve().parents[1]
log = logging.getLogger("benchmarks.preflight")


def chats(
    n: int, seq_len: int, tokenizer: Any, eval_questions: set[str], seed: int
) -> list[list[dict[str, str]]]:
    """``n`` chats of 1-3 turns about a long-tailed token target long each.

    Length comes from long messages, as in real data, not from many turns: assistant replies
    are several demo answers joined, and a third of the user turns paste earlier answers in
    front of the question. No question is an eval item (clean removed those).
    """
    rng = np.random.default_rng(seed)
    targets = np.clip(rng.lognormal(mean=5.5, sigma=1.1, size=n), 8, seq_len).astype(int)
    pairs = [
        (str(r["prompt"]), str(r["response"]))
        for r in domain.support_records(seed, 5000)
        if "prompt" in r and r["prompt"] not in eval_questions
    ]
    answer_tokens = [len(ids) for ids in tokenizer([a for _, a in pairs])["input_ids"]]
    result, at = [], 0
    for target in targets.tolist():
        turns = int(rng.integers(1, 4))
        messages: list[dict[str, str]] = []
        for _ in range(turns):
            question, _ = pairs[at % len(pairs)]
            if rng.random() < 1 / 3:
                question = f"{pairs[(at + 1) % len(pairs)][1]} {question}"
            answer: list[str] = []
            tokens = 0
            while not answer or tokens < target / turns:
                answer.append(pairs[at % len(pairs)][1])
                tokens += answer_tokens[at % len(pairs)] + 1
                at += 1
            messages += [
                {"role": "user", "content": question},
                {"role": "assistant", "content": " ".join(answer)},
            ]
        result.append(messages)
    return result


def build(folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The project the gate reads; returns what was built."""
    shutil.copytree(ROOT / "eval", folder / "eval")
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["model"]["tiny"].update(vocab_size=2048, max_position_embeddings=args.seq_len)
    params["pack"]["seq_len"] = args.seq_len
    params["batch"] = {
        "world_size": args.world_size,
        "micro_batch_size": args.micro_batch_size,
        "effective_batch": args.world_size
        * args.micro_batch_size
        * args.gradient_accumulation_steps,
    }
    params["train"]["distributed"] = "ddp" if args.world_size > 1 else "none"
    (folder / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    with contextlib.chdir(folder):
        p = load_params()
        tokenizer = tiny.build_tokenizer(domain.tokenizer_corpus(p.demo.seed), 2048)
        model = tiny.build_model(p.model.tiny, tokenizer, p.model.seed)
        model.save_pretrained(p.paths.base_model)
        tokenizer.save_pretrained(p.paths.base_model)

        eval_questions = {q for _, q in suites.questions(p.paths.eval_suites)}
        distinct = chats(args.distinct, args.seq_len, tokenizer, eval_questions, args.seed)
        tokens = [tokenize_chat(tokenizer, messages) for messages in distinct]
        lines = [
            json.dumps({"id": f"chat-{i}", "messages": m}, ensure_ascii=False) + "\n"
            for i, m in enumerate(distinct)
        ]
        p.paths.clean.mkdir(parents=True)
        # As clean writes it: the file, and beside it the key of each of its user turns.
        encoded = [line.encode() for line in lines]
        user_keys = [
            [np.frombuffer(text.key(m["content"]), np.uint8) for m in c if m["role"] == "user"]
            for c in distinct
        ]
        rows = [i % args.distinct for i in range(args.samples)]
        data = b"".join(encoded[r] for r in rows)
        (p.paths.clean / "train.jsonl").write_bytes(data)
        writer = turn_keys.TurnKeysWriter()
        writer.add(
            data,
            args.samples,
            np.array([len(user_keys[r]) for r in rows]),
            np.array([k for r in rows for k in user_keys[r]]),
        )
        writer.save(p.paths.clean / turn_keys.NAME)
        del data
        (p.paths.clean / "val.jsonl").write_text("")

        ids = [tokens[i % args.distinct].input_ids for i in range(args.samples)]
        labels = [tokens[i % args.distinct].labels for i in range(args.samples)]
        packed = pack_samples(ids, labels, args.seq_len, "truncate")
        plan = balance_ranks(
            packed.bins.tokens_per_bin,
            args.world_size,
            args.micro_batch_size,
            args.gradient_accumulation_steps,
        )
        p.paths.packed.mkdir(parents=True)
        for rank, indices in enumerate(plan.shards):
            write_shard(packed.bins.select(indices).table(), p.paths.packed / shard_name(rank))
        empty = pack_samples([], [], args.seq_len, "truncate")
        write_shard(empty.bins.table(), p.paths.packed / VAL_SHARD)
        (p.paths.packed / "manifest.json").write_text(json.dumps({"samples": args.samples}))
        built = {
            "samples": args.samples,
            "distinct_chats": args.distinct,
            "tokens": packed.real_tokens,
            "truncated": packed.n_truncated,
            "bins": len(packed.bins) - plan.n_bins_dropped,
            "micro_batches_per_rank": plan.micro_batches_per_rank,
            "train_jsonl_mb": round((p.paths.clean / "train.jsonl").stat().st_size / 1e6, 1),
            "shards_mb": round(
                sum(f.stat().st_size for f in p.paths.packed.glob("rank-*.parquet")) / 1e6, 1
            ),
        }
    del packed, ids, labels, tokens
    gc.collect()
    return built


def import_seconds() -> float:
    """Importing the stage in a fresh interpreter (pyarrow and numpy; torch is imported when
    the machine is probed, MLflow after the checks)."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import stages.preflight"], cwd=ROOT, check=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=100_000, help="rows of train.jsonl packed")
    parser.add_argument(
        "--distinct", type=int, default=1000, help="distinct chats the samples repeat"
    )
    parser.add_argument("--seq-len", type=int, default=4096, help="tokens per packed bin")
    parser.add_argument("--world-size", type=int, default=8, help="ranks (one shard each)")
    parser.add_argument("--micro-batch-size", type=int, default=1, help="bins per micro-batch")
    parser.add_argument(
        "--gradient-accumulation-steps", type=int, default=4, help="micro-batches per step"
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed runs (best and median)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic chats")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    load_before = os.getloadavg()
    print(f"load average before: {load_before}", flush=True)

    with tempfile.TemporaryDirectory(prefix="preflight-bench-") as tmp:
        folder = Path(tmp)
        started = time.perf_counter()
        built = build(folder, args)
        log.info("built in %.1f s: %s", time.perf_counter() - started, built)
        with contextlib.chdir(folder):
            params = load_params()
            pf_run.run_preflight(params)  # warm-up: page cache, tokenizer files
            timed_load = os.getloadavg()  # the 1-minute figure covers the timed runs below
            reports = [pf_run.run_preflight(params) for _ in range(args.repeats)]
            timed_load_after = os.getloadavg()
            # The contamination check on a train.jsonl that clean did not write (no keys).
            (params.paths.clean / turn_keys.NAME).unlink()
            questions = list(
                suites.held_out_questions(params.paths.eval_suites, params.paths.fixed_badcases)
            )
            parsed = []
            for _ in range(args.repeats):
                started = time.perf_counter()
                check = pf_data.check_eval_contamination(
                    params.paths.clean / "train.jsonl", questions
                )
                parsed.append(time.perf_counter() - started)
                assert check.status == "pass" and "parsed" in check.detail, check.detail
    imports = import_seconds()

    totals = [r.seconds for r in reports]
    reads = [r.read_seconds for r in reports]
    print(
        f"\n{built['samples']:,} samples ({built['distinct_chats']} distinct chats), "
        f"{built['tokens']:,} tokens, {built['bins']:,} bins of <= {args.seq_len} on "
        f"{args.world_size} ranks ({built['micro_batches_per_rank']} micro-batches each); "
        f"train.jsonl {built['train_jsonl_mb']} MB, shards {built['shards_mb']} MB\n"
        f"{platform.machine()}, {os.cpu_count()} CPU cores, CPython {platform.python_version()}; "
        f"load average (1 min) {load_before[0]:.2f} at start, {timed_load[0]:.2f} / "
        f"{timed_load_after[0]:.2f} before / after the timed runs\n"
    )
    print("| gate | best (s) | median (s) |\n|---|---|---|")
    print(f"| whole gate | {min(totals):.3f} | {statistics.median(totals):.3f} |")
    print(f"| of which reading | {min(reads):.3f} | {statistics.median(reads):.3f} |")
    print(f"| import stages.preflight (fresh interpreter, once) | {imports:.2f} | |\n")
    print("| check | status | best (ms) | median (ms) |\n|---|---|---|---|")
    for i, check in enumerate(reports[0].checks):
        times = [r.checks[i].seconds * 1000 for r in reports]
        print(
            f"| {check.name} | {check.status} | {min(times):.1f} | {statistics.median(times):.1f} |"
        )
    print(
        f"| no_eval_contamination without clean's keys (file parsed, read included) | pass | "
        f"{min(parsed) * 1000:.1f} | {statistics.median(parsed) * 1000:.1f} |"
    )
    failed = reports[0].failed
    if failed:
        print("\nfailed (unexpected on this synthetic project):")
        for c in failed:
            print(f"  {c.name}: {c.detail}")


if __name__ == "__main__":
    main()
