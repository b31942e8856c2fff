"""The DVC stages, ``python -m stages.<name>`` as dvc.yaml runs them (each module says what).

DVC runs a stage's command in ``$SHELL -c`` with its own environment variables, so ``python``
is the first one on PATH, not the interpreter DVC itself runs under: ``.venv/bin/dvc repro``
without the environment activated starts the system's Python, which lacks the project's
libraries. Checked here, before any import fails half-way through a stage.
"""

import importlib.util
import os
import sys

_NEEDED = ("pydantic", "yaml", "orjson", "dvc", "mlflow")

if _missing := [name for name in _NEEDED if importlib.util.find_spec(name) is None]:
    raise SystemExit(
        f"stage {os.environ.get('DVC_STAGE') or '?'}: {sys.executable} is not the project's "
        f"environment (no {', '.join(_missing)}). dvc.yaml runs `python` from PATH: activate "
        "the environment first (`source .venv/bin/activate`, then `dvc repro`), or put it "
        "first on PATH (`PATH=$PWD/.venv/bin:$PATH .venv/bin/dvc repro`)."
    )

# Under the retrain flow, the stage runs in a fork of its warm interpreter, which has torch,
# transformers and MLflow imported already (tuneloop/orchestration/forkserver.py); this
# returns when there is none, or it cannot run the command exactly, and the stage runs here.
if os.environ.get("TUNELOOP_FORKSERVER"):
    from tuneloop.orchestration.forkserver import run_forked

    run_forked()
