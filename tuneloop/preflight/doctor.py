"""``tuneloop doctor``: what to check on a new server before the first training run.

Each check returns a ``Check`` (``tuneloop/judge/verdict.py``, the type and
statuses preflight and the gate use too) whose detail says what was found and,
unless it passed, what to do about it. ``fail`` means training will not work as
configured; ``warn`` means it will work but slower or riskier than it should;
``skip`` means the check does not apply here (no GPU, tool not installed)
and says why. The command (``tuneloop/cli/host.py``) prints a table, writes the
same as JSON (``write_report``) and exits 1 only when something failed.

NVML is the only GPU source: it answers without creating a CUDA context, so
the doctor can run beside a training job. Everything NVML-dependent goes
through ``read_gpus(nvml)``; tests pass a fake module only because this
machine has no GPU, and the checks after it are the same functions either way.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import pynvml

from tuneloop.io import write_json
from tuneloop.judge.verdict import Check, counts

log = logging.getLogger(__name__)


# bf16 arrived with Ampere (8.0), FP8 tensor cores with Ada/Hopper (8.9).
BF16_MIN_CC = (8, 0)
FP8_MIN_CC = (8, 9)
# Recommended storage bandwidth: even at 3 GB/s a 100 GB checkpoint keeps
# every GPU waiting for half a minute.
RECOMMENDED_GBPS = 3.0
DEFAULT_PROBE_MB = 256
# Leave room for the training process, dataloader workers and pinned buffers.
PAGE_CACHE_SHARE = 0.8
# Free space below which a folder gets a warning, and why it needs that much.
MIN_FREE_GB = {
    "checkpoint": (100.0, "a full checkpoint of an 8B model with optimizer state is ~100 GB"),
    "data": (10.0, "the pipeline writes cleaned and packed copies of the corpus here"),
}
# Another process holding more than this on a GPU will cost the run memory.
BUSY_GPU_GIB = 1.0
NCCL_TESTS_TIMEOUT_S = 600
NCCL_TESTS_INSTALL = (
    "build nccl-tests: git clone https://github.com/NVIDIA/nccl-tests && "
    "make -C nccl-tests MPI=0 CUDA_HOME=/usr/local/cuda, then put nccl-tests/build on PATH"
)
_PROBE_CHUNK = 8 * 2**20


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    memory_gib: float
    memory_used_gib: float
    power_cap_w: float | None
    compute_capability: tuple[int, int]
    nvlinks_active: int


@dataclass(frozen=True)
class GpuInventory:
    """What NVML said.

    ``error``: why there are no GPUs to check (no driver, no devices): a
    reason to skip. ``fault``: NVML started but then failed on a device (a
    GPU fallen off the bus, an Xid): a reason to fail.
    """

    gpus: list[Gpu]
    driver: str | None = None
    cuda_driver: str | None = None
    error: str | None = None
    fault: str | None = None


@dataclass(frozen=True)
class TorchVersions:
    torch: str
    cuda: str | None
    nccl: str | None
    cuda_available: bool


class Nvml(Protocol):
    """The part of ``pynvml`` the doctor uses (so a test can stand in for it)."""

    @property
    def NVMLError(self) -> type[Exception]: ...
    @property
    def NVML_FEATURE_ENABLED(self) -> int: ...
    @property
    def NVML_NVLINK_MAX_LINKS(self) -> int: ...

    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None: ...
    def nvmlSystemGetDriverVersion(self) -> str: ...
    def nvmlSystemGetCudaDriverVersion(self) -> int: ...
    def nvmlDeviceGetCount(self) -> int: ...
    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any: ...
    def nvmlDeviceGetName(self, handle: Any) -> str: ...
    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any: ...
    def nvmlDeviceGetEnforcedPowerLimit(self, handle: Any) -> int: ...
    def nvmlDeviceGetCudaComputeCapability(self, handle: Any) -> tuple[int, int]: ...
    def nvmlDeviceGetNvLinkState(self, handle: Any, link: int) -> int: ...


# --- reading the machine ----------------------------------------------------------


def read_gpus(nvml: Nvml = pynvml) -> GpuInventory:
    """Inventory the GPUs through NVML; on a machine without them, say why in ``error``."""
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        return GpuInventory(gpus=[], error=f"NVML could not start: {exc}")
    try:
        driver = _text(nvml.nvmlSystemGetDriverVersion())
        try:
            cuda = nvml.nvmlSystemGetCudaDriverVersion()  # e.g. 12040 for 12.4
            cuda_driver: str | None = f"{cuda // 1000}.{cuda % 1000 // 10}"
        except nvml.NVMLError:
            cuda_driver = None  # drivers older than CUDA 10 do not say
        count = nvml.nvmlDeviceGetCount()
        gpus = []
        for i in range(count):
            try:
                gpus.append(_read_gpu(nvml, i))
            except nvml.NVMLError as exc:
                return GpuInventory(
                    gpus=[],
                    driver=driver,
                    cuda_driver=cuda_driver,
                    fault=f"NVML failed on GPU {i} of {count}: {exc}",
                )
    finally:
        nvml.nvmlShutdown()
    return GpuInventory(
        gpus=gpus,
        driver=driver,
        cuda_driver=cuda_driver,
        error=None if gpus else f"NVML reports 0 devices (driver {driver})",
    )


def _read_gpu(nvml: Nvml, index: int) -> Gpu:
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    memory = nvml.nvmlDeviceGetMemoryInfo(handle)
    try:
        power_cap_w: float | None = nvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1000
    except nvml.NVMLError:
        power_cap_w = None  # not exposed on some boards and in some VMs
    major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
    return Gpu(
        index=index,
        name=_text(nvml.nvmlDeviceGetName(handle)),
        memory_gib=round(memory.total / 2**30, 1),
        memory_used_gib=round(memory.used / 2**30, 1),
        power_cap_w=power_cap_w,
        compute_capability=(major, minor),
        nvlinks_active=_active_nvlinks(nvml, handle),
    )


def _active_nvlinks(nvml: Nvml, handle: Any) -> int:
    active = 0
    for link in range(nvml.NVML_NVLINK_MAX_LINKS):
        try:
            state = nvml.nvmlDeviceGetNvLinkState(handle, link)
        except nvml.NVMLError:
            # NotSupported on boards without NVLink; InvalidArgument past the
            # last link this board has. Either way there is no link here.
            continue
        active += state == nvml.NVML_FEATURE_ENABLED
    return active


def _text(value: str | bytes) -> str:
    # Older pynvml releases return bytes.
    return value.decode() if isinstance(value, bytes) else value


def read_torch_versions() -> TorchVersions:
    # Imported here, not with the module: preflight imports this module, and torch's import
    # (seconds) is paid only when the machine is probed.
    import torch

    nccl: str | None = None
    if torch.version.cuda is not None:
        # CPU builds lack the NCCL binding altogether (AttributeError).
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except (AttributeError, RuntimeError) as exc:
            log.debug("no NCCL version from torch: %s", exc)
    return TorchVersions(
        torch=torch.__version__,
        cuda=torch.version.cuda,
        nccl=nccl,
        cuda_available=torch.cuda.is_available(),
    )


# --- GPU checks -------------------------------------------------------------------


def _no_gpu(name: str, inv: GpuInventory) -> Check:
    if inv.fault:
        return Check(name, "skip", "GPU inventory failed (see check 'gpu')")
    return Check(name, "skip", f"no GPU found ({inv.error})")


def check_gpus(inv: GpuInventory) -> Check:
    if inv.fault:
        return Check(
            "gpu",
            "fail",
            f"{inv.fault}: run `nvidia-smi` and look for Xid errors in "
            "`dmesg`; a GPU that fell off the bus needs a reset or a reboot",
            {"driver": inv.driver},
        )
    if not inv.gpus:
        return _no_gpu("gpu", inv)
    names = sorted({g.name for g in inv.gpus})
    value = {
        "count": len(inv.gpus),
        "driver": inv.driver,
        "cuda_driver": inv.cuda_driver,
        "gpus": [dataclasses.asdict(g) for g in inv.gpus],
    }
    memory = "/".join(f"{m:g}" for m in sorted({g.memory_gib for g in inv.gpus}))
    caps = {g.power_cap_w for g in inv.gpus}
    cap_text = "/".join(f"{c:.0f} W" for c in sorted(c for c in caps if c is not None))
    summary = (
        f"{len(inv.gpus)} x {' + '.join(names)}, {memory} GiB, "
        f"power cap {cap_text or 'not reported'}, driver {inv.driver}"
    )
    busy = [g for g in inv.gpus if g.memory_used_gib > BUSY_GPU_GIB]
    if busy:
        used = ", ".join(f"GPU {g.index}: {g.memory_used_gib} GiB" for g in busy)
        return Check(
            "gpu",
            "warn",
            f"{summary}; memory already in use ({used}): stop those processes "
            "or pick other GPUs with CUDA_VISIBLE_DEVICES",
            value,
        )
    if len(names) > 1:
        return Check(
            "gpu",
            "warn",
            f"{summary}; mixed models: data-parallel runs at the slowest one's "
            "pace, restrict to one model with CUDA_VISIBLE_DEVICES",
            value,
        )
    if len(caps) > 1:
        return Check(
            "gpu", "warn", f"{summary}; power caps differ: check `nvidia-smi -q -d POWER`", value
        )
    return Check("gpu", "pass", summary, value)


def check_compute_capability(inv: GpuInventory) -> Check:
    if not inv.gpus:
        return _no_gpu("compute_capability", inv)
    lowest = min(g.compute_capability for g in inv.gpus)
    cc = f"{lowest[0]}.{lowest[1]}"
    value = {"compute_capability": cc, "bf16": lowest >= BF16_MIN_CC, "fp8": lowest >= FP8_MIN_CC}
    if lowest >= FP8_MIN_CC:
        return Check("compute_capability", "pass", f"sm {cc}: bf16 and FP8 available", value)
    if lowest >= BF16_MIN_CC:
        return Check(
            "compute_capability", "pass", f"sm {cc}: bf16 available; FP8 needs sm 8.9+", value
        )
    return Check(
        "compute_capability",
        "warn",
        f"sm {cc}: no bf16 (needs sm 8.0+), so training falls back to fp32, "
        "at half the speed and twice the memory; no FP8 either (needs sm 8.9+)",
        value,
    )


def check_nvlink(inv: GpuInventory) -> Check:
    if not inv.gpus:
        return _no_gpu("nvlink", inv)
    links = {g.index: g.nvlinks_active for g in inv.gpus}
    value = {"active_links": links}
    if len(inv.gpus) == 1:
        return Check("nvlink", "skip", "one GPU: nothing to link", value)
    without = [i for i, n in links.items() if n == 0]
    if without:
        return Check(
            "nvlink",
            "warn",
            f"GPUs {without} have no active NVLink: collectives go over PCIe, so prefer "
            "data parallel over tensor parallel; `nvidia-smi nvlink -s` shows link state "
            "(inactive links on an NVLink board: check fabric manager)",
            value,
        )
    return Check("nvlink", "pass", f"active links per GPU: {links}", value)


def _major_minor(version: str) -> tuple[int, int]:
    major, minor = [*version.split("."), "0"][:2]
    return int(major), int(minor)


def check_versions(inv: GpuInventory, tv: TorchVersions) -> Check:
    value = dataclasses.asdict(tv) | {"driver": inv.driver, "cuda_driver": inv.cuda_driver}
    build = f"torch {tv.torch} (CUDA {tv.cuda}, NCCL {tv.nccl})"
    if not inv.gpus:
        kind = "a CPU build" if tv.cuda is None else f"built for CUDA {tv.cuda}"
        return Check(
            "versions",
            "skip",
            f"no GPU found: torch {tv.torch} is {kind}; CUDA not checked",
            value,
        )
    if tv.cuda is None:
        return Check(
            "versions",
            "fail",
            f"torch {tv.torch} is a CPU build on a GPU host: install a CUDA build, e.g. "
            "`pip install torch --index-url https://download.pytorch.org/whl/cu128`",
            value,
        )
    if inv.cuda_driver is not None:
        driver, wanted = _major_minor(inv.cuda_driver), _major_minor(tv.cuda)
        if driver[0] < wanted[0]:
            return Check(
                "versions",
                "fail",
                f"{build} needs a driver for CUDA {wanted[0]}.x, driver {inv.driver} supports "
                f"CUDA {inv.cuda_driver}: upgrade the driver or install torch for CUDA "
                f"{driver[0]}.x",
                value,
            )
        if driver < wanted:
            return Check(
                "versions",
                "warn",
                f"{build} is newer than the driver's CUDA {inv.cuda_driver}; it runs on minor "
                "version compatibility, but PTX JIT kernels (Triton, torch.compile) may fail: "
                "upgrade the driver",
                value,
            )
    if not tv.cuda_available:
        return Check(
            "versions",
            "fail",
            f"{build} but torch.cuda.is_available() is False: check CUDA_VISIBLE_DEVICES and "
            "that /dev/nvidia* are visible (containers need --gpus all)",
            value,
        )
    if tv.nccl is None and len(inv.gpus) > 1:
        return Check(
            "versions",
            "warn",
            f"{build}: torch has no NCCL, so multi-GPU training cannot "
            "use it; install the official CUDA wheel",
            value,
        )
    return Check(
        "versions", "pass", f"{build}, driver {inv.driver} (CUDA {inv.cuda_driver})", value
    )


_BUSBW_RE = re.compile(r"#\s*Avg bus bandwidth\s*:\s*([0-9.]+)")


def parse_all_reduce_busbw(output: str) -> float | None:
    """The 'Avg bus bandwidth' (GB/s) that nccl-tests prints at the end, if any."""
    match = _BUSBW_RE.search(output)
    return float(match.group(1)) if match else None


def check_nccl_tests(inv: GpuInventory) -> Check:
    binary = shutil.which("all_reduce_perf")
    if binary is None:
        return Check(
            "nccl_all_reduce", "skip", f"all_reduce_perf not on PATH: {NCCL_TESTS_INSTALL}"
        )
    if not inv.gpus:
        return _no_gpu("nccl_all_reduce", inv)
    if len(inv.gpus) == 1:
        return Check("nccl_all_reduce", "skip", "one GPU: nothing to all-reduce")
    cmd = [binary, "-b", "8M", "-e", "1G", "-f", "2", "-g", str(len(inv.gpus))]
    log.info("running %s", " ".join(cmd))
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=NCCL_TESTS_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired:
        return Check(
            "nccl_all_reduce",
            "fail",
            f"`{' '.join(cmd)}` did not finish in "
            f"{NCCL_TESTS_TIMEOUT_S}s: a hung collective; rerun with NCCL_DEBUG=INFO",
            {"command": cmd},
        )
    busbw = parse_all_reduce_busbw(proc.stdout)
    value = {"command": cmd, "busbw_gbps": busbw, "returncode": proc.returncode}
    if proc.returncode != 0 or busbw is None:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return Check(
            "nccl_all_reduce",
            "fail",
            f"`{' '.join(cmd)}` exited {proc.returncode}: "
            f"{' | '.join(tail)}; rerun with NCCL_DEBUG=INFO",
            value,
        )
    return Check(
        "nccl_all_reduce",
        "pass",
        f"all-reduce bus bandwidth {busbw:.1f} GB/s over "
        f"{len(inv.gpus)} GPUs (8 MB to 1 GB messages)",
        value,
    )


# --- storage checks ---------------------------------------------------------------


def measure_bandwidth(folder: Path, size_mb: int) -> tuple[float, float]:
    """Write+fsync then read back a ``size_mb`` MB temp file in ``folder``; (write, read) GB/s.

    Random bytes, so compressing or deduplicating filesystems cannot cheat.
    Between write and read the file's pages are dropped from the page cache
    (fsync first: only clean pages can be dropped), else the read would time
    RAM. The file is always removed.
    """
    if size_mb < 1:
        raise ValueError(f"probe size must be at least 1 MB, got {size_mb}")
    chunk = os.urandom(min(_PROBE_CHUNK, size_mb * 2**20))
    total = size_mb * 2**20
    fd, name = tempfile.mkstemp(prefix=".tuneloop-doctor-", dir=folder)
    try:
        start = time.perf_counter()
        written = 0
        while written < total:
            written += os.write(fd, chunk[: total - written])
        os.fsync(fd)
        write_s = time.perf_counter() - start
        if hasattr(os, "posix_fadvise"):  # Linux; elsewhere the read may hit the cache
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.lseek(fd, 0, os.SEEK_SET)
        start = time.perf_counter()
        while os.read(fd, _PROBE_CHUNK):
            pass
        read_s = time.perf_counter() - start
    finally:
        os.close(fd)
        os.unlink(name)
    gb = total / 1e9
    return gb / max(write_s, 1e-9), gb / max(read_s, 1e-9)


def check_bandwidth(role: str, folder: Path, size_mb: int, *, must_write: bool) -> Check:
    name = f"bandwidth_{role}"
    if not folder.is_dir():
        return Check(name, "fail", f"{folder} is not a folder: create it or pass --{role}-dir")
    try:
        write_gbps, read_gbps = measure_bandwidth(folder, size_mb)
    except OSError as exc:
        detail = f"probe file in {folder} failed: {exc}"
        if must_write:
            return Check(
                name, "fail", f"{detail}; training must write here", {"folder": str(folder)}
            )
        return Check(name, "warn", f"{detail}; bandwidth not measured", {"folder": str(folder)})
    value = {
        "folder": str(folder),
        "probe_mb": size_mb,
        "write_gbps": round(write_gbps, 3),
        "read_gbps": round(read_gbps, 3),
    }
    measured = f"{folder}: write {write_gbps:.2f} GB/s, read {read_gbps:.2f} GB/s ({size_mb} MB)"
    slow = [
        kind
        for kind, gbps in (("write", write_gbps), ("read", read_gbps))
        if gbps < RECOMMENDED_GBPS
    ]
    if slow:
        return Check(
            name,
            "warn",
            f"{measured}; {' and '.join(slow)} below the recommended "
            f"{RECOMMENDED_GBPS:g} GB/s: use local NVMe or a faster share",
            value,
        )
    return Check(name, "pass", measured, value)


def check_same_device(data_dir: Path, checkpoint_dir: Path) -> Check:
    try:
        data_dev, ckpt_dev = os.stat(data_dir).st_dev, os.stat(checkpoint_dir).st_dev
    except OSError as exc:
        return Check("same_device", "skip", f"cannot stat ({exc}); see the bandwidth checks")
    value = {"data_dev": data_dev, "checkpoint_dev": ckpt_dev}
    if data_dev == ckpt_dev:
        return Check(
            "same_device",
            "warn",
            f"{data_dir} and {checkpoint_dir} are on one device: "
            "checkpoint saves (tens of GB at once) will stall data reads; put checkpoints "
            "on another disk",
            value,
        )
    return Check("same_device", "pass", "data and checkpoints are on different devices", value)


def folder_bytes(folder: Path) -> int:
    """Total size of the files under ``folder``; symlinks are not followed."""
    total = 0
    for root, _dirs, files in os.walk(folder):
        for f in files:
            try:
                st = os.lstat(os.path.join(root, f))
            except FileNotFoundError:
                continue  # removed while we walked
            total += st.st_size
    return total


def mem_available_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    try:
        text = meminfo.read_text()
    except OSError:
        return None
    match = re.search(r"^MemAvailable:\s+(\d+) kB", text, re.MULTILINE)
    return int(match.group(1)) * 1024 if match else None


def check_page_cache(data_dir: Path, meminfo: Path = Path("/proc/meminfo")) -> Check:
    available = mem_available_bytes(meminfo)
    if available is None:
        return Check("page_cache", "skip", f"no MemAvailable in {meminfo} (not Linux?)")
    if not data_dir.is_dir():
        return Check("page_cache", "skip", f"{data_dir} is not a folder")
    corpus = folder_bytes(data_dir)
    value = {"corpus_bytes": corpus, "mem_available_bytes": available}
    sizes = f"corpus {corpus / 1e9:.2f} GB, {available / 1e9:.1f} GB RAM available"
    if corpus <= PAGE_CACHE_SHARE * available:
        return Check(
            "page_cache",
            "pass",
            f"{sizes}: the corpus fits in the page cache, so after the "
            "first epoch reads come from RAM and storage (NFS) is not the bottleneck",
            value,
        )
    return Check(
        "page_cache",
        "warn",
        f"{sizes}: the corpus does not fit in the page cache, so every "
        "epoch reads it from storage; copy it to local NVMe or check the bandwidth above",
        value,
    )


def check_free_disk(role: str, folder: Path, min_free_gb: float | None = None) -> Check:
    name = f"free_disk_{role}"
    default_gb, why = MIN_FREE_GB[role]
    min_gb = default_gb if min_free_gb is None else min_free_gb
    try:
        usage = shutil.disk_usage(folder)
    except OSError as exc:
        return Check(name, "skip", f"cannot read disk usage ({exc}); see bandwidth_{role}")
    free_gb = usage.free / 1e9
    value = {
        "folder": str(folder),
        "free_gb": round(free_gb, 1),
        "total_gb": round(usage.total / 1e9, 1),
        "min_free_gb": min_gb,
    }
    if free_gb < min_gb:
        return Check(
            name,
            "warn",
            f"{folder}: {free_gb:.0f} GB free, below {min_gb:.0f} GB ({why}): free space "
            "or point --" + role + "-dir elsewhere",
            value,
        )
    return Check(name, "pass", f"{folder}: {free_gb:.0f} GB free", value)


# --- the report -------------------------------------------------------------------


def run_checks(
    data_dir: Path,
    checkpoint_dir: Path,
    *,
    probe_mb: int = DEFAULT_PROBE_MB,
    nvml: Nvml = pynvml,
) -> list[Check]:
    """Run every check, in the order a person would read them."""
    inv = read_gpus(nvml)
    return [
        check_gpus(inv),
        check_compute_capability(inv),
        check_nvlink(inv),
        check_versions(inv, read_torch_versions()),
        check_nccl_tests(inv),
        check_bandwidth("data", data_dir, probe_mb, must_write=False),
        check_bandwidth("checkpoint", checkpoint_dir, probe_mb, must_write=True),
        check_same_device(data_dir, checkpoint_dir),
        check_page_cache(data_dir),
        check_free_disk("data", data_dir),
        check_free_disk("checkpoint", checkpoint_dir),
    ]


def format_table(checks: Sequence[Check]) -> str:
    width = max(len(c.name) for c in checks)
    header = f"{'check':<{width}}  {'status':<7}  detail"
    lines = [header, "-" * len(header)]
    lines += [f"{c.name:<{width}}  {c.status:<7}  {c.detail}" for c in checks]
    lines.append("")
    lines.append(", ".join(f"{n} {s}" for s, n in status_counts(checks).items()))
    skipped = [c.name for c in checks if c.status == "skip"]
    if skipped:
        lines.append(f"skipped: {', '.join(skipped)}")
    return "\n".join(lines)


def status_counts(checks: Sequence[Check]) -> dict[str, int]:
    """How many checks ended in each status. The doctor and preflight measure, they never
    estimate, so none of their checks is ``inconclusive``: that count is left out of their
    tables and reports unless a check ever says it."""
    found = counts(checks)
    if not found["inconclusive"]:
        del found["inconclusive"]
    return found


def write_report(checks: Sequence[Check], path: Path) -> None:
    """Write the checks as JSON (atomically, like every artifact here)."""
    write_json(
        path,
        {
            "host": socket.gethostname(),
            "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "ok": not any(c.status == "fail" for c in checks),
            "checks": [dataclasses.asdict(c) for c in checks],
        },
    )
