"""Stage ``export``: the merged model in each format of ``export.formats``, as vLLM loads it.

Reads:  ``paths.merged``; ``paths.clean``/train.jsonl (nvfp4 calibrates its activation
        scales on the first ``export.calibration_samples`` chats, as served).
Writes: ``paths.fp8``, ``paths.nvfp4``, ``paths.nvfp4a16`` (compressed-tensors folders, each
        with manifest.json; ``tuneloop/quantization.py`` says what each format is); a format
        ``export.formats`` does not list keeps its folder, holding only a manifest that says
        so, since each folder is a DVC out; ``metrics/export.json`` (size and time of each).
Params: ``export``, ``paths``.

Before the stage succeeds each export is checked: its config declares the scheme vLLM
expects, its Linear weights are stored in the format and the ignored layers are not, and it
reloads and runs a forward pass with finite logits. Sizes are reported against a bf16 copy
of the same model (2 bytes a parameter), which is what an export replaces in serving,
whatever dtype the merged folder was saved in (float32 on the CPU demo).
"""

from __future__ import annotations

import logging
import time

from tuneloop.io import atomic_dir, write_json
from tuneloop.models import load_causal_lm
from tuneloop.params import Params
from tuneloop.quantization import (
    FORMATS,
    ExportMetrics,
    FormatMetrics,
    NotExported,
    bf16_bytes,
    export_format,
    folder_bytes,
    folder_of,
)
from tuneloop.stage import setup_logging, stage_params, write_metrics
from tuneloop.tracking import lineage
from tuneloop.tracking.runs import stage_run

STAGE = "export"
log = logging.getLogger(__name__)


def export(params: Params) -> ExportMetrics:
    """Every format of ``export.formats`` into its folder; the others' folders say why not."""
    started = time.perf_counter()
    bf16_reference = bf16_bytes(load_causal_lm(params.paths.merged, params.export.dtype))
    merged_bytes = folder_bytes(params.paths.merged)
    done: dict[str, FormatMetrics] = {}
    inputs = {"merged": params.paths.merged}
    for name, fmt in FORMATS.items():
        with atomic_dir(folder_of(params, name)) as out:
            if name not in params.export.formats:
                why = f"{name} is not in export.formats {list(params.export.formats)}"
                write_json(out / "manifest.json", NotExported(format=name, reason=why).model_dump())
                continue
            log.info("export: %s (%s)", name, fmt.scheme)
            done[name] = export_format(fmt, params, out, merged_bytes, bf16_reference)
            calibrated = {"clean": params.paths.clean} if fmt.calibrated else {}
            write_json(
                out / "manifest.json",
                lineage.manifest(
                    STAGE, params, inputs | calibrated, format=name, **done[name].model_dump()
                ),
            )
    return ExportMetrics(
        formats=done,
        merged_bytes=merged_bytes,
        bf16_reference_bytes=bf16_reference,
        seconds=round(time.perf_counter() - started, 1),
    )


def main() -> None:
    setup_logging()
    params = stage_params()
    with stage_run(STAGE, params):
        metrics = export(params)
        write_metrics(params, STAGE, metrics.model_dump())
        log.info("export: %s", metrics.model_dump_json())


if __name__ == "__main__":
    main()
