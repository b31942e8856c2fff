"""Stage ``export``: an FP8 checkpoint of the merged model that vLLM loads as is.

Reads:  ``paths.merged``.
Writes: ``paths.fp8`` (compressed-tensors format: FP8 weights with per-channel
        scales, dynamic per-token activation scales, ``export.ignore`` layers
        and everything that is not a Linear layer kept in ``export.dtype``;
        plus manifest.json); ``metrics/export.json``.
Params: ``export``, ``paths``.

Before the stage succeeds the export is checked: its config declares the
scheme vLLM expects, its Linear weights are stored as float8 and the ignored
layers are not, and it reloads and runs a forward pass with finite logits.
Its size is reported against a bf16 copy of the same model (2 bytes a
parameter), which is what FP8 replaces in serving, whatever dtype the merged
folder was saved in (float32 on the CPU demo).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import torch
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier
from safetensors import safe_open
from transformers import PreTrainedModel

from tuneloop.io import atomic_dir, write_json
from tuneloop.models import load_causal_lm, load_tokenizer
from tuneloop.params import ExportParams, Params
from tuneloop.stage import setup_logging, stage_params, write_metrics
from tuneloop.tracking import lineage
from tuneloop.tracking.runs import stage_run

STAGE = "export"
BF16_BYTES = 2
FP8_DTYPE = "F8_E4M3"  # the safetensors name of torch.float8_e4m3fn
log = logging.getLogger(__name__)


class ExportError(RuntimeError):
    """The FP8 folder is not what vLLM expects, or does not run."""


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def bf16_bytes(model: PreTrainedModel) -> int:
    """Bytes of the model's weights in bf16 (``parameters()`` counts tied weights once)."""
    return sum(p.numel() for p in model.parameters()) * BF16_BYTES


def tensor_dtypes(folder: Path) -> dict[str, str]:
    """``tensor name -> safetensors dtype`` for every tensor of the folder, headers only."""
    dtypes: dict[str, str] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as weights:
            for name in weights.keys():  # noqa: SIM118 (safe_open is not a dict)
                dtypes[name] = weights.get_slice(name).get_dtype()
    return dtypes


def check_format(folder: Path, export: ExportParams) -> dict[str, int]:
    """Raise :class:`ExportError` unless ``folder`` is the FP8_DYNAMIC checkpoint vLLM loads."""
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    quant = config.get("quantization_config") or {}
    problems = []
    if quant.get("quant_method") != "compressed-tensors":
        problems.append(f"quant_method is {quant.get('quant_method')!r}, not 'compressed-tensors'")
    for group in quant.get("config_groups", {}).values():
        weights, activations = group.get("weights") or {}, group.get("input_activations") or {}
        if (weights.get("type"), weights.get("num_bits"), weights.get("strategy")) != (
            "float",
            8,
            "channel",
        ):
            problems.append(f"weights are not FP8 per channel: {weights}")
        if (activations.get("dynamic"), activations.get("strategy")) != (True, "token"):
            problems.append(f"activations are not dynamic per token: {activations}")
    if not quant.get("config_groups"):
        problems.append("no quantization config_groups")
    missing_ignore = sorted(set(export.ignore) - set(quant.get("ignore", [])))
    if missing_ignore:
        problems.append(f"export.ignore layers {missing_ignore} are not in the config's ignore")
    dtypes = tensor_dtypes(folder)
    fp8 = [name for name, dtype in dtypes.items() if dtype == FP8_DTYPE]
    if not fp8:
        problems.append("no float8 tensor in the saved weights")
    ignored_fp8 = [n for n in fp8 if any(n.startswith(f"{layer}.") for layer in export.ignore)]
    if ignored_fp8:
        problems.append(f"ignored layers were quantized anyway: {ignored_fp8}")
    if problems:
        raise ExportError(f"export: {folder} is not a valid FP8 checkpoint: " + "; ".join(problems))
    return {"fp8_tensors": len(fp8), "high_precision_tensors": len(dtypes) - len(fp8)}


def reload_and_run(folder: Path, dtype: str) -> None:
    """Load the export as vLLM would see it and run one forward pass."""
    model = load_causal_lm(folder, dtype)
    tokenizer = load_tokenizer(folder)
    probe: Any = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        logits = model(**probe).logits
    if not torch.isfinite(logits).all():
        raise ExportError(f"export: the reloaded FP8 model in {folder} produced non-finite logits")


def export(params: Params, out: Path) -> dict[str, Any]:
    started = time.perf_counter()
    # Loaded in the serving dtype: the layers FP8 leaves alone are stored in it.
    model = load_causal_lm(params.paths.merged, params.export.dtype)
    tokenizer = load_tokenizer(params.paths.merged)
    bf16_reference = bf16_bytes(model)
    recipe = QuantizationModifier(
        targets="Linear", scheme=params.export.scheme, ignore=list(params.export.ignore)
    )
    # FP8_DYNAMIC needs no calibration data: weight scales come from the weights,
    # activation scales are computed per token at inference.
    oneshot(model=model, recipe=recipe)
    model.save_pretrained(out, save_compressed=True)
    tokenizer.save_pretrained(out)
    tensors = check_format(out, params.export)
    reload_and_run(out, params.export.dtype)
    fp8_bytes, merged_bytes = folder_bytes(out), folder_bytes(params.paths.merged)
    return {
        "scheme": params.export.scheme,
        "fp8_bytes": fp8_bytes,
        "merged_bytes": merged_bytes,
        "bf16_reference_bytes": bf16_reference,
        # The headline: FP8 on disk against the bf16 checkpoint it replaces in serving.
        "size_ratio": round(fp8_bytes / bf16_reference, 4),
        "size_ratio_vs_merged": round(fp8_bytes / merged_bytes, 4),
        "reload_forward_ok": True,
        **tensors,
        "seconds": round(time.perf_counter() - started, 1),  # load, quantize, save, check
    }


def main() -> None:
    setup_logging()
    params = stage_params()
    with stage_run(STAGE, params):
        with atomic_dir(params.paths.fp8) as out:
            metrics = export(params, out)
            write_json(
                out / "manifest.json",
                lineage.manifest(STAGE, params, inputs={"merged": params.paths.merged}, **metrics),
            )
        write_metrics(params, STAGE, metrics)
        log.info("export: %s", metrics)


if __name__ == "__main__":
    main()
