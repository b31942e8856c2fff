"""Which host serves which export format, and `tuneloop serve --format` refusing before anything.

The formats themselves are exported and reloaded in tests/test_merge.py; judged and registered
on the real path in tests/test_evaluate.py. Here: the serving rules on given GPUs, and the
refusal on this host as it is (no GPU on the CI machines this suite runs on).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import write_params
from tuneloop.cli import main as cli
from tuneloop.params import load_params
from tuneloop.params.groups import ExportFormat
from tuneloop.quantization import FORMATS, servable
from tuneloop.release import serve

# The fast tier: no pipeline, server or rank.
pytestmark = pytest.mark.fast

B200, H100, A100, T4 = "NVIDIA B200", "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "Tesla T4"


def test_nvfp4_is_native_on_blackwell_weight_only_on_hopper_and_ampere() -> None:
    nvfp4 = FORMATS["nvfp4"]
    assert servable(nvfp4, B200, (10, 0)).how == "native"
    assert servable(nvfp4, "NVIDIA B300", (10, 3)).how == "native"
    hopper = servable(nvfp4, H100, (9, 0))
    # vLLM falls back to FP4 weights with 16-bit activations below sm 10.0: served, and said.
    assert hopper.how == "weight-only"
    assert H100 in hopper.sentence and "sm 9.0" in hopper.sentence and "W4A16" in hopper.sentence
    assert servable(nvfp4, A100, (8, 0)).how == "weight-only"
    old = servable(nvfp4, T4, (7, 5))
    assert old.how == "refused" and T4 in old.sentence and "--format merged" in old.sentence


def test_nvfp4a16_runs_from_ampere_and_fp8_everywhere_vllm_runs() -> None:
    assert servable(FORMATS["nvfp4a16"], A100, (8, 0)).how == "native"
    assert servable(FORMATS["nvfp4a16"], T4, (7, 5)).how == "refused"
    assert servable(FORMATS["fp8"], H100, (9, 0)).how == "native"
    assert servable(FORMATS["fp8"], A100, (8, 0)).how == "weight-only"
    assert servable(FORMATS["fp8"], None, None).how == "native"  # vLLM's CPU build emulates it


@pytest.mark.parametrize("fmt", ["nvfp4", "nvfp4a16"])
def test_fp4_on_a_host_without_a_gpu_is_refused_naming_the_format(fmt: ExportFormat) -> None:
    refused = servable(FORMATS[fmt], None, None)
    assert refused.how == "refused"
    assert refused.sentence.startswith(f"{fmt} cannot be served on this host: it has no GPU")
    assert "--format fp8" in refused.sentence


def test_a_version_without_the_format_asked_for_is_not_served(tmp_path: Path) -> None:
    folders = {"merged": tmp_path / "merged", "fp8": tmp_path / "fp8"}
    assert serve.pick_folder("support", "3", folders, None) == ("fp8", folders["fp8"])
    assert serve.pick_folder("support", "3", {"merged": folders["merged"]}, None)[0] == "merged"
    with pytest.raises(serve.NotServable, match=r"support v3 holds no nvfp4a16 export"):
        serve.pick_folder("support", "3", folders, "nvfp4a16")


def fetch_nothing(name: str, alias: str, serve_dir: Path) -> None:
    raise AssertionError("the registry was read: a refused format must stop before fetching")


@pytest.mark.skipif(serve.host_gpu() is not None, reason="this host has a GPU")
def test_serve_refuses_nvfp4_on_this_cpu_host_before_starting_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    write_params(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(serve, "fetch", fetch_nothing)
    with pytest.raises(serve.NotServable, match="nvfp4 cannot be served on this host"):
        serve.prepare("support", "champion", 8001, load_params().serve, fmt="nvfp4")
    assert cli(["serve", "champion", "--format", "nvfp4"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("tuneloop serve: nvfp4 cannot be served on this host: it has no GPU")
    assert not (tmp_path / "run").exists()  # nothing downloaded, recorded or started
