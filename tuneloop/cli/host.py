"""``tuneloop doctor``, ``calibrate`` and ``watch``: the training machine and its GPUs.

Each parses its own flags (``tuneloop watch`` takes the training command after ``--``), so the
top-level parser hands them the rest of the line untouched.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path


def _log_to_stderr() -> None:
    import logging

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


def doctor_parser() -> argparse.ArgumentParser:
    from tuneloop.preflight.doctor import DEFAULT_PROBE_MB

    parser = argparse.ArgumentParser(
        prog="tuneloop doctor",
        description="Check a server before the first training run: GPUs, drivers, "
        "interconnect, storage bandwidth and space. Exits 1 if a check fails.",
    )
    parser.add_argument(
        "--data-dir", type=Path, default=Path("data"), help="folder holding the training corpus"
    )
    parser.add_argument(
        "--checkpoint-dir",
        type=Path,
        default=Path("checkpoints"),
        help="folder checkpoints are written to",
    )
    parser.add_argument(
        "--json", type=Path, default=Path("reports/doctor.json"), help="where to write the report"
    )
    parser.add_argument(
        "--probe-mb",
        type=int,
        default=DEFAULT_PROBE_MB,
        help="size of the temp file used to measure each folder's read and write bandwidth "
        "(MB); larger is more accurate on storage with big write caches",
    )
    return parser


def doctor_main(argv: Sequence[str] | None = None) -> int:
    """``tuneloop doctor``: a table of checks, the same as JSON; exits 1 only on a failure."""
    from tuneloop.preflight.doctor import format_table, run_checks, write_report

    parser = doctor_parser()
    args = parser.parse_args(argv)
    if args.probe_mb < 1:
        parser.error("--probe-mb must be at least 1")

    checks = run_checks(args.data_dir, args.checkpoint_dir, probe_mb=args.probe_mb)
    print(format_table(checks))
    write_report(checks, args.json)
    print(f"\nreport written to {args.json}")
    return 1 if any(c.status == "fail" for c in checks) else 0


def calibrate_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tuneloop calibrate",
        description="Measure this GPU model's power in each state (matmul burn, all-reduce "
        "loop, idle with a context, starved loader, checkpoint save) and write its "
        "calibration file. Needs a CUDA GPU; run it on an otherwise idle card. The bands "
        "shipped for H100, H200, B200 and B300 are estimates from public figures, not "
        "measurements; a file written here is marked measured (estimated: false), and the "
        "watchdog reports calibration_source 'measured' only when every GPU has one. This "
        "command and the NVML sampling it uses have not yet run on a GPU (the arithmetic is "
        "tested on synthetic samples): compare the bands it writes with nvidia-smi readings "
        "before trusting them.",
    )
    parser.add_argument("--gpu", type=int, default=0, help="NVML index of the card (default 0)")
    parser.add_argument(
        "--seconds", type=float, default=30.0, help="seconds per workload (default %(default)s)"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="file to write (default calibrations/<gpu name>.json)",
    )
    return parser


def calibrate_main(argv: Sequence[str] | None = None) -> int:
    """``tuneloop calibrate``; returns the exit code."""
    from tuneloop.telemetry.calibrate import calibrate
    from tuneloop.telemetry.calibration import CalibrationError, save_calibration

    args = calibrate_parser().parse_args(list(argv or []))
    _log_to_stderr()
    try:
        calibration = calibrate(args.gpu, args.seconds)
    except CalibrationError as err:
        print(f"tuneloop calibrate: {err}", file=sys.stderr)
        return 2
    out = args.out or Path("calibrations") / f"{calibration.gpu_model}.json"
    save_calibration(out, calibration)
    print(
        f"wrote {out}: stall below x={calibration.stall_below}, compute from "
        f"x={calibration.compute_above}, busy at {calibration.busy_util} % utilisation"
    )
    return 0


def watch_parser() -> argparse.ArgumentParser:
    from tuneloop.telemetry.watch import WATCHDOG_EXIT_CODE
    from tuneloop.telemetry.watchdog import WatchConfig

    defaults = WatchConfig()
    parser = argparse.ArgumentParser(
        prog="tuneloop watch",
        usage="tuneloop watch [options] -- COMMAND [ARG ...]",
        description=(
            "Run a training command under the power watchdog: on a deadlock (no step, low "
            "GPU power, outside a checkpoint/eval section) dump stacks, end the job, mark "
            "the MLflow run failed and alert. Exits with the command's code, or "
            f"{WATCHDOG_EXIT_CODE} when the watchdog ended it."
        ),
    )
    parser.add_argument(
        "--deadlock-after",
        type=float,
        default=defaults.deadlock_after_s,
        metavar="S",
        help="seconds without a step at low power (outside sections) that make a deadlock "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--window",
        type=float,
        default=defaults.window_s,
        metavar="S",
        help="classification window, >= 5 s (default %(default)s)",
    )
    parser.add_argument(
        "--hz",
        type=float,
        default=defaults.hz,
        help="samples per second, 1..10 (default %(default)s)",
    )
    parser.add_argument(
        "--kill-grace",
        type=float,
        default=defaults.kill_grace_s,
        metavar="S",
        help="seconds between SIGTERM and SIGKILL (default %(default)s)",
    )
    parser.add_argument(
        "--section-max-factor",
        type=float,
        default=defaults.section_max_factor,
        metavar="N",
        help="a checkpoint/eval section longer than N x "
        "--deadlock-after is a hang too (default %(default)s)",
    )
    parser.add_argument(
        "--out-dir",
        type=Path,
        default=None,
        help="where trace, stacks, plot and watch.json go (default watch/<UTC time>)",
    )
    _add_peer_arguments(parser)
    parser.add_argument(
        "--heartbeat",
        type=Path,
        default=None,
        metavar="FILE",
        help="heartbeat file, passed to the job as $TUNELOOP_HEARTBEAT "
        "(default OUT_DIR/heartbeat.json)",
    )
    parser.add_argument(
        "--trace-out",
        type=Path,
        default=None,
        metavar="CSV",
        help="telemetry trace (default OUT_DIR/trace.csv)",
    )
    parser.add_argument(
        "--replay",
        type=Path,
        default=None,
        metavar="CSV",
        help="take GPU readings from a recorded trace, paced in real time",
    )
    parser.add_argument(
        "--heartbeat-only", action="store_true", help="ignore GPU telemetry even where NVML works"
    )
    parser.add_argument(
        "--gpus", default=None, metavar="I,J", help="NVML indices of the job's GPUs (default all)"
    )
    parser.add_argument(
        "--calibration",
        type=Path,
        default=None,
        metavar="JSON",
        help="calibration file for these GPUs (default: matched by GPU name)",
    )
    _add_report_arguments(parser)
    return parser


def _add_report_arguments(parser: argparse.ArgumentParser) -> None:
    """Where a hang is reported: the job's MLflow run, and a person's alert."""
    from tuneloop.telemetry.watch import ALERT_COMMAND_ENV, ALERT_WEBHOOK_ENV, RUN_ID_ENV

    parser.add_argument(
        "--mlflow-run-id",
        default=None,
        help=f"run to mark FAILED on a deadlock (default ${RUN_ID_ENV})",
    )
    parser.add_argument(
        "--mlflow-tracking-uri",
        default=None,
        help="MLflow store (default $MLFLOW_TRACKING_URI, else ./mlflow.db)",
    )
    parser.add_argument(
        "--alert-webhook",
        default=os.environ.get(ALERT_WEBHOOK_ENV),
        metavar="URL",
        help=f"POST a JSON alert here (default ${ALERT_WEBHOOK_ENV})",
    )
    parser.add_argument(
        "--alert-command",
        default=os.environ.get(ALERT_COMMAND_ENV),
        metavar="CMD",
        help="run this shell command on an alert, with "
        f"$TUNELOOP_ALERT_REASON set (default ${ALERT_COMMAND_ENV})",
    )


def _add_peer_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of a job across nodes, one watchdog on each."""
    parser.add_argument(
        "--peers",
        type=Path,
        default=None,
        metavar="DIR",
        help="the job's folder on storage every node shares, one per run of the job: a hang "
        "found by any node's watchdog has every node dump its ranks' stacks before the ranks "
        "are ended (the cluster launchers pass it)",
    )
    parser.add_argument(
        "--node",
        default=None,
        metavar="NAME",
        help="this node's name among --peers (default: the host name; give it when nodes "
        "share a host name)",
    )


