"""tuneloop: a continuous fine-tuning pipeline for LLMs.

Importing the package turns off the telemetry that MLflow, DVC and Prefect
would otherwise send (it fails on an offline machine and leaks usage data).
A user's own setting of these variables wins.
"""

import os

for _name, _value in {
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DVC_NO_ANALYTICS": "1",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "TOKENIZERS_PARALLELISM": "false",
}.items():
    os.environ.setdefault(_name, _value)

__version__ = "0.1.0"
