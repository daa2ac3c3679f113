# trainflow: `make demo` runs a whole pipeline on bundled real data; `make test` runs the tests.
# Both set everything up first (a virtualenv in .venv from a lock file).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# GPU=1: also the `gpu` extra (dask-cuda, CuPy and their CUDA libraries) from requirements.lock;
# GPU=0: the CPU set, requirements-cpu.lock (no nvidia/cuda package). Default: 1 when
# nvidia-smi lists a GPU. `make setup GPU=0|1` forces either.
GPU ?= $(shell nvidia-smi -L 2>/dev/null | grep -q '^GPU' && echo 1 || echo 0)
LOCK := $(if $(filter 1,$(GPU)),requirements.lock,requirements-cpu.lock)
KIND := $(if $(filter 1,$(GPU)),gpu,cpu)
# CPU machines of our kind carry a local torch +cpu wheel; elsewhere torch comes from the index.
FIND_LINKS := $(if $(wildcard /opt/wheels/torch-*),--find-links /opt/wheels)
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export PYTHONUNBUFFERED := 1

.PHONY: setup demo test test-fast lint typecheck unit integration gpu bench lock clean docs group-seconds \
	stack-up stack-deploy stack-status stack-down

setup: $(VENV)/.installed-$(KIND)

# One stamp per kind: switching GPU=0/1 re-syncs (uv pip sync also removes what the lock lacks).
# --compile-bytecode: the packages' modules are compiled at install, as pip does by default
# (uv does not), so no process compiles them again where PYTHONDONTWRITEBYTECODE is set.
$(VENV)/.installed-$(KIND): $(LOCK) pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	PIP_CONFIG_FILE=/dev/null $(BIN)/python -m pip install -q --disable-pip-version-check uv==0.13.9
	$(BIN)/uv pip sync --compile-bytecode --python $(BIN)/python $(FIND_LINKS) $(LOCK)
	$(BIN)/uv pip install --python $(BIN)/python --no-deps -e .
	rm -f $(VENV)/.installed $(VENV)/.installed-cpu $(VENV)/.installed-gpu
	touch $@

demo: setup
	$(BIN)/trainflow run --preset demo

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

MYPY := $(BIN)/mypy trainflow tests bench examples

typecheck: setup
	$(MYPY)

unit: setup
	$(BIN)/python -m pytest tests/unit

integration: setup
	$(BIN)/python -m pytest tests/integration

bench: setup
	$(BIN)/python -m bench

gpu: setup
	$(BIN)/python -m pytest tests/gpu

# The suite waits on servers, Slurm and rank processes about half of its time: 4 workers keep
# both cores busy (each Slurm test file uses its worker's own 2-node dev Slurm, started for the
# run and stopped after it; TRAINFLOW_KEEP_SLURM=1 keeps them up for the next run), and mypy
# runs beside the tests, not before them.
TEST_WORKERS ?= 4
test: lint setup
	@$(MYPY) > .mypy.log 2>&1 & mypy=$$!; \
	$(BIN)/python -m pytest tests -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder \
	  --durations=30 --junitxml=test-artifacts/junit.xml; tests=$$?; \
	wait $$mypy; typed=$$?; echo "== mypy =="; cat .mypy.log; \
	test $$tests -eq 0 -a $$typed -eq 0

# After `make test` on a quiet machine: the test files' seconds (their order in the next run).
group-seconds: setup
	$(BIN)/python -m tests.group_seconds test-artifacts/junit.xml

# Everyday work: lint and the unit tests that start no service (no Prefect or MLflow server,
# no Slurm, no dask cluster, no rank processes).
test-fast: lint setup
	$(BIN)/python -m pytest tests/unit -m "not services" -n 2 -q

# The documentation site (docs/): warnings are errors, so a broken link or reference fails.
docs: setup
	$(BIN)/sphinx-build -W --keep-going -q -b html docs docs/_build/html
	@echo "docs: docs/_build/html/index.html"

# The local stack (Prefect server, a process worker, MLflow server): see docs/deployments.md.
stack-up: setup
	deploy/stack.sh up

stack-deploy: setup
	deploy/stack.sh deploy

stack-status: setup
	deploy/stack.sh status

stack-down: setup
	deploy/stack.sh down

# Two locks, each compiled with the other's pins as preferences so they agree on shared packages:
# requirements.lock (dev + gpu extras: what GPU nodes install, and what
# /work/shared/tools/gpu-node-wheels.sh reads) and requirements-cpu.lock (dev only: no CUDA).
lock: setup
	$(call compile_lock,requirements.lock,--extra dev --extra gpu,GPU nodes (make setup GPU=1))
	$(call compile_lock,requirements-cpu.lock,--extra dev,CPU machines (make setup GPU=0))

# $(1): output, $(2): extras, $(3): who installs it. The torch local tag is stripped so CPU
# machines take the +cpu wheel from /opt/wheels and GPU nodes the CUDA build.
define compile_lock
	$(BIN)/uv pip compile pyproject.toml $(2) $(FIND_LINKS) --python-version 3.11 \
	  $(if $(FIND_LINKS),--override <(echo torch==2.13.0+cpu)) --no-header -q -o $(1)
	sed -i -e 's/^torch==\(.*\)+cpu/torch==\1/' -e '/#   --override/d' $(1)
	sed -i '1i # Locked dependency set for $(3): uv pip compile pyproject.toml $(2);\n# torch local tag stripped (CPU machines: +cpu wheel from /opt/wheels; GPU nodes: CUDA build). Regenerate: make lock' $(1)
endef

clean:
	rm -rf $(VENV) trainflow-work .mypy_cache .ruff_cache docs/_build docs/api/generated
