"""``tuneloop doctor``: the real run on this machine, and the GPU paths through a fake NVML.

The fake stands in for ``pynvml`` only because these machines have no GPU;
``read_gpus`` and every check after it are the functions the real run uses.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pynvml
import pytest

from tuneloop.cli.host import doctor_main
from tuneloop.judge.verdict import Check
from tuneloop.preflight import doctor
from tuneloop.preflight.doctor import (
    GpuInventory,
    TorchVersions,
    check_bandwidth,
    check_compute_capability,
    check_free_disk,
    check_gpus,
    check_nccl_tests,
    check_nvlink,
    check_page_cache,
    check_same_device,
    check_versions,
    parse_all_reduce_busbw,
    read_gpus,
    run_checks,
)

# The fast tier: no pipeline, server or rank.
pytestmark = pytest.mark.fast


def _nvml_works() -> bool:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


HAS_GPU = _nvml_works()


# --- a stand-in for pynvml --------------------------------------------------------


class FakeNVMLError(Exception):
    pass


class FakeNotSupported(FakeNVMLError):
    pass


@dataclass
class FakeGpu:
    name: str = "NVIDIA H100 80GB HBM3"
    total: int = 80 * 2**30
    used: int = 0
    power_mw: int = 700_000
    cc: tuple[int, int] = (9, 0)
    nvlinks: int = 18  # active links; the rest raise NotSupported
    broken: bool = False


@dataclass
class _Memory:
    total: int
    used: int


@dataclass
class FakeNvml:
    """Implements the functions of pynvml that ``doctor.Nvml`` lists, with pynvml's units."""

    gpus: list[FakeGpu] = field(default_factory=list)
    init_error: Exception | None = None
    cuda_driver: int = 12040
    shutdowns: int = 0

    NVMLError = FakeNVMLError
    NVML_FEATURE_ENABLED = 1
    NVML_NVLINK_MAX_LINKS = 18

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise self.init_error

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlSystemGetDriverVersion(self) -> str:
        return "550.54.15"

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return self.cuda_driver

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:
        return self.gpus[index]

    def nvmlDeviceGetName(self, handle: FakeGpu) -> str:
        if handle.broken:
            raise FakeNVMLError("GPU is lost")
        return handle.name

    def nvmlDeviceGetMemoryInfo(self, handle: FakeGpu) -> _Memory:
        return _Memory(total=handle.total, used=handle.used)

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: FakeGpu) -> int:
        return handle.power_mw

    def nvmlDeviceGetCudaComputeCapability(self, handle: FakeGpu) -> tuple[int, int]:
        return handle.cc

    def nvmlDeviceGetNvLinkState(self, handle: FakeGpu, link: int) -> int:
        if link >= handle.nvlinks:
            raise FakeNotSupported("Not Supported")
        return self.NVML_FEATURE_ENABLED


CUDA_TORCH = TorchVersions(torch="2.13.0+cu124", cuda="12.4", nccl="2.21.5", cuda_available=True)


def _inventory(*gpus: FakeGpu, cuda_driver: int = 12040) -> GpuInventory:
    return read_gpus(FakeNvml(gpus=list(gpus), cuda_driver=cuda_driver))


# --- the real run on this machine -------------------------------------------------


@pytest.mark.skipif(HAS_GPU, reason="this machine has a GPU")
def test_main_without_gpu_exits_0_and_lists_skipped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data, ckpt, report = tmp_path / "data", tmp_path / "ckpt", tmp_path / "out" / "doctor.json"
    data.mkdir()
    ckpt.mkdir()
    (data / "train.jsonl").write_text('{"text": "hi"}\n' * 100)

    args = ["--data-dir", str(data), "--checkpoint-dir", str(ckpt), "--json", str(report)]
    code = doctor_main([*args, "--probe-mb", "4"])

    out = capsys.readouterr().out
    assert code == 0
    assert "no GPU found" in out
    skipped_line = next(line for line in out.splitlines() if line.startswith("skipped:"))
    for name in ("gpu", "compute_capability", "nvlink", "versions"):
        assert name in skipped_line
    written = json.loads(report.read_text())
    assert written["ok"] is True
    by_name = {c["name"]: c for c in written["checks"]}
    assert by_name["gpu"]["status"] == "skip"
    assert "NVML" in by_name["gpu"]["detail"]  # the reason, from the real pynvml error
    assert by_name["bandwidth_data"]["value"]["write_gbps"] > 0
    assert by_name["page_cache"]["value"]["corpus_bytes"] == len('{"text": "hi"}\n') * 100
    assert not any(c["status"] == "fail" for c in written["checks"])


