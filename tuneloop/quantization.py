"""The merged model's quantized exports: FP8 and NVFP4, what makes, checks and serves each.

One table (:data:`FORMATS`) says, per ``export.formats`` entry, the llm-compressor scheme,
whether it needs calibration data, what its config and weights must look like, and which
hardware runs it in vLLM. The export stage (``stages/export.py``), the evaluate stage
(which engine can score a folder), the registry (a version's formats) and ``tuneloop
serve`` (refuse a host that cannot run the format) all read it.

Where vLLM runs what (vLLM's ``compressed_tensors`` schemes and ``marlin_utils_fp4``):

- fp8 (``FP8_DYNAMIC``): natively from sm 8.9 (Ada, Hopper, Blackwell); weight-only through
  Marlin on sm 8.0-8.6; the CPU build runs it too (emulated).
- nvfp4 (``NVFP4``, W4A4): natively from sm 10.0 (Blackwell); on sm 8.0-9.x vLLM itself
  falls back to weight-only FP4 through Marlin (W4A16: FP4 weights, 16-bit activations), so
  tuneloop serves it there and says so, rather than refusing what the engine runs; the
  CPU build has no FP4 kernel.
- nvfp4a16 (``NVFP4A16``): Marlin from sm 8.0; no CPU kernel.

Where vLLM cannot run a folder (the CPU build and FP4), it is scored on transformers'
decompressed path: compressed-tensors expands the FP4 weights into bf16 Linear layers
(float32 fails: the scales stay bf16), which computes what the FP4 weights hold, not FP4
arithmetic.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tuneloop.io import read_jsonl
from tuneloop.params import ExportParams, Params
from tuneloop.params.groups import ExportFormat

BF16_BYTES = 2
FP8_DTYPE = "F8_E4M3"  # the safetensors name of torch.float8_e4m3fn
PACKED_FP4 = "U8"  # two E2M1 values a byte, in ``weight_packed``
ComputeCapability = tuple[int, int]
How = Literal["native", "weight-only", "refused"]


class ExportError(RuntimeError):
    """An export is not the checkpoint vLLM expects, or does not run."""


@dataclass(frozen=True)
class Format:
    """One export format: how it is made, what it must look like, where vLLM runs it."""

    name: ExportFormat
    scheme: str  # llm-compressor's preset scheme
    calibrated: bool  # activation scales measured on data (nvfp4's global input scale)
    weight_bits: int
    weight_type: str  # the saved dtype of a quantized Linear's weight
    activation_bits: int | None  # None: activations stay 16-bit
    native_cc: ComputeCapability  # vLLM runs its weights and activations as stored
    weight_only_cc: ComputeCapability | None  # vLLM runs its weights only (Marlin) from here
    on_cpu: bool  # vLLM's CPU build runs it
    hf_dtype: str | None  # transformers must load it in this dtype (None: any)


FORMATS: dict[ExportFormat, Format] = {
    "fp8": Format("fp8", "FP8_DYNAMIC", False, 8, FP8_DTYPE, 8, (8, 9), (8, 0), True, None),
    "nvfp4": Format("nvfp4", "NVFP4", True, 4, PACKED_FP4, 4, (10, 0), (8, 0), False, "bfloat16"),
    "nvfp4a16": Format(
        "nvfp4a16", "NVFP4A16", False, 4, PACKED_FP4, None, (8, 0), None, False, "bfloat16"
    ),
}


def folder_of(params: Params, name: ExportFormat) -> Path:
    """``paths.<format>``: each format its own folder and DVC out."""
    folder: Path = getattr(params.paths, name)
    return folder


# --- metrics ----------------------------------------------------------------------------------


class FormatMetrics(BaseModel):
    """One exported format: its size, its time, what its check found."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    scheme: str = Field(description="llm-compressor's scheme, e.g. FP8_DYNAMIC")
    bytes: int = Field(description="the export's safetensors files, bytes")
    # The headline: on disk against the bf16 checkpoint it replaces in serving.
    size_ratio: float = Field(description="bytes / bf16_reference_bytes")
    size_ratio_vs_merged: float = Field(description="bytes / merged_bytes")
    quantized_tensors: int = Field(description="Linear weights stored in the format")
    high_precision_tensors: int = Field(
        description="every other tensor saved: scales, norms, embeddings, ignored layers"
    )
    calibration_samples: int = Field(description="chats calibrated on; 0: the scheme takes none")
    reload_forward_ok: bool = Field(
        description="the export loaded back and ran a forward pass (a failure stops the stage)"
    )
    seconds: float = Field(description="quantize, save, check and reload, s")


class ExportMetrics(BaseModel):
    """``metrics/export.json``: every format of ``export.formats`` beside the others."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    formats: dict[str, FormatMetrics] = Field(description="export format -> its metrics")
    merged_bytes: int = Field(description="the merged model's safetensors files, bytes")
    bf16_reference_bytes: int = Field(
        description="the merged model's parameters at 2 bytes each: its bf16 checkpoint"
    )
    seconds: float = Field(description="the whole stage, s")


class NotExported(BaseModel):
    """The manifest of a format's folder when ``export.formats`` does not list it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    format: str
    exported: Literal[False] = False
    reason: str


