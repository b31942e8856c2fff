"""Stage ``export``: an FP8 checkpoint of the merged model that vLLM loads as is.

Reads:  ``paths.merged``.
Writes: ``paths.fp8`` (compressed-tensors format: FP8 weights with per-channel
        scales, dynamic per-token activation scales, ``export.ignore`` layers
        left in high precision; plus manifest.json); ``metrics/export.json``.
Params: ``export``, ``paths``.

The export is reloaded and run once before the stage succeeds.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier

from tuneloop import lineage
from tuneloop.io import atomic_dir, write_json
from tuneloop.models import load_causal_lm, load_tokenizer
from tuneloop.params import Params, load_params
from tuneloop.stage import setup_logging, write_metrics
from tuneloop.tracking import stage_run

STAGE = "export"
log = logging.getLogger(__name__)


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def export(params: Params, out: Path) -> dict[str, Any]:
    model = load_causal_lm(params.paths.merged)
    tokenizer = load_tokenizer(params.paths.merged)
    recipe = QuantizationModifier(
        targets="Linear", scheme=params.export.scheme, ignore=list(params.export.ignore)
    )
    # FP8_DYNAMIC needs no calibration data: weight scales come from the weights,
    # activation scales are computed per token at inference.
    oneshot(model=model, recipe=recipe)
    model.save_pretrained(out, save_compressed=True)
    tokenizer.save_pretrained(out)
    reloaded = load_causal_lm(out)
    probe: Any = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        logits = reloaded(**probe).logits
    if not torch.isfinite(logits).all():
        raise SystemExit("export: the reloaded FP8 model produced non-finite logits")
    fp8_bytes, merged_bytes = folder_bytes(out), folder_bytes(params.paths.merged)
    return {
        "scheme": params.export.scheme,
        "fp8_bytes": fp8_bytes,
        "merged_bytes": merged_bytes,
        "size_ratio": round(fp8_bytes / merged_bytes, 4),
        "reload_forward_ok": True,
    }


def main() -> None:
    setup_logging()
    params = load_params()
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
