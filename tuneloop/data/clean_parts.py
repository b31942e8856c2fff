"""Where each clean segment's lines lie in clean's output files: written by clean, read by pack.

clean writes train.jsonl and val.jsonl segment after segment of the pool
(``tuneloop.data.clean_cache``), so a file is a run of parts, each the kept lines of one segment.
Beside each file it writes
their sizes (``train.parts.json``: the segment, its lines and bytes, in file order). pack packs
part by part and keeps each part's bins by the part's bytes, so a month that only adds a batch
re-packs only that batch's lines (``tuneloop.data.pack_cache``).

The sizes are only a hint of where to cut: pack keys every part by its own bytes, and a
parts file that does not add up to the file it describes (a file edited by hand, or written
by anything but clean) is ignored, and the file read as one part.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from tuneloop.io import read_json, write_json

log = logging.getLogger(__name__)

SUFFIX = ".parts.json"


@dataclass(frozen=True)
class Part:
    name: str  # the clean segment the lines came from
    lines: int
    size: int  # bytes


def path_for(data_file: Path) -> Path:
    """``train.jsonl`` -> ``train.parts.json``."""
    return data_file.with_name(data_file.stem + SUFFIX)


def write(data_file: Path, parts: list[Part]) -> None:
    write_json(
        path_for(data_file),
        {"parts": [{"name": p.name, "lines": p.lines, "bytes": p.size} for p in parts]},
    )


def read(data_file: Path, data: bytes) -> list[Part]:
    """The parts of ``data`` (the bytes of ``data_file``), or one part of all of it when its
    parts file is missing or does not describe these bytes."""
    whole = [Part("whole", data.count(b"\n"), len(data))]
    path = path_for(data_file)
    if not path.exists():
        return whole
    try:
        parts = [
            Part(str(p["name"]), int(p["lines"]), int(p["bytes"])) for p in read_json(path)["parts"]
        ]
    except (OSError, ValueError, KeyError, TypeError) as error:
        log.warning("%s is unreadable (%s): %s read as one part", path, error, data_file.name)
        return whole
    end = 0
    for part in parts:
        end += part.size
        # Each part is whole lines: it ends at a newline, or at the end of the file.
        whole_lines = not part.size or end == len(data) or data[end - 1 : end] == b"\n"
        if part.size < 0 or part.lines < 0 or end > len(data) or not whole_lines:
            break
    else:
        if end == len(data):
            return parts
    log.warning(
        "%s does not describe the %d bytes of %s: read as one part", path, len(data), data_file.name
    )
    return whole
