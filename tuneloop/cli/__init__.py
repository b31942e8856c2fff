"""The ``tuneloop`` command line: the top of the project, one module per command group.

=============  ==============================================================================
module         commands
=============  ==============================================================================
``loop``       seed-demo, retrain, demo: the monthly loop, once or for N months
``rollout``    register-base, approve, reject, release, serve, wait, traffic, rollback, status:
               a model in front of users, and the people who decide how far
``host``       watch, calibrate, doctor: the training machine and its GPUs
``deploy``     deploy: the work pools, queues and deployments on a Prefect server
``review``     review create, serve, invite, revoke, results: the blind review by people
=============  ==============================================================================

Each group imports what a command needs inside the command, so ``tuneloop --help`` starts in
a fraction of a second. Nothing in ``tuneloop/``, ``stages/``, ``flows/`` or ``serving/``
imports this package (tests/test_layout.py).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from tuneloop.cli import deploy, host, loop, review, rollout

# Commands that parse their own flags (and, for `watch`, a command after `--`):
# argparse's REMAINDER cannot pass `watch --deadlock-after 10 -- cmd` through.
PASSTHROUGH: dict[str, tuple[Callable[[Sequence[str]], int], str]] = {
    "watch": (
        host.watch_main,
        "run a training command under the power/heartbeat watchdog: watch [opts] -- CMD",
    ),
    "calibrate": (
        host.calibrate_main,
        "measure this GPU model's power bands and write its calibration file",
    ),
    "doctor": (
        host.doctor_main,
        "check a host before the first run: GPUs, NVLink, versions, storage, disk",
    ),
    "deploy": (
        deploy.deploy_main,
        "work pools and queues from params.yaml, then prefect.yaml's deployments",
    ),
}
# Their parsers, for `--help`-free readers: the generated CLI reference (tuneloop/cli/reference.py).
PASSTHROUGH_PARSERS: dict[str, Callable[[], argparse.ArgumentParser]] = {
    "watch": host.watch_parser,
    "calibrate": host.calibrate_parser,
    "doctor": host.doctor_parser,
    "deploy": deploy.deploy_parser,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tuneloop", description="Continuous fine-tuning: badcases in, a judged model out."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    loop.add_commands(commands)
    rollout.add_commands(commands)
    review.add_commands(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] and argv[0] in PASSTHROUGH:
        run, _ = PASSTHROUGH[argv[0]]
        return int(run(argv[1:]))
    parser = build_parser()
    parser.epilog = "more: " + "; ".join(f"{k}: {text}" for k, (_, text) in PASSTHROUGH.items())
    args = parser.parse_args(argv)
    try:
        return int(args.run(args))
    except ValueError as error:
        # A wrong params.yaml is the operator's to fix: its message names the key, a
        # traceback would bury it. Imported here: `tuneloop --help` stays light.
        from tuneloop.params import ParamsError

        if not isinstance(error, ParamsError):
            raise
        print(f"tuneloop {args.command}: {error}", file=sys.stderr)
        return 2
