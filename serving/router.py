"""The canary router: one OpenAI-compatible endpoint in front of a champion and a challenger.

Clients call ``/v1/chat/completions``, ``/v1/completions`` and ``/v1/models``
here exactly as they would call vLLM or ``transformers serve``; each request goes
to one arm, chosen by weight and sticky per user, and streaming responses are
relayed chunk by chunk as they arrive.

Why tuneloop has its own router instead of an off-the-shelf proxy (Envoy or an
Nginx split, a Gateway API weighted route, a generic LLM gateway):

- **per-arm model-name rewrite**: each arm serves its own backend model name
  (vLLM's ``--served-model-name``, a LoRA adapter name) while clients keep
  asking for one public name; the rewrite happens inside the JSON body, which
  L4/L7 traffic splitters do not touch;
- **stickiness by user**: a stable hash of ``X-User-Id`` or the body's ``user``
  picks one of 100 buckets, so a user sees one model through a canary step, and
  ramping the weight only ever adds users to the challenger;
- **feedback capture**: every response carries a signed ``X-Request-Id`` that
  says which arm and model version served it, so ``/v1/feedback`` (from
  authenticated producers only) turns a flagged response into a scrubbed
  badcase record charged to the right model and written where next month's
  ingest reads it (``serving.attribution``, ``serving.badcases``);
- per-arm errors, latency, time to first token and badcases for the release
  controller's analysis, per request and read by cursor (``serving.samples``),
  and a rollback that holds from the very next request;
- **shadow traffic**: during a release's shadow step a share of the champion's
  requests is mirrored to the challenger in the background; the user gets the
  champion's answer only, and both answers are kept side by side for the
  analysis to score (``/admin/shadow``);
- **guards of its own** while a release holds its lease (``/admin/lease``): a
  lease that is not renewed, or a burst of challenger errors, sets the
  challenger to 0 % in the router itself, with no controller alive to ask.

Every body is size-capped before it is read and parsed defensively
(``serving.limits``): bad input is a 4xx with the reason, never a 500.

The parts, each a FastAPI router sharing one ``RouterState`` through the app
(``serving.router_state``), assembled by ``serving.app``: ``serving.proxy`` (the OpenAI
endpoints and the shadow mirror), ``serving.feedback`` (``/v1/feedback``),
``serving.control`` (``/admin/*``, ``/metrics``), with ``serving.auth`` for the tokens and
``serving.limits`` for bodies and rates.

Run it with ``python -m serving.router --config router.yaml``; tests and the benchmark
build it with ``serving.app.create_app(config)``. A config with ``tasks:`` runs one router
for several tasks on one base, each task's router at ``/tasks/<task>`` (``serving.tasks``).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from serving.tasks import create_any_app, load_config


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m serving.router",
        description="Run the canary router in front of the champion and challenger backends.",
    )
    parser.add_argument("--config", type=Path, required=True, help="router config YAML")
    parser.add_argument("--host", default="127.0.0.1", help="listen address")
    parser.add_argument("--port", type=int, default=8080, help="listen port")
    parser.add_argument("--log-level", default="info", help="logging level of the router")
    parser.add_argument(
        "--access-log", action="store_true", help="log every request (costs latency)"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    args = _parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    config = load_config(args.config)
    uvicorn.run(
        create_any_app(config),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=args.access_log,
    )


if __name__ == "__main__":
    main()