def is_exported(folder: Path) -> bool:
    """Whether ``folder`` holds an export (not the placeholder of an unlisted format)."""
    return (folder / "config.json").is_file()


# --- making ---------------------------------------------------------------------------------


def calibration_chats(params: Params) -> list[list[dict[str, str]]]:
    """The first ``export.calibration_samples`` chats of the task's clean training data."""
    path = params.paths.clean / "train.jsonl"
    if not path.is_file():
        raise ExportError(
            f"export: nvfp4 calibrates on {path}, which does not exist: run the clean stage "
            "first (`dvc repro clean`), or drop nvfp4 from export.formats"
        )
    chats: list[list[dict[str, str]]] = []
    for record in read_jsonl(path):
        chats.append(record["messages"])
        if len(chats) == params.export.calibration_samples:
            break
    if not chats:
        raise ExportError(f"export: {path} holds no chat to calibrate nvfp4 on")
    return chats


def calibration_dataset(tokenizer: Any, chats: Sequence[list[dict[str, str]]], seq_len: int) -> Any:
    """The chats as served (the chat template), tokenized: what oneshot calibrates on."""
    from datasets import Dataset

    rows = []
    for chat in chats:
        encoded = tokenizer.apply_chat_template(
            chat, tokenize=True, return_dict=True, truncation=True, max_length=seq_len
        )
        rows.append(
            {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}
        )
    return Dataset.from_list(rows)


def quantize(fmt: Format, params: Params, out: Path) -> int:
    """Quantize a fresh copy of the merged model into ``out``; the chats calibrated on."""
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    from tuneloop.models import load_causal_lm, load_tokenizer

    # Loaded in the serving dtype: the layers left alone are stored in it.
    model = load_causal_lm(params.paths.merged, params.export.dtype)
    tokenizer = load_tokenizer(params.paths.merged)
    recipe = QuantizationModifier(
        targets="Linear", scheme=fmt.scheme, ignore=list(params.export.ignore)
    )
    if fmt.calibrated:
        chats = calibration_chats(params)
        seq_len = params.export.calibration_seq_len
        oneshot(
            model=model,
            recipe=recipe,
            dataset=calibration_dataset(tokenizer, chats, seq_len),
            max_seq_length=seq_len,
            num_calibration_samples=len(chats),
        )
    else:
        # Weight scales come from the weights; FP8's activation scales per token at run time.
        chats = []
        oneshot(model=model, recipe=recipe)
    model.save_pretrained(out, save_compressed=True)
    tokenizer.save_pretrained(out)
    return len(chats)


def export_format(
    fmt: Format, params: Params, out: Path, merged_bytes: int, bf16_reference: int
) -> FormatMetrics:
    started = time.perf_counter()
    samples = quantize(fmt, params, out)
    quantized, high = check_format(out, fmt, params.export)
    reload_and_run(out, fmt, params.export.dtype)
    size = folder_bytes(out)
    return FormatMetrics(
        scheme=fmt.scheme,
        bytes=size,
        size_ratio=round(size / bf16_reference, 4),
        size_ratio_vs_merged=round(size / merged_bytes, 4),
        quantized_tensors=quantized,
        high_precision_tensors=high,
        calibration_samples=samples,
        reload_forward_ok=True,
        seconds=round(time.perf_counter() - started, 1),
    )


# --- checking -------------------------------------------------------------------------------


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def bf16_bytes(model: Any) -> int:
    """Bytes of the model's weights in bf16 (``parameters()`` counts tied weights once)."""
    return sum(p.numel() for p in model.parameters()) * BF16_BYTES


def tensor_dtypes(folder: Path) -> dict[str, str]:
    """``tensor name -> safetensors dtype`` for every tensor of the folder, headers only."""
    from safetensors import safe_open

    dtypes: dict[str, str] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as weights:
            for name in weights.keys():  # noqa: SIM118 (safe_open is not a dict)
                dtypes[name] = weights.get_slice(name).get_dtype()
    return dtypes


def _group_problems(fmt: Format, group: dict[str, Any]) -> Iterator[str]:
    weights, activations = group.get("weights") or {}, group.get("input_activations") or {}
    if fmt.name == "fp8":
        expected: tuple[Any, ...] = ("float", 8, "channel")
        if (weights.get("type"), weights.get("num_bits"), weights.get("strategy")) != expected:
            yield f"weights are not FP8 per channel: {weights}"
        if (activations.get("dynamic"), activations.get("strategy")) != (True, "token"):
            yield f"activations are not dynamic per token: {activations}"
        return
    expected = ("float", 4, "tensor_group", 16)
    found = tuple(weights.get(k) for k in ("type", "num_bits", "strategy", "group_size"))
    if found != expected:
        yield f"weights are not FP4 in blocks of 16: {weights}"
    if fmt.activation_bits is None and activations:
        yield f"activations are quantized in a weight-only format: {activations}"
    if fmt.activation_bits is not None and activations.get("num_bits") != fmt.activation_bits:
        yield f"activations are not FP4: {activations}"


