"""``tuneloop deploy``: params.yaml's work pools and queues, then prefect.yaml's deployments,
on the Prefect server ``PREFECT_API_URL`` names (``tuneloop/orchestration/schedule.py``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path


def deploy_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tuneloop deploy",
        description="Create or update the work pools and queues in params.yaml's schedule "
        "group, then register prefect.yaml's deployments (`prefect deploy --all`) on the "
        "server PREFECT_API_URL names.",
    )
    parser.add_argument("--project", type=Path, default=Path(), help="project folder")
    return parser


def deploy_main(argv: Sequence[str] | None = None) -> int:
    """``tuneloop deploy``; flags it does not know go on to ``prefect deploy``."""
    args, extra = deploy_parser().parse_known_args(argv)
    from prefect.settings import PREFECT_API_URL

    from tuneloop.orchestration.schedule import deploy
    from tuneloop.params import ParamsError, load_params

    if not PREFECT_API_URL.value():  # the environment or the active Prefect profile
        print(
            "tuneloop deploy: set PREFECT_API_URL to your Prefect server, e.g. "
            "http://127.0.0.1:4200/api after `prefect server start`; deployments on a "
            "temporary server would vanish with it",
            file=sys.stderr,
        )
        return 2
    project = args.project.resolve()
    try:
        params = load_params(project / "params.yaml")
        return deploy(project, params, extra)
    except ParamsError as error:
        print(f"tuneloop deploy: {error}", file=sys.stderr)
        return 2
