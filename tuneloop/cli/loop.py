"""``tuneloop seed-demo``, ``retrain`` and ``demo``: the monthly loop, once or for N months."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tuneloop.orchestration.flow_results import PipelineRun, TasksRun


def _seed_demo(args: argparse.Namespace) -> int:
    from tuneloop.demo import domain
    from tuneloop.params import load_params

    params = load_params()
    # A month of another size (the tutorial's few hundred lines): the demo group's, resized.
    sizes = {"n_support": args.chats, "n_badcases": args.badcases}
    given = {name: size for name, size in sizes.items() if size is not None}
    demo = type(params.demo).model_validate(params.demo.model_dump() | given)  # checked again
    written = domain.seed_month(params.paths.incoming, demo)
    for path in written:
        print(f"wrote {path}")
    if not written:
        print(f"{params.paths.incoming} already holds the demo files; nothing written")
    return 0


def _print_pipeline(result: PipelineRun) -> None:
    """One task's pipeline: its data, training, scores, gate and registration."""
    from tuneloop.demo.report import losses, metric_figures

    data, train, decision = result.data, result.train, result.decision
    print(
        f"data   {data.lines} lines in -> {data.accepted} accepted, "
        f"{data.quarantined} quarantined, {data.duplicates} duplicates; "
        f"pool {data.pool} records -> {data.train} train / {data.val} val, "
        f"{data.dpo_pairs} DPO pairs"
    )
    speed = train.tokens_per_second
    print(f"train  {losses(train)}" + (f", {speed:.0f} tokens/s" if speed is not None else ""))
    for model, suites in result.eval.items():
        for suite, metrics in suites.items():
            print(f"eval   {model:<14} {suite}: {metric_figures(metrics)}")
    print(f"gate   {decision.verdict.upper()}")
    for reason in decision.reasons:
        print(f"       {reason}")
    registration = result.registration
    if registration is not None and registration.registered:
        print(
            f"model  registered {registration.name} v{registration.version} "
            f"as {registration.alias!r}"
        )
    else:
        print("model  not registered:")
        for reason in [] if registration is None else registration.reasons:
            print(f"       {reason}")


def _print_summary(result: TasksRun) -> None:
    print("\n=== tuneloop retrain: summary ===")
    for task, outcome in result.tasks.items():
        print(f"\n--- task {task}")
        if outcome.outcome == "unchanged":
            print(f"not run: {outcome.reason}; its champion stays")
        elif outcome.outcome == "failed":
            print(f"FAILED: {outcome.error}")
        else:
            _print_pipeline(outcome)
    # Every task, what ran and what did not move (tasks_report).
    print()
    print(result.report_text)
    print(
        "\nSee it:\n"
        "  MLflow  .venv/bin/mlflow ui --backend-store-uri sqlite:///mlflow.db --port 5000"
        "   -> http://127.0.0.1:5000 (experiment 'tuneloop': a run per retrain, in it the shared"
        " stages' runs and a run per task, in that a run per stage)\n"
        "  Prefect .venv/bin/prefect server start"
        "   -> http://127.0.0.1:4200 (run with PREFECT_API_URL=http://127.0.0.1:4200/api"
        " to keep flow runs there)\n"
        "  DVC     .venv/bin/dvc dag; .venv/bin/dvc metrics show; .venv/bin/dvc repro"
    )


def _retrain(args: argparse.Namespace) -> int:
    from flows.retrain import TasksFailed, retrain

    failed = None
    try:
        result = retrain(repo=Path(args.repo), tasks=args.task)
    except TasksFailed as error:  # the other tasks ran: their summary first
        failed, result = error, error.result
    _print_summary(result)
    if args.json:
        print(result.model_dump_json(indent=2))
    if failed is not None:
        print(f"\ntuneloop retrain: {failed}", file=sys.stderr)
        return 1
    return 0


def _demo(args: argparse.Namespace) -> int:
    from tuneloop.demo import workspace

    model = workspace.MODELS[args.model]
    months = args.months or model.months
    if model.config is not None and not args.here:
        # Its own checkout, where its params.yaml is; the demo runs there as the tiny one runs
        # here, on that checkout's code (python -m from its folder imports the checkout's).
        repo = workspace.prepare(Path(args.repo), args.model)
        print(f"The {args.model} demo runs in {repo}: {model.config} over params.yaml", flush=True)
        command = [sys.executable, "-m", "tuneloop.cli", "demo", "--repo", ".", "--here"]
        command += ["--months", str(months), "--approval-wait", str(args.approval_wait)]
        command += ["--release-overrides", str(model.config), *(["--json"] if args.json else [])]
        return subprocess.run(command, cwd=repo, check=False).returncode

    from flows import demo
    from tuneloop.demo.report import format_loop
    from tuneloop.params import load_params

    history = demo.run(Path(args.repo), months, args.approval_wait, Path(args.release_overrides))
    params = load_params(Path(args.repo) / "params.yaml")
    models = tuple(params.for_task(t).tracking.registered_model for t in params.task_names())
    print(format_loop(history, models))
    if args.json:
        print(
            json.dumps([m.model_dump(mode="json") for m in history], indent=2, ensure_ascii=False)
        )
    return 0


def add_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from tuneloop.demo.workspace import MODELS  # a table and yaml: light enough for --help

    seed = commands.add_parser(
        "seed-demo", help="write the demo month of support chats and badcases into incoming/"
    )
    seed.add_argument(
        "--chats", type=int, help="support chats to write (default: params.yaml's demo.n_support)"
    )
    seed.add_argument(
        "--badcases", type=int, help="badcases to write (default: params.yaml's demo.n_badcases)"
    )
    seed.set_defaults(run=_seed_demo)

    retrain = commands.add_parser(
        "retrain", help="run the retrain flow (ingest -> evaluate) once, now: one month"
    )
    demo = commands.add_parser(
        "demo",
        help="the loop on a demo model: N months of seed -> retrain -> release -> feedback",
    )
    for command in (retrain, demo):
        command.add_argument("--repo", default=".", help="the tuneloop project folder")
        command.add_argument("--json", action="store_true", help="also print the full result")
    retrain.add_argument(
        "--task",
        action="append",
        help="run this task alone, whatever its data (repeat for "
        "several); the others keep their adapters and champions. Default: every task, as the "
        "monthly schedule runs them",
    )
    retrain.set_defaults(run=_retrain)
    demo.add_argument(
        "--model",
        choices=sorted(MODELS),
        default="tasks",
        help="; ".join(f"{name}: {m.about}" for name, m in sorted(MODELS.items()))
        + " (default tasks, as `make demo`). Any but tiny runs in demos/<model>/ on its config",
    )
    demo.add_argument(
        "--months",
        type=int,
        default=None,
        help="monthly cycles to run (default: "
        + ", ".join(f"{name} {m.months}" for name, m in sorted(MODELS.items()))
        + ")",
    )
    demo.add_argument(
        "--release-overrides",
        default="configs/demo.yaml",
        help="the release's overrides of params.yaml (its `release` group), relative to --repo "
        "(default configs/demo.yaml: a release in minutes)",
    )
    # The checkout's own run of a demo in demos/<model>/: on its params.yaml, where it is.
    demo.add_argument("--here", action="store_true", help=argparse.SUPPRESS)
    demo.add_argument(
        "--approval-wait",
        type=float,
        default=5.0,
        help="seconds a release waits for your `tuneloop approve` before the demo approves as "
        "demo-operator (default 5; to answer yourself, give it minutes)",
    )
    demo.set_defaults(run=_demo)
