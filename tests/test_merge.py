"""Merge (equivalence gate, full fine-tune pass-through) and FP8 export on the tiny base.

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
from tuneloop.models import load_causal_lm, load_tokenizer
from tuneloop.params import load_params
from tuneloop.training import merge

# The whole suite (`make test`): pre-trains the tiny base, merges and exports it
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


def metrics(folder: Path, stage: str) -> dict[str, Any]:
    return json.loads((folder / "metrics" / f"{stage}.json").read_text())


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    folder = tmp_path_factory.mktemp("merge")
    shutil.copytree(ROOT / "eval", folder / "eval")
    write_params(folder)
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
        yield folder
    finally:
        os.chdir(previous)


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
    assert manifest["stage"] == "merge" and manifest["passed"] is True


def test_a_bf16_merge_is_checked_in_float32_and_saved_in_bf16(project: Path) -> None:
    params = load_params()
    bf16 = params.model_copy(
        update={"merge": params.merge.model_copy(update={"dtype": "bfloat16"})}
    )
    merged, _, measured = merge.merge(bf16)
    merge.check(measured, bf16.merge.max_abs_logit_diff)  # no rounding noise in the check
    assert measured["saved_dtype"] == "bfloat16"
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
    assert manifest["stage"] == "merge" and manifest["skipped"] == "full fine-tune"


def test_export_writes_an_fp8_checkpoint_that_reloads(project: Path) -> None:
    export.main()
    fp8 = project / "models/fp8"
    config = json.loads((fp8 / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors"
    assert config["ignore"] == ["lm_head"]
    dtypes = export.tensor_dtypes(fp8)
    assert dtypes["model.layers.0.mlp.down_proj.weight"] == "F8_E4M3"
    assert dtypes["model.embed_tokens.weight"] == "BF16"  # export.dtype for what stays unquantized
    measured = metrics(project, "export")
    parameters = metrics(project, "base")["parameters"]
    assert measured["bf16_reference_bytes"] == 2 * parameters
    assert measured["size_ratio"] == round(measured["fp8_bytes"] / (2 * parameters), 4) < 0.8
    assert measured["reload_forward_ok"] is True
    assert measured["fp8_tensors"] == 2 * 7  # every Linear of both layers


def test_check_format_rejects_a_folder_that_is_not_fp8(project: Path) -> None:
    with pytest.raises(export.ExportError, match="quant_method is None"):
        export.check_format(project / "models/merged", load_params().export)