def test_the_table_counts_no_inconclusive_column_unless_a_check_is() -> None:
    # The doctor and preflight measure, they never estimate: an always-zero column would
    # only make a reader wonder what could have been inconclusive.
    checks = [Check("a", "pass", "fine"), Check("b", "skip", "no GPU")]
    assert doctor.status_counts(checks) == {"pass": 1, "warn": 0, "fail": 0, "skip": 1}
    assert doctor.format_table(checks).splitlines()[-2] == "1 pass, 0 warn, 0 fail, 1 skip"
    # One that could not tell is never hidden.
    assert doctor.status_counts([Check("c", "inconclusive", "?")])["inconclusive"] == 1


@pytest.mark.skipif(not HAS_GPU, reason="needs a GPU")
def test_real_nvml_reads_gpus() -> None:
    inv = read_gpus()
    assert inv.gpus and inv.driver
    assert check_gpus(inv).status in ("pass", "warn")


def test_missing_data_dir_fails_the_run(tmp_path: Path) -> None:
    checks = run_checks(tmp_path / "nope", tmp_path, probe_mb=1, nvml=FakeNvml())
    by_name = {c.name: c for c in checks}
    assert by_name["bandwidth_data"].status == "fail"
    assert "--data-dir" in by_name["bandwidth_data"].detail
    assert by_name["same_device"].status == "skip"


# --- GPU inventory through the fake -----------------------------------------------


def test_nvml_error_on_init_is_skipped_with_the_reason() -> None:
    fake = FakeNvml(init_error=FakeNVMLError("NVML Shared Library Not Found"))
    inv = read_gpus(fake)
    for check in (check_gpus(inv), check_compute_capability(inv), check_nvlink(inv)):
        assert check.status == "skip"
        assert "no GPU found" in check.detail
        assert "Shared Library Not Found" in check.detail
    assert fake.shutdowns == 0  # never started, nothing to shut down


def test_eight_h100_with_nvlink_are_ok() -> None:
    fake = FakeNvml(gpus=[FakeGpu() for _ in range(8)])
    inv = read_gpus(fake)
    assert fake.shutdowns == 1

    gpu = check_gpus(inv)
    assert gpu.status == "pass"
    assert gpu.value["count"] == 8
    assert "8 x NVIDIA H100 80GB HBM3" in gpu.detail
    assert "700 W" in gpu.detail
    assert gpu.value["gpus"][0]["memory_gib"] == 80.0
    assert inv.cuda_driver == "12.4"

    cc = check_compute_capability(inv)
    assert (cc.status, cc.value["bf16"], cc.value["fp8"]) == ("pass", True, True)
    link = check_nvlink(inv)
    assert link.status == "pass"
    assert link.value["active_links"] == dict.fromkeys(range(8), 18)
    assert check_versions(inv, CUDA_TORCH).status == "pass"


def test_compute_capability_limits() -> None:
    a100 = check_compute_capability(_inventory(FakeGpu(name="A100", cc=(8, 0))))
    assert (a100.status, a100.value["bf16"], a100.value["fp8"]) == ("pass", True, False)
    assert "FP8 needs sm 8.9+" in a100.detail
    l40s = check_compute_capability(_inventory(FakeGpu(name="L40S", cc=(8, 9))))
    assert l40s.value["fp8"] is True
    v100 = check_compute_capability(_inventory(FakeGpu(name="V100", cc=(7, 0))))
    assert (v100.status, v100.value["bf16"]) == ("warn", False)
    assert "fp32" in v100.detail


