# The image each node of a Kubernetes TrainJob runs (cluster.image, train.launcher: kubernetes):
# the project's Python environment. The project folder itself (code, data, models, checkpoints)
# is the shared volume the training runtime mounts at the path the flow runs in; the node's
# command cds there, as a Slurm node's task does (docs/how-to/cluster.md).
#
#   docker build -t registry.example.com/tuneloop:$(git rev-parse --short HEAD) .
FROM python:3.11-slim

# g++: DeepSpeed compiles its ops at the first launch; git: lineage reads the commit.
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ git \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/tuneloop
COPY pyproject.toml constraints.txt README.md ./
COPY tuneloop tuneloop
COPY stages stages
COPY flows flows
COPY serving serving
COPY configs configs
# torch first, pinned as everywhere else (PyPI's Linux wheel carries CUDA); then the rest
# under the same constraints, with the GPU extra (DeepSpeed, bitsandbytes).
RUN pip install --no-cache-dir "torch==2.13.0" \
    && pip install --no-cache-dir -c constraints.txt ".[gpu]"

ENV PYTHONUNBUFFERED=1 MLFLOW_DISABLE_TELEMETRY=true DVC_NO_ANALYTICS=1 HF_HUB_DISABLE_TELEMETRY=1
