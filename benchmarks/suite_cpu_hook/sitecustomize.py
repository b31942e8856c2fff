"""Process accounting for ``benchmarks/suite_cpu.py``: loaded by every Python process it starts.

Records the process's command line, CPU time and the CPU time of its top-level imports (what
``-X importtime`` sums: the hook wraps importlib's ``_find_and_load``, which ``import`` and
``importlib.import_module`` both go through) as one JSON line in ``$SUITE_CPU_LOG``, at exit
or on SIGTERM (then it dies by SIGTERM as before).
"""

import atexit
import json
import os
import signal
import sys
import time
from importlib import _bootstrap  # type: ignore[attr-defined]

_find_and_load = _bootstrap._find_and_load
_imports = {"depth": 0, "cpu": 0.0}
_written = []


def _timed_find_and_load(name, import_):  # type: ignore[no-untyped-def]
    if _imports["depth"]:  # a nested import: its time is in the top-level one's
        return _find_and_load(name, import_)
    _imports["depth"] = 1
    start = time.process_time()
    try:
        return _find_and_load(name, import_)
    finally:
        _imports["depth"] = 0
        _imports["cpu"] += time.process_time() - start


def _record(how: str = "exit") -> None:
    if _written:
        return
    _written.append(how)
    times = os.times()
    line = {
        "pid": os.getpid(),
        "how": how,
        "argv": [arg[:120] for arg in sys.orig_argv[:4]],
        "cpu": round(times.user + times.system, 3),
        "import_cpu": round(_imports["cpu"], 3),
        # pytest sets it in its worker's environment for each test: the children inherit it
        "test": os.environ.get("PYTEST_CURRENT_TEST", ""),
    }
    try:
        with open(os.environ["SUITE_CPU_LOG"], "a") as log:
            log.write(json.dumps(line) + "\n")
    except (KeyError, OSError):
        pass


def _on_sigterm(signum, frame):  # type: ignore[no-untyped-def]
    _record("sigterm")
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


_bootstrap._find_and_load = _timed_find_and_load
atexit.register(_record)
if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
    signal.signal(signal.SIGTERM, _on_sigterm)