def test_gpus_without_nvlink_warn_and_one_gpu_is_skipped() -> None:
    pcie = _inventory(FakeGpu(nvlinks=0), FakeGpu(nvlinks=0))
    check = check_nvlink(pcie)
    assert check.status == "warn"
    assert "PCIe" in check.detail
    assert check_nvlink(_inventory(FakeGpu())).status == "skip"


def test_busy_or_mixed_gpus_warn() -> None:
    busy = check_gpus(_inventory(FakeGpu(), FakeGpu(used=20 * 2**30)))
    assert busy.status == "warn"
    assert "GPU 1: 20.0 GiB" in busy.detail
    mixed = check_gpus(_inventory(FakeGpu(), FakeGpu(name="NVIDIA A100-SXM4-80GB", cc=(8, 0))))
    assert mixed.status == "warn"
    assert "mixed models" in mixed.detail


def test_a_lost_gpu_fails() -> None:
    fake = FakeNvml(gpus=[FakeGpu(), FakeGpu(broken=True)])
    inv = read_gpus(fake)
    assert fake.shutdowns == 1
    check = check_gpus(inv)
    assert check.status == "fail"
    assert "GPU 1 of 2" in check.detail
    assert "dmesg" in check.detail
    assert check_nvlink(inv).status == "skip"


# --- versions ---------------------------------------------------------------------


def test_versions_without_gpu_are_skipped() -> None:
    inv = read_gpus(FakeNvml(init_error=FakeNVMLError("no driver")))
    cpu = TorchVersions(torch="2.13.0+cpu", cuda=None, nccl=None, cuda_available=False)
    check = check_versions(inv, cpu)
    assert check.status == "skip"
    assert "CPU build" in check.detail


def test_cpu_torch_on_gpu_host_fails() -> None:
    cpu = TorchVersions(torch="2.13.0+cpu", cuda=None, nccl=None, cuda_available=False)
    check = check_versions(_inventory(FakeGpu()), cpu)
    assert check.status == "fail"
    assert "download.pytorch.org" in check.detail


def test_driver_too_old_for_torch_cuda() -> None:
    major = check_versions(_inventory(FakeGpu(), cuda_driver=11080), CUDA_TORCH)
    assert major.status == "fail"
    assert "CUDA 11.8" in major.detail
    minor = check_versions(_inventory(FakeGpu(), cuda_driver=12020), CUDA_TORCH)
    assert minor.status == "warn"


def test_cuda_unavailable_in_torch_fails() -> None:
    hidden = TorchVersions(torch="2.13.0", cuda="12.4", nccl="2.21.5", cuda_available=False)
    check = check_versions(_inventory(FakeGpu()), hidden)
    assert check.status == "fail"
    assert "CUDA_VISIBLE_DEVICES" in check.detail


def test_read_torch_versions_here() -> None:
    tv = doctor.read_torch_versions()
    assert tv.torch
    if tv.cuda is None:
        assert tv.nccl is None


# --- nccl-tests -------------------------------------------------------------------

ALL_REDUCE_OUTPUT = """\
# nThread 1 nGpus 2 minBytes 8388608 maxBytes 1073741824 step: 2(factor) warmup iters: 5
#       size         count      type   redop    root     time   algbw   busbw #wrong
     8388608       2097152     float     sum      -1    95.12   88.19   88.19      0
  1073741824     268435456     float     sum      -1   5642.1  190.31  190.31      0
# Out of bounds values : 0 OK
# Avg bus bandwidth    : 152.417
#
"""


def test_parse_all_reduce_busbw() -> None:
    assert parse_all_reduce_busbw(ALL_REDUCE_OUTPUT) == pytest.approx(152.417)
    assert parse_all_reduce_busbw("segfault") is None


def _fake_binary(folder: Path, script: str) -> Path:
    binary = folder / "all_reduce_perf"
    binary.write_text("#!/bin/sh\n" + script)
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    return folder


def test_nccl_tests_run_from_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "out.txt").write_text(ALL_REDUCE_OUTPUT)
    bin_dir = _fake_binary(tmp_path, f'echo "$@" > {tmp_path}/args\ncat {tmp_path}/out.txt\n')
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    check = check_nccl_tests(_inventory(FakeGpu(), FakeGpu()))
    assert check.status == "pass"
    assert check.value["busbw_gbps"] == pytest.approx(152.417)
    assert "-g 2" in (tmp_path / "args").read_text()


