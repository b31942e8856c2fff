"""On a GPU host: does vLLM serve an NVFP4 export and answer as transformers' path does?

Run it once, on the GPU host, from the project's root with the pipeline's environment and
``.venv-serve`` holding vLLM's GPU build (``make serve-setup``):

    .venv/bin/python benchmarks/nvfp4_gpu_check.py models/nvfp4 [--questions 20]

What it does, in order, and stops at the first step that fails:

1. The GPU and the format: ``tuneloop.quantization.servable`` on this host's weakest GPU
   (NVML). Blackwell (sm 10.0+) runs NVFP4 natively (FP4 weights and activations); sm 8.0-9.x
   weight-only (vLLM's Marlin FP4 kernel, 16-bit activations); older GPUs are refused.
2. transformers' path, as ``evaluate`` scores an export vLLM cannot run: the folder loaded
   with compressed-tensors decompressing the FP4 weights into bf16, greedy answers to the
   demo's support questions (chat template, ``max_tokens`` new tokens).
3. vLLM's OpenAI server on the same folder, started as ``tuneloop serve`` starts it
   (``vllm_engine.plan_launch``), the same prompts as token ids to ``/v1/completions``,
   temperature 0; which linear kernel vLLM chose is read from its log.
4. The answers compared string by string. Weight-only serving computes what the
   decompressed path computes (FP4 weights, 16-bit activations), so answers should match but
   for bf16 rounding at near-ties; native NVFP4 also rounds activations to FP4, which the
   decompressed path does not, so some answers may part. ``--min-agreement`` (default 0.8)
   is the share of identical answers below which the script exits 1.

Prints a JSON summary (GPU, how it served, vLLM's version and kernel, agreement, every
differing answer) and writes it to ``--out`` (default reports/nvfp4-gpu-check.json).
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import socket
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from tuneloop import quantization
from tuneloop.demo import domain
from tuneloop.params import load_params
from tuneloop.release import serve, vllm_engine

log = logging.getLogger("nvfp4_gpu_check")
# vLLM (0.32, kernels/linear/__init__.py) logs the NVFP4 GEMM kernel it picked, e.g.
# CutlassNvFp4LinearKernel on Blackwell, MarlinNvFp4LinearKernel (weight-only) below it.
KERNEL_LINE = re.compile(r"Using (\w+) for NVFP4 GEMM")


def questions(count: int) -> list[str]:
    found = [str(r["prompt"]) for r in domain.support_records(7, 4 * count) if "prompt" in r]
    return found[:count]


def transformers_answers(
    folder: Path, prompts: list[list[int]], max_tokens: int
) -> list[list[int]]:
    """Greedy new tokens from the decompressed (bf16) model, on the GPU."""
    import torch

    from tuneloop.models import load_causal_lm

    model: Any = load_causal_lm(folder, "bfloat16")
    model.to("cuda")
    answers = []
    for ids in prompts:
        batch = torch.tensor([ids], device="cuda")
        with torch.no_grad():
            out = model.generate(batch, max_new_tokens=max_tokens, do_sample=False)
        answers.append(out[0, len(ids) :].tolist())
    return answers


def vllm_answers(
    url: str, model: str, prompts: list[list[int]], max_tokens: int
) -> list[list[int]]:
    """Greedy new tokens from vLLM's completions API, prompt given as token ids."""
    answers = []
    for ids in prompts:
        body = {
            "model": model,
            "prompt": ids,
            "max_tokens": max_tokens,
            "temperature": 0,
            "return_token_ids": True,
        }
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=300, trust_env=False)
        reply.raise_for_status()
        answers.append(list(reply.json()["choices"][0]["token_ids"]))
    return answers


def without_eos(ids: list[int], eos: int | None) -> list[int]:
    return ids[: ids.index(eos)] if eos is not None and eos in ids else ids


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="an NVFP4 (or NVFP4A16) export folder")
    parser.add_argument("--questions", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--min-agreement", type=float, default=0.8)
    parser.add_argument("--out", type=Path, default=Path("reports/nvfp4-gpu-check.json"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    from transformers import AutoTokenizer

    fmt = quantization.format_of(args.folder)
    if fmt is None or fmt.name == "fp8":
        print(f"{args.folder} is not an FP4 export (its config says {fmt})", file=sys.stderr)
        return 2
    gpu = serve.host_gpu()
    can = quantization.servable(fmt, *(gpu or (None, None)))
    print(can.sentence, flush=True)
    if can.how == "refused":
        return 2
    params = load_params()
    engine = vllm_engine.find_engine(params.serve.venv)
    if engine is None or engine.device != "gpu":
        print(
            f"{params.serve.venv} holds no GPU build of vLLM: `make serve-setup`", file=sys.stderr
        )
        return 2

    tokenizer: Any = AutoTokenizer.from_pretrained(args.folder)
    asked = questions(args.questions)
    prompts = [
        tokenizer(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
            ),
            add_special_tokens=False,
        )["input_ids"]
        for q in asked
    ]
    started = time.perf_counter()
    reference = transformers_answers(args.folder, prompts, args.max_tokens)
    hf_seconds = time.perf_counter() - started

    port, name = free_port(), "nvfp4-check"
    launch = vllm_engine.plan_launch(engine, args.folder.resolve(), name, port, params.serve)
    log_file = args.out.with_suffix(".vllm.log")
    backend = vllm_engine.start_vllm(launch, f"http://127.0.0.1:{port}", name, log_file)
    try:
        waited = backend.wait_healthy(timeout=1200)
        started = time.perf_counter()
        served = vllm_answers(backend.url, name, prompts, args.max_tokens)
        vllm_seconds = time.perf_counter() - started
    finally:
        backend.stop(grace=30)
    kernels = sorted(set(KERNEL_LINE.findall(log_file.read_text(errors="replace"))))

    eos = tokenizer.eos_token_id
    differing = []
    for question, hf, vl in zip(asked, reference, served, strict=True):
        hf_text = tokenizer.decode(without_eos(hf, eos), skip_special_tokens=True)
        vl_text = tokenizer.decode(without_eos(vl, eos), skip_special_tokens=True)
        if hf_text.strip() != vl_text.strip():
            differing.append({"question": question, "transformers": hf_text, "vllm": vl_text})
    agreement = 1 - len(differing) / len(asked)
    summary = {
        "folder": str(args.folder),
        "format": fmt.name,
        "gpu": None if gpu is None else {"name": gpu[0], "compute_capability": list(gpu[1])},
        "served": can.how,
        "vllm": engine.version,
        "vllm_kernels": kernels,
        "vllm_ready_seconds": round(waited, 1),
        "questions": len(asked),
        "agreement": round(agreement, 3),
        "transformers_seconds": round(hf_seconds, 1),
        "vllm_seconds": round(vllm_seconds, 1),
        "differing": differing,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2, ensure_ascii=False))
    print(json.dumps(summary, indent=2, ensure_ascii=False))
    return 0 if agreement >= args.min_agreement else 1


if __name__ == "__main__":
    sys.exit(main())
