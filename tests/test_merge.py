"""Merge (equivalence gate, full fine-tune pass-through) and the FP8 and NVFP4 exports on the
tiny base.

No training: a LoRA adapter with random A and B (peft's ``init_lora_weights=False``)
changes every output, which is all the equivalence check needs. The probe set and the
check's wording on given numbers are in test_merge_units.py.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import LoraModel
from safetensors.torch import load_file

from stages import base, export
from stages import merge as merge_stage
from tests.helpers import ROOT, write_params
from tuneloop import quantization
from tuneloop.demo import domain
from tuneloop.models import load_causal_lm, load_tokenizer
from tuneloop.params import load_params
from tuneloop.params.groups import ExportFormat
from tuneloop.training import merge

# The whole suite (`make test`): pre-trains the tiny base, merges and exports it
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


def metrics(folder: Path, stage: str) -> dict[str, Any]:
    return json.loads((folder / "metrics" / f"{stage}.json").read_text())


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    folder = tmp_path_factory.mktemp("merge")
    shutil.copytree(ROOT / "eval", folder / "eval")
    write_params(folder, {"export": {"formats": ["fp8", "nvfp4", "nvfp4a16"]}})
    previous = Path.cwd()
    os.chdir(folder)
    try:
        base.main()
        params = load_params()
        torch.manual_seed(0)
        model = get_peft_model(
            load_causal_lm(params.paths.base_model),
            LoraConfig(
                r=4, target_modules=list(params.train.target_modules), init_lora_weights=False
            ),
        )
        model.save_pretrained(str(params.paths.adapter))
        load_tokenizer(params.paths.base_model).save_pretrained(params.paths.adapter)
        write_clean_chats(params.paths.clean / "train.jsonl", 40)  # NVFP4's calibration data
        yield folder
    finally:
        os.chdir(previous)


def write_clean_chats(path: Path, count: int) -> None:
    """The clean stage's train.jsonl shape, from the demo's support chats."""
    path.parent.mkdir(parents=True, exist_ok=True)
    records = [r for r in domain.support_records(0, 2 * count) if "prompt" in r][:count]
    lines = [
        json.dumps(
            {
                "id": str(i),
                "messages": [
                    {"role": "user", "content": r["prompt"]},
                    {"role": "assistant", "content": r["response"]},
                ],
            }
        )
        for i, r in enumerate(records)
    ]
    path.write_text("\n".join(lines) + "\n")


def greedy(folder: Path, dtype: str, question: str) -> str:
    model, tokenizer = load_causal_lm(folder, dtype), load_tokenizer(folder)
    batch: Any = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=24, do_sample=False)
    return str(tokenizer.decode(out[0, batch["input_ids"].shape[1] :], skip_special_tokens=True))


def test_one_pass_over_the_answers_chooses_what_generate_chose(project: Path) -> None:
    """The check reads both models on the adapter model's greedy answers in one pass: on the
    left-padded probes, the choices of that pass are generate's own, token for token, up to
    each answer's end (a position counted from the padding would move them)."""
    params = load_params(project / "params.yaml")
    model, tokenizer = merge.load_adapter_model(params)
    questions = merge.probe_questions(params.paths.eval_suites, params.merge.probes)
    batch = merge.probe_batch(tokenizer, questions)
    assert (batch["attention_mask"] == 0).any()  # the probes differ in length: padded
    answers = merge.greedy_answers(model, batch, tokenizer.pad_token_id)
    generated = answers.inputs["input_ids"][:, answers.prompt_length :]
    read = merge.probed(model, answers)
    assert [len(c) for c in read.choices] == answers.lengths
    for row, chosen in enumerate(read.choices):
        assert torch.equal(chosen, generated[row, : len(chosen)])
    # One step that chooses otherwise is a probe that differs.
    moved = merge.Probed(read.logits, [c.clone() for c in read.choices])
    moved.choices[1][-1] += 1
    assert merge.compare(read, moved)["identical_generations"] == 1 - 1 / len(read.choices)


