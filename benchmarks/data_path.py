"""Benchmark the data path (ingest, clean, pack) month over month, and write RESULTS.md's rows.

Two tables, each stage a subprocess (``python -m stages.<name>`` in a project folder, as
``dvc repro`` runs it), timed from process start to exit, with the peak resident memory of
its largest process (``wait4``'s ``ru_maxrss``: clean's worker processes are measured, not
added up):

- **scaling**: the demo generator's month at 1x, 4x, 16x, 64x its lines (1x = 16,000 support
  chats + 600 badcases, the month the data-path goals were set on; 64x is a million lines),
  each into a fresh pool;
- **incremental**: one fixed new month of ``--month-lines`` lines on top of a pool that
  already holds about 0, 250k and 1M earlier records (built by ingesting earlier demo
  months, then one clean and pack, untimed, as last month's run would have left them, and
  written to disk before the month starts, as weeks would have), twice: training from the
  base (every batch in full, as a first month or ``train.init_from: base``), and from last
  month's champion, which trained on the earlier batches (``init.json`` names them, as the
  ``init`` stage writes it from the registry): those at ``clean.replay_fraction``, the loop's
  month from the second on.

Before each timed month the stages' code is imported once, untimed (``warm_code``), so that
no month pays for the copy made just before it having pushed the libraries out of the page
cache. Also the import time of each data stage in a fresh interpreter, and whether it imported
torch, transformers or MLflow. The load average is printed before and after; run it on a
quiet machine. The base model is built once (``stages.base``) and copied into each project.

    python benchmarks/data_path.py                        # the full tables (long)
    python benchmarks/data_path.py --scales 1 4 --history 0 20000 --month-lines 10000
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tuneloop.data.metrics import CleanMetrics, IngestMetrics  # noqa: E402
from tuneloop.data.records import pool_batches  # noqa: E402
from tuneloop.demo import domain  # noqa: E402
from tuneloop.io import read_model, write_json  # noqa: E402
from tuneloop.params import load_params  # noqa: E402
from tuneloop.tracking import init_from  # noqa: E402

STAGES = ("ingest", "clean", "pack")
# 1x: a month of the demo generator's lines at the size the goals were set on (fixed here, not
# params.yaml's demo.n_support, which sizes the demo's own months).
SUPPORT_1X, BADCASES_1X = 16_000, 600
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
SECTION = "## data path"


@dataclass(frozen=True)
class StageRun:
    seconds: float
    peak_mb: float


def run_stage(project: Path, stage: str) -> StageRun:
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    log = project / f"{stage}.log"
    start = time.perf_counter()
    with log.open("ab") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", f"stages.{stage}"], cwd=project, env=env, stdout=out, stderr=out
        )
        _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - start
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode:
        raise SystemExit(f"stage {stage} failed in {project}; its output: {log}")
    return StageRun(seconds, usage.ru_maxrss / 1024)


# What the data stages import in their run (the stages' own imports, then MLflow's store and the
# tokenizer's library as they start their work).
_STAGE_CODE = (
    *(f"stages.{stage}" for stage in STAGES),
    "tuneloop.tracking.runs",
    "mlflow.store.tracking.sqlalchemy_store",
    "tokenizers",
)


def warm_code() -> None:
    """Read the stages' code into the page cache once before a month (not timed).

    A month starts right after its project is made: copying a project of a million records
    (3 GB) pushes the libraries out of the page cache, and the month on the larger history
    would pay for that in its imports alone (0.5-1 s a stage here), not for its history."""
    code = f"import {', '.join(_STAGE_CODE)}"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True)


def ingested(project: Path) -> IngestMetrics:
    return read_model(project / "metrics/ingest.json", IngestMetrics)


def cleaned(project: Path) -> CleanMetrics:
    return read_model(project / "metrics/clean.json", CleanMetrics)


def template(folder: Path) -> Path:
    """A project with params, eval suites, the built base model and an MLflow store."""
    folder.mkdir(parents=True)
    shutil.copy(ROOT / "params.yaml", folder / "params.yaml")
    shutil.copytree(ROOT / "eval", folder / "eval")
    run_stage(folder, "base")
    run_stage(folder, "task_names")  # what ingest routes by: the same every month
    return folder


def fresh_project(template_folder: Path, parent: Path, name: str) -> Path:
    project = parent / name
    shutil.copytree(template_folder, project)
    return project


def seed_month(project: Path, seed: int, lines: int) -> None:
    """A month of demo lines in incoming/, replacing the month before (ingest read it)."""
    incoming = project / "data" / "badcases" / "incoming"
    shutil.rmtree(incoming, ignore_errors=True)
    badcases = round(lines * BADCASES_1X / (SUPPORT_1X + BADCASES_1X))
    domain.seed_incoming(incoming, seed, lines - badcases, badcases)


def scaling_row(template_folder: Path, parent: Path, scale: int) -> dict[str, Any]:
    project = fresh_project(template_folder, parent, f"scale-{scale}")
    lines = scale * (SUPPORT_1X + BADCASES_1X)
    seed_month(project, 0, lines)
    warm_code()
    runs = {stage: run_stage(project, stage) for stage in STAGES}
    row = {
        "scale": scale,
        "lines": ingested(project).lines,
        "pool": ingested(project).pool_records,
        "train": cleaned(project).train,
        "runs": runs,
    }
    shutil.rmtree(project)
    return row


STARTS = ("base", "champion")


def start_from_champion(project: Path) -> None:
    """``init.json`` as the init stage writes it when last month's champion trained on every
    batch now in the pool (no weights: the data stages read only which batches it saw)."""
    params = load_params(project / "params.yaml")
    seen = tuple(batch.stem for batch in pool_batches(project / params.paths.pool))
    start = init_from.Start(
        "champion", "benchmark: last month's champion", model="benchmark", version="1", batches=seen
    )
    folder = project / params.paths.init
    folder.mkdir(parents=True, exist_ok=True)
    write_json(folder / init_from.INIT_FILE, asdict(start))


def incremental_rows(
    template_folder: Path, parent: Path, history: int, new_lines: int, history_month: int
) -> list[dict[str, Any]]:
    project = fresh_project(template_folder, parent, f"history-{history}")
    pooled, seed = 0, 1000
    while pooled < history:
        seed_month(project, seed, history_month)
        run_stage(project, "ingest")
        pooled = ingested(project).pool_records
        seed += 1
    if pooled:
        run_stage(project, "clean")
        run_stage(project, "pack")
    rows = []
    for start in STARTS:
        month = parent / f"history-{history}-{start}"
        shutil.copytree(project, month, symlinks=True)
        if start == "champion":
            start_from_champion(month)
        seed_month(month, 7, new_lines)
        # Last month's run ended weeks ago: nothing of it is still being written out.
        os.sync()
        warm_code()
        runs = {stage: run_stage(month, stage) for stage in STAGES}
        rows.append(
            {
                "history": pooled,
                "start": start,
                "lines": ingested(month).lines,
                "new": ingested(month).accepted,
                "pool": ingested(month).pool_records,
                "train": cleaned(month).train,
                "runs": runs,
            }
        )
        shutil.rmtree(month)
    shutil.rmtree(project)
    return rows


def import_check(stage: str) -> tuple[float, list[str]]:
    code = (
        f"import sys, time; t = time.perf_counter(); import stages.{stage}; "
        "print(time.perf_counter() - t); "
        "print(','.join(m for m in ('torch', 'transformers', 'mlflow') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split("\n")
    return float(out[0]), [m for m in out[1].split(",") if m]


def stage_cells(runs: dict[str, StageRun]) -> str:
    total = sum(r.seconds for r in runs.values())
    cells = [f"{runs[s].seconds:.1f} s / {runs[s].peak_mb:,.0f} MB" for s in STAGES]
    return " | ".join([*cells, f"{total:.1f} s"])


def report(
    args: argparse.Namespace,
    load: tuple[tuple[float, ...], tuple[float, ...]],
    imports: dict[str, tuple[float, list[str]]],
    scaling: list[dict[str, Any]],
    incremental: list[dict[str, Any]],
    seconds: float,
) -> str:
    head = " | ".join(f"{s} (time / peak RSS)" for s in STAGES)
    lines = [
        SECTION,
        "",
        f"`python benchmarks/data_path.py --scales {' '.join(map(str, args.scales))} "
        f"--history {' '.join(map(str, args.history))} --month-lines {args.month_lines}`, "
        f"{dt.date.today().isoformat()}, {platform.node() or 'this machine'}: "
        f"{os.cpu_count()} CPU cores, CPython {platform.python_version()}; load average "
        f"{load[0][0]:.2f} / {load[0][1]:.2f} / {load[0][2]:.2f} before, "
        f"{load[1][0]:.2f} / {load[1][1]:.2f} / {load[1][2]:.2f} after "
        f"({seconds / 60:.0f} minutes in all). Each stage is a subprocess timed from start to "
        "exit (interpreter start, imports and the MLflow run included); peak RSS is its "
        "largest process.",
        "",
        "Imports of each data stage in a fresh interpreter:",
        "",
        "| stage | import (s) | torch / transformers / MLflow imported |",
        "|---|---|---|",
        *(f"| {s} | {imports[s][0]:.2f} | {', '.join(imports[s][1]) or 'none'} |" for s in STAGES),
        "",
        "Scaling: the demo month at k x its lines, each into a fresh pool.",
        "",
        f"| scale | lines in | pool records | train samples | {head} | total |",
        "|---|---|---|---|---|---|---|---|",
        *(
            f"| {r['scale']}x | {r['lines']:,} | {r['pool']:,} | {r['train']:,} | "
            f"{stage_cells(r['runs'])} |"
            for r in scaling
        ),
        "",
        f"Incremental: a new month of {args.month_lines:,} lines on top of earlier records "
        "(their clean cache and packed data as the month before left them). Training from "
        "the base, every batch is in the training set; from last month's champion (which "
        "trained on the earlier batches), those are replayed at `clean.replay_fraction`.",
        "",
        f"| start | earlier records | lines in | new records | pool records | train samples "
        f"| {head} | total |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *(
            f"| {r['start']} | {r['history']:,} | {r['lines']:,} | {r['new']:,} | "
            f"{r['pool']:,} | {r['train']:,} | {stage_cells(r['runs'])} |"
            for r in sorted(incremental, key=lambda r: STARTS.index(r["start"]))
        ),
    ]
    for start in STARTS:
        rows = [r for r in incremental if r["start"] == start]
        if len(rows) > 1:
            first = sum(r.seconds for r in rows[0]["runs"].values())
            last = sum(r.seconds for r in rows[-1]["runs"].values())
            lines += [
                "",
                f"From the {start}: month time with {rows[-1]['history']:,} earlier records / "
                f"with {rows[0]['history']:,}: {last / first:.2f}x (goal: at most 1.5x).",
            ]
    return "\n".join(lines) + "\n"


def write_section(text: str, path: Path) -> None:
    """Replace the data-path section of RESULTS.md (or append it)."""
    current = path.read_text(encoding="utf-8")
    if SECTION in current:
        start = current.index(SECTION)
        following = current.find("\n## ", start + len(SECTION))
        rest = current[following + 1 :] if following >= 0 else ""
        current = current[:start] + text + ("\n" + rest if rest else "")
    else:
        current = current.rstrip("\n") + "\n\n" + text
    path.write_text(current, encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--scales", type=int, nargs="*", default=[1, 4, 16, 64], help="months of k x demo lines"
    )
    parser.add_argument(
        "--history",
        type=int,
        nargs="*",
        default=[0, 250_000, 1_000_000],
        help="earlier pool records under the incremental month",
    )
    parser.add_argument("--month-lines", type=int, default=50_000, help="the incremental month")
    parser.add_argument(
        "--history-month", type=int, default=500_000, help="lines per month building the history"
    )
    parser.add_argument("--results", type=Path, default=RESULTS, help="the file to write into")
    parser.add_argument("--no-results", action="store_true", help="print only")
    args = parser.parse_args()

    load_before = os.getloadavg()
    start = time.perf_counter()
    print(f"load average before: {load_before}", flush=True)
    imports = {stage: import_check(stage) for stage in STAGES}
    with tempfile.TemporaryDirectory(prefix="data-path-") as tmp:
        parent = Path(tmp)
        template_folder = template(parent / "template")
        scaling = []
        for scale in args.scales:
            scaling.append(scaling_row(template_folder, parent, scale))
            print(f"scale {scale}x: {scaling[-1]}", flush=True)
        incremental = []
        for history in args.history:
            rows = incremental_rows(
                template_folder, parent, history, args.month_lines, args.history_month
            )
            for row in rows:
                print(f"history {history}, from the {row['start']}: {row}", flush=True)
            incremental += rows
    load_after = os.getloadavg()
    print(f"load average after: {load_after}")
    text = report(
        args, (load_before, load_after), imports, scaling, incremental, time.perf_counter() - start
    )
    print(text)
    if not args.no_results:
        write_section(text, args.results)
        print(f"written to {args.results}")


if __name__ == "__main__":
    main()