def watch_main(argv: Sequence[str] | None = None) -> int:
    """``tuneloop watch``; returns the exit code."""
    from tuneloop.telemetry.actions import AlertHook
    from tuneloop.telemetry.watch import WatchError, WatchOptions, new_out_dir, watch
    from tuneloop.telemetry.watchdog import WatchConfig

    argv = list(argv or [])
    parser = watch_parser()
    if "--" in argv:
        split = argv.index("--")
        own, command = argv[:split], argv[split + 1 :]
    else:
        own, command = argv, []
    args = parser.parse_args(own)
    if not command:
        parser.error("give the training command after --, e.g. tuneloop watch -- torchrun train.py")
    _log_to_stderr()
    try:
        config = WatchConfig(
            deadlock_after_s=args.deadlock_after,
            window_s=args.window,
            hz=args.hz,
            kill_grace_s=args.kill_grace,
            section_max_factor=args.section_max_factor,
        )
    except ValueError as err:
        parser.error(str(err))
    gpus = None
    if args.gpus:
        try:
            gpus = tuple(int(i) for i in args.gpus.split(","))
        except ValueError:
            parser.error(f"--gpus {args.gpus!r}: give NVML indices like 0,1,2")
    options = WatchOptions(
        command=tuple(command),
        out_dir=args.out_dir or new_out_dir(Path("watch")),
        config=config,
        heartbeat=args.heartbeat,
        trace_out=args.trace_out,
        replay=args.replay,
        heartbeat_only=args.heartbeat_only,
        gpus=gpus,
        calibration=args.calibration,
        mlflow_run_id=args.mlflow_run_id,
        tracking_uri=args.mlflow_tracking_uri,
        alert=AlertHook(args.alert_webhook or None, args.alert_command or None),
        peers=args.peers,
        **({"node": args.node} if args.node else {}),
    )
    try:
        outcome = watch(options)
    except WatchError as err:
        print(f"tuneloop watch: {err}", file=sys.stderr)
        return 127  # the shell's "command not found"
    if outcome.alarm is not None:
        print(f"tuneloop watch: {outcome.alarm.reason}")
        for name, result in outcome.actions.items():
            print(f"  {name}: {result}")
    print(f"tuneloop watch: exit {outcome.exit_code}; details in {outcome.manifest}")
    return outcome.exit_code
