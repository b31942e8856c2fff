"""Scoring a model on the eval suites through lm-eval, item by item.

lm-eval's Hugging Face backend, or vLLM where it is installed and a GPU is present, so a
suite scores the same inside tuneloop and under ``lm_eval --include_path eval/``.

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
import importlib.util
import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from lm_eval import simple_evaluate
from lm_eval.api.registry import get_model
from lm_eval.tasks import TaskManager, get_task_dict

from tuneloop.io import read_jsonl, write_jsonl
from tuneloop.judge.gate import Directions, GateError, SuiteItems
from tuneloop.params import Params

log = logging.getLogger(__name__)
MISSING_LABEL = "(none)"  # the slice label of an item that lacks the field


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def backend(params: Params) -> str:
    """The lm-eval backend ``evaluate.backend`` asks for, resolved for this machine."""
    has_vllm = importlib.util.find_spec("vllm") is not None
    if params.evaluate.backend == "vllm" and not has_vllm:
        raise RuntimeError(
            "evaluate.backend=vllm but vllm is not installed in this environment; install it "
            "(it pins its own torch: see README) or set evaluate.backend to hf or auto"
        )
    if params.evaluate.backend == "auto":
        return "vllm" if has_vllm and _cuda() else "hf"
    return params.evaluate.backend


def model_args(kind: str, ref: str | Path) -> dict[str, Any]:
    if kind == "vllm":
        # dtype auto keeps an FP8 checkpoint in FP8; vLLM reads its compressed-tensors config.
        return {"pretrained": str(ref), "dtype": "auto", "gpu_memory_utilization": 0.8}
    # float32 on CPU (bf16 matmuls are slow there); the checkpoint's own dtype on a GPU.
    return {"pretrained": str(ref), "dtype": "auto" if _cuda() else "float32"}


@dataclass
class Scored:
    """One model's figures, per-item scores and metric directions on the suites it ran."""

    scores: dict[str, dict[str, float]] = field(default_factory=dict)  # suite -> metric -> value
    items: dict[str, SuiteItems] = field(default_factory=dict)
    directions: Directions = field(default_factory=dict)
    not_judged: dict[str, str] = field(default_factory=dict)  # "suite/metric" -> why


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
) -> Scored:
    """Every metric of every business suite (and of the ``general`` and ``regression``
    suites) for one model, per item, with each metric's direction, from lm-eval. The model
    loads once. Regression suites (the fixed badcases) run whole and are read as strictly as
    business suites, without slices."""
    _environment_report_once()
    lm = get_model(kind).create_from_arg_obj(
        model_args(kind, model_ref),
        {"batch_size": params.evaluate.batch_size, "device": "cuda" if _cuda() else "cpu"},
    )
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
    del lm
    gc.collect()  # a GPU backend holds its memory until the object is gone
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