def check_format(folder: Path, fmt: Format, export: ExportParams) -> tuple[int, int]:
    """(quantized tensors, others) of ``folder``; :class:`ExportError` unless it is ``fmt``."""
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    quant = config.get("quantization_config") or {}
    problems = []
    if quant.get("quant_method") != "compressed-tensors":
        problems.append(f"quant_method is {quant.get('quant_method')!r}, not 'compressed-tensors'")
    for group in quant.get("config_groups", {}).values():
        problems += _group_problems(fmt, group)
    if not quant.get("config_groups"):
        problems.append("no quantization config_groups")
    missing_ignore = sorted(set(export.ignore) - set(quant.get("ignore", [])))
    if missing_ignore:
        problems.append(f"export.ignore layers {missing_ignore} are not in the config's ignore")
    dtypes = tensor_dtypes(folder)
    weight = "weight" if fmt.name == "fp8" else "weight_packed"
    quantized = [
        n for n, dtype in dtypes.items() if dtype == fmt.weight_type and n.endswith(f".{weight}")
    ]
    if not quantized:
        problems.append(f"no {fmt.weight_type} {weight} tensor in the saved weights")
    ignored = [n for n in quantized if any(n.startswith(f"{layer}.") for layer in export.ignore)]
    if ignored:
        problems.append(f"ignored layers were quantized anyway: {ignored}")
    if problems:
        raise ExportError(
            f"export: {folder} is not a valid {fmt.name} checkpoint: " + "; ".join(problems)
        )
    return len(quantized), len(dtypes) - len(quantized)


def reload_dtype(fmt: Format, dtype: str) -> str:
    """The dtype transformers loads the export in: FP4 decompresses into bf16 only."""
    return fmt.hf_dtype or dtype


def reload_and_run(folder: Path, fmt: Format, dtype: str) -> None:
    """Load the export back and run one forward pass."""
    import torch

    from tuneloop.models import load_causal_lm, load_tokenizer

    model = load_causal_lm(folder, reload_dtype(fmt, dtype))
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
        raise ExportError(
            f"export: the reloaded {fmt.name} model in {folder} produced non-finite logits"
        )


def format_of(folder: Path) -> Format | None:
    """The export format a folder holds (None: not quantized), from its config."""
    config_path = folder / "config.json"
    if not config_path.is_file():
        return None
    config = json.loads(config_path.read_text(encoding="utf-8"))
    quant = config.get("quantization_config") or {}
    groups = list((quant.get("config_groups") or {}).values())
    if not groups:
        return None
    weights = groups[0].get("weights") or {}
    if weights.get("num_bits") == 8:
        return FORMATS["fp8"]
    if weights.get("num_bits") == 4 and weights.get("type") == "float":
        return FORMATS["nvfp4"] if groups[0].get("input_activations") else FORMATS["nvfp4a16"]
    return None


# --- serving --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Servable:
    """Whether and how vLLM runs a format on a host, in a sentence a person reads."""

    how: How
    sentence: str


def _cc(cc: ComputeCapability) -> str:
    return f"sm {cc[0]}.{cc[1]}"


def servable(fmt: Format, gpu: str | None, cc: ComputeCapability | None) -> Servable:
    """How vLLM runs ``fmt`` on a host whose (lowest) GPU is ``gpu`` with ``cc``; None: a CPU.

    Below the native capability vLLM runs FP4 weights through Marlin with 16-bit activations
    (it logs "weight-only FP4 compression will be used"): the same folder serves, slower per
    token than native FP4 and with activations unrounded, so tuneloop serves it and says so.
    """
    lowest = fmt.weight_only_cc or fmt.native_cc
    if gpu is None or cc is None:
        if fmt.on_cpu:
            return Servable("native", f"{fmt.name} runs on vLLM's CPU build (emulated)")
        return Servable(
            "refused",
            f"{fmt.name} cannot be served on this host: it has no GPU, and vLLM's CPU build has "
            f"no kernel for {fmt.name} (it needs an NVIDIA GPU of {_cc(lowest)} or newer, "
            f"{_cc(fmt.native_cc)} for native {fmt.name}); serve the fp8 or merged "
            "folder here (`--format fp8` or `--format merged`)",
        )
    if cc >= fmt.native_cc:
        return Servable("native", f"{fmt.name} runs natively on {gpu} ({_cc(cc)})")
    if fmt.weight_only_cc is not None and cc >= fmt.weight_only_cc:
        return Servable(
            "weight-only",
            f"{gpu} ({_cc(cc)}) has no native {fmt.name} (it needs {_cc(fmt.native_cc)}, "
            f"Blackwell): vLLM serves its FP4 weights with 16-bit activations (W4A16, Marlin)",
        )
    return Servable(
        "refused",
        f"{fmt.name} cannot be served on {gpu} ({_cc(cc)}): vLLM runs it from {_cc(lowest)}; "
        "serve the merged folder on this GPU (`--format merged`)",
    )
