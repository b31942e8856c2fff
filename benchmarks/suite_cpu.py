"""Where the test suite's CPU goes: each kind of process it starts, and how much was imports.

Runs ``make test`` (with ``PYTEST_ARGS`` if arguments are given) with
``benchmarks/suite_cpu_hook`` first on every process's path.
Every Python process of the run (the test workers, ``dvc``, each stage, the serving backends,
the servers) then records its CPU time and the CPU time of its top-level imports when it
exits or gets SIGTERM (``suite_cpu_hook/sitecustomize.py``). Processes ended by SIGKILL and
programs that are not Python (git, PostgreSQL, the compiler) are only in the total: the CPU
time of every process the run started and reaped (``getrusage``).

What the hook changes in the processes it measures: SIGTERM runs a Python handler (it records,
then dies by SIGTERM as before), so a process stuck in a C call (a hung collective) ends only
at the SIGKILL that follows.

Printed: the load average before and after (run it on a quiet machine), the wall time, the
CPU time, how busy the cores were, the table by kind of process, and what a wall time of
``--budget-min`` minutes would allow on these cores.

    python benchmarks/suite_cpu.py                          # the whole suite (as long as make test)
    python benchmarks/suite_cpu.py -- -p no:cacheprovider tests/test_stages.py
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
HOOK = Path(__file__).resolve().parent / "suite_cpu_hook"


def kind_of(argv: list[str]) -> str:
    """A process's kind from its command line: the module, the script, or what a ``-c`` is."""
    args = argv[1:]
    if "-m" in args and args.index("-m") + 1 < len(args):
        return args[args.index("-m") + 1]
    if "-c" in args:
        code = args[args.index("-c") + 1] if args.index("-c") + 1 < len(args) else ""
        if "sys.stdin.readline" in code:
            return "pytest-xdist worker (the tests themselves)"
        if "multiprocessing" in code:
            return "multiprocessing worker"
        return "python -c"
    for arg in args:
        if not arg.startswith("-"):
            name = Path(arg).name
            rest = args[args.index(arg) + 1 :]
            # console scripts: `transformers serve`, `dvc exp`: the subcommand says what it is
            if rest and not rest[0].startswith("-") and "/" not in rest[0]:
                return f"{name} {rest[0]}"
            return name
    return Path(argv[0]).name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-min", type=float, default=8.0)
    parser.add_argument("--keep", type=Path, help="copy the processes' records (JSON lines) here")
    parser.add_argument("pytest_args", nargs="*", help="after --: pytest's arguments")
    options = parser.parse_args(argv)
    cores = os.cpu_count() or 1
    pytest_args = options.pytest_args or ["-p", "no:cacheprovider"]

    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "processes.jsonl"
        env = os.environ | {
            "PYTHONPATH": os.pathsep.join(
                [str(HOOK), *filter(None, [os.environ.get("PYTHONPATH")])]
            ),
            "SUITE_CPU_LOG": str(log),
        }
        print(f"load average before: {os.getloadavg()}", flush=True)
        start = time.perf_counter()
        command = ["make", "test", f"PYTEST_ARGS={' '.join(pytest_args)}"]
        done = subprocess.run(command, cwd=ROOT, env=env, check=False)
        wall = time.perf_counter() - start
        print(f"load average after:  {os.getloadavg()}")
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        lines = log.read_text().splitlines() if log.exists() else []
        if options.keep:
            options.keep.write_text("\n".join(lines) + "\n")
    records = [json.loads(line) for line in lines]

    total = usage.ru_utime + usage.ru_stime
    by_kind: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for record in records:
        row = by_kind[kind_of(record["argv"])]
        row[0] += 1
        row[1] += record["cpu"]
        row[2] += record["import_cpu"]
    python_cpu = sum(row[1] for row in by_kind.values())
    import_cpu = sum(row[2] for row in by_kind.values())

    print(f"\n{' '.join(command)}: exit {done.returncode}, {wall:.0f} s on {cores} cores")
    print(f"CPU: {total:.0f} s in all, the cores {100 * total / (wall * cores):.0f} % busy")
    print(f"  Python processes that recorded: {python_cpu:.0f} s, imports {import_cpu:.0f} s of it")
    print(f"  the rest (SIGKILLed, git, PostgreSQL, compilers): {total - python_cpu:.0f} s")
    print("\n| processes | kind | CPU (s) | of it imports (s) |")
    print("|---:|---|---:|---:|")
    for name, (n, cpu, imports) in sorted(by_kind.items(), key=lambda kv: -kv[1][1]):
        if cpu >= 1.0:
            print(f"| {n:.0f} | {name} | {cpu:.1f} | {imports:.1f} ({100 * imports / cpu:.0f} %) |")
    print_by_module(records)
    budget = options.budget_min * 60 * cores
    print(
        f"\n{options.budget_min:g} minutes on {cores} cores is {budget:.0f} CPU s with every core"
        f" busy throughout; this run used {total:.0f}, {total - import_cpu:.0f} without imports."
    )
    return done.returncode


def print_by_module(records: list[dict[str, Any]]) -> None:
    """The test modules whose processes (not the workers) used the most CPU: a child inherits
    ``PYTEST_CURRENT_TEST`` from the test, or the fixture, that started it."""
    by_module: dict[str, float] = defaultdict(float)
    for record in records:
        test = record.get("test") or ""
        if test and "pytest-xdist worker" not in kind_of(record["argv"]):
            by_module[test.split("::")[0]] += record["cpu"]
    print("\n| test module | CPU of the processes it started (s) |")
    print("|---|---:|")
    for module, cpu in sorted(by_module.items(), key=lambda kv: -kv[1])[:25]:
        print(f"| {module} | {cpu:.1f} |")


if __name__ == "__main__":
    sys.exit(main())