def test_a_perturbed_merge_fails_the_equivalence_gate(
    project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    unload = LoraModel.merge_and_unload

    def noisy(self: LoraModel, *args: Any, **kwargs: Any) -> Any:
        merged: Any = unload(self, *args, **kwargs)
        with torch.no_grad():  # noise on one weight, as a broken merge would leave it
            weight = merged.model.layers[0].self_attn.q_proj.weight
            weight += 0.05 * torch.randn_like(weight)
        return merged

    monkeypatch.setattr(LoraModel, "merge_and_unload", noisy)
    with pytest.raises(merge.NotEquivalent, match=r"logits differ by up to .*x merge"):
        merge_stage.main()
    measured = metrics(project, "merge")
    assert measured["passed"] is False
    assert measured["max_abs_logit_diff"] > measured["tolerance"] == 1e-3
    assert not (project / "models/merged").exists()  # nothing half-checked is left behind


def test_merge_matches_the_adapter_model_and_saves_a_standard_folder(project: Path) -> None:
    merge_stage.main()
    measured = metrics(project, "merge")
    assert measured["passed"] is True and measured["probes"] == 16
    assert measured["max_abs_logit_diff"] < 1e-4 and measured["identical_generations"] == 1.0
    merged = project / "models/merged"
    model = load_causal_lm(merged)
    assert not any("lora" in name for name, _ in model.named_parameters())
    tokenizer = load_tokenizer(merged)  # raises without a chat template
    assert tokenizer.padding_side == "right"  # the probes' left padding did not leak
    manifest = json.loads((merged / "manifest.json").read_text())
    assert manifest["stage"] == "merge@support" and manifest["passed"] is True


def test_a_bf16_merge_is_checked_in_float32_and_saved_in_bf16(project: Path) -> None:
    params = load_params()
    bf16 = params.model_copy(
        update={"merge": params.merge.model_copy(update={"dtype": "bfloat16"})}
    )
    merged, _, measured = merge.merge(bf16)
    merge.check(measured, bf16.merge.max_abs_logit_diff)  # no rounding noise in the check
    assert measured.saved_dtype == "bfloat16"
    assert {p.dtype for p in merged.parameters()} == {torch.bfloat16}


def test_a_full_fine_tune_is_copied_through(
    project: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shutil.copytree(project / "models/base", tmp_path / "models/adapter")
    write_params(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert merge.is_full_model(Path("models/adapter"))
    assert not merge.is_full_model(project / "models/adapter")
    merge_stage.main()
    assert metrics(tmp_path, "merge") == {"skipped": "full fine-tune", "probes": 0}
    copied = load_file(tmp_path / "models/merged/model.safetensors")
    original = load_file(project / "models/base/model.safetensors")
    assert copied.keys() == original.keys()
    assert all(torch.equal(copied[k], original[k]) for k in original)
    manifest = json.loads((tmp_path / "models/merged/manifest.json").read_text())
    assert manifest["stage"] == "merge@support" and manifest["skipped"] == "full fine-tune"


def test_export_writes_every_format_and_each_reloads(project: Path) -> None:
    export.main()
    fp8 = project / "models/fp8"
    config = json.loads((fp8 / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors"
    assert config["ignore"] == ["lm_head"]
    dtypes = quantization.tensor_dtypes(fp8)
    assert dtypes["model.layers.0.mlp.down_proj.weight"] == "F8_E4M3"
    assert dtypes["model.embed_tokens.weight"] == "BF16"  # export.dtype for what stays unquantized
    measured = metrics(project, "export")
    parameters = metrics(project, "base")["parameters"]
    assert measured["bf16_reference_bytes"] == 2 * parameters
    assert set(measured["formats"]) == {"fp8", "nvfp4", "nvfp4a16"}
    for fmt, figures in measured["formats"].items():
        assert figures["size_ratio"] == round(figures["bytes"] / (2 * parameters), 4) < 0.8
        assert figures["reload_forward_ok"] is True and figures["seconds"] > 0
        assert figures["quantized_tensors"] == 2 * 7  # every Linear of both layers
        manifest = json.loads((project / "models" / fmt / "manifest.json").read_text())
        assert manifest["stage"] == "export@support" and manifest["format"] == fmt
    # FP4 is smaller than FP8; only nvfp4 calibrates, on the task's clean chats.
    assert measured["formats"]["nvfp4"]["bytes"] < measured["formats"]["fp8"]["bytes"]
    assert measured["formats"]["nvfp4"]["calibration_samples"] == 24
    assert measured["formats"]["nvfp4a16"]["calibration_samples"] == 0
    assert "clean" in json.loads((project / "models/nvfp4/manifest.json").read_text())["inputs"]
    fp4: tuple[ExportFormat, ...] = ("nvfp4", "nvfp4a16")
    for fmt in fp4:
        folder = project / "models" / fmt
        config = json.loads((folder / "config.json").read_text())["quantization_config"]
        assert config["format"] == "nvfp4-pack-quantized"
        dtypes = quantization.tensor_dtypes(folder)
        assert dtypes["model.layers.0.mlp.down_proj.weight_packed"] == "U8"  # two E2M1 a byte
        assert dtypes["model.layers.0.mlp.down_proj.weight_scale"] == "F8_E4M3"  # per 16
        activations = "model.layers.0.mlp.down_proj.input_global_scale" in dtypes
        assert activations == (fmt == "nvfp4")
        assert quantization.format_of(folder) == quantization.FORMATS[fmt]
    # Decompressed by transformers (bf16), each answers; the untrained tiny base's greedy text
    # is noise, so the check is that it runs and ends, not what it says.
    for fmt in ("nvfp4", "nvfp4a16"):
        assert isinstance(greedy(project / "models" / fmt, "bfloat16", "hello"), str)


def test_check_format_rejects_a_folder_that_is_not_the_format(project: Path) -> None:
    fp8, nvfp4 = quantization.FORMATS["fp8"], quantization.FORMATS["nvfp4"]
    if not (project / "models/merged/config.json").exists():  # run alone
        merge_stage.main()
    with pytest.raises(quantization.ExportError, match="quant_method is None"):
        quantization.check_format(project / "models/merged", fp8, load_params().export)
    if not (project / "models/nvfp4/config.json").exists():
        export.main()
    with pytest.raises(quantization.ExportError, match="weights are not FP8 per channel"):
        quantization.check_format(project / "models/nvfp4", fp8, load_params().export)
    with pytest.raises(quantization.ExportError, match="weights are not FP4 in blocks of 16"):
        quantization.check_format(project / "models/fp8", nvfp4, load_params().export)