def test_nccl_tests_failure_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir = _fake_binary(tmp_path, 'echo "NCCL WARN Cuda failure" >&2\nexit 3\n')
    monkeypatch.setenv("PATH", str(bin_dir))
    check = check_nccl_tests(_inventory(FakeGpu(), FakeGpu()))
    assert check.status == "fail"
    assert "exited 3" in check.detail
    assert "Cuda failure" in check.detail


def test_nccl_tests_missing_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    check = check_nccl_tests(_inventory(FakeGpu(), FakeGpu()))
    assert check.status == "skip"
    assert "github.com/NVIDIA/nccl-tests" in check.detail


# --- storage ----------------------------------------------------------------------


def test_bandwidth_check_produces_numbers_and_leaves_nothing(tmp_path: Path) -> None:
    check = check_bandwidth("checkpoint", tmp_path, 2, must_write=True)
    assert check.status in ("pass", "warn")
    assert check.value["write_gbps"] > 0
    assert check.value["read_gbps"] > 0
    assert check.value["probe_mb"] == 2
    assert list(tmp_path.iterdir()) == []


def _unwritable_dir(tmp_path: Path) -> Path:
    if os.geteuid() != 0:
        folder = tmp_path / "ro"
        folder.mkdir()
        folder.chmod(0o500)
        return folder
    # root writes through permission bits; /proc refuses new files to anyone.
    if not Path("/proc/self").is_dir():
        pytest.skip("no /proc on this system")
    return Path("/proc")


def test_unwritable_folders(tmp_path: Path) -> None:
    folder = _unwritable_dir(tmp_path)
    assert check_bandwidth("data", folder, 1, must_write=False).status == "warn"
    assert check_bandwidth("checkpoint", folder, 1, must_write=True).status == "fail"


def test_same_device_warns(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "ckpt").mkdir()
    check = check_same_device(tmp_path / "data", tmp_path / "ckpt")
    assert check.status == "warn"
    assert "one device" in check.detail


def test_different_devices_are_ok(tmp_path: Path) -> None:
    other = Path("/dev/shm")
    if not other.is_dir() or other.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("no second device to compare with")
    assert check_same_device(tmp_path, other).status == "pass"


def _meminfo(tmp_path: Path, available_kb: int) -> Path:
    path = tmp_path / "meminfo"
    path.write_text(f"MemTotal: 99999999 kB\nMemFree: 1 kB\nMemAvailable: {available_kb} kB\n")
    return path


def test_page_cache_fit(tmp_path: Path) -> None:
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    (data / "a.bin").write_bytes(b"x" * 3000)
    (data / "sub" / "b.bin").write_bytes(b"x" * 1000)
    fits = check_page_cache(data, _meminfo(tmp_path, 1000))  # 1 MB available
    assert fits.status == "pass"
    assert fits.value["corpus_bytes"] == 4000
    assert "not the bottleneck" in fits.detail
    too_big = check_page_cache(data, _meminfo(tmp_path, 4))  # 4 KB available
    assert too_big.status == "warn"
    assert check_page_cache(data, tmp_path / "no-meminfo").status == "skip"


def test_free_disk(tmp_path: Path) -> None:
    assert check_free_disk("checkpoint", tmp_path, min_free_gb=0).status == "pass"
    low = check_free_disk("checkpoint", tmp_path, min_free_gb=1e12)
    assert low.status == "warn"
    assert "--checkpoint-dir" in low.detail
    assert low.value["free_gb"] > 0


def test_json_report_is_written(tmp_path: Path) -> None:
    checks = run_checks(tmp_path, tmp_path, probe_mb=1, nvml=FakeNvml(gpus=[FakeGpu()]))
    path = tmp_path / "reports" / "doctor.json"
    doctor.write_report(checks, path)
    written: dict[str, Any] = json.loads(path.read_text())
    assert [c["name"] for c in written["checks"]] == [c.name for c in checks]
    assert {"host", "created", "ok"} <= written.keys()
    assert {c["status"] for c in written["checks"]} <= {"pass", "warn", "fail", "skip"}
