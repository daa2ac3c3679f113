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

.PHONY: setup bytecode demo test lint typecheck unit integration gpu bench lock clean docs \
	stack-up stack-deploy stack-status stack-down

setup: $(VENV)/.installed-$(KIND)

# One stamp per kind: switching GPU=0/1 re-syncs (uv pip sync also removes what the lock lacks).
# Bytecode: where PYTHONDONTWRITEBYTECODE is set every process would compile each module it
# imports anew, so the packages are compiled once here, as `uv --compile-bytecode` would, but
# without the ~3,900 files of their own test suites (never imported): sync and compile took
# 25.9 and 29.2 s against uv's 36.6 and 32.6 (interleaved, 2 cores, a busy hour). A file that
# does not compile (torch ships Python 3.12 syntax in its test helpers) is skipped, as uv
# skips it: Python could not import it either.
$(VENV)/.installed-$(KIND): $(LOCK) pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	PIP_CONFIG_FILE=/dev/null $(BIN)/python -m pip install -q --disable-pip-version-check uv==0.13.9
	$(BIN)/uv pip sync --python $(BIN)/python $(FIND_LINKS) $(LOCK)
	$(BIN)/uv pip install --python $(BIN)/python --no-deps -e .
	@echo "compiling the packages' bytecode (their own test folders left out)"
	@$(BIN)/python -m compileall -q -j 0 -x '/tests?/|/testing/_internal/' \
	  "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
	  > /dev/null || true
	rm -f $(VENV)/.installed $(VENV)/.installed-cpu $(VENV)/.installed-gpu
	touch $@

# The project's own modules compiled, as a wheel install's are (an editable install's are not):
# where PYTHONDONTWRITEBYTECODE is set (CI sandboxes, some clusters) every process would
# compile them anew, ~0.2 CPU s each (the command, each rank, each dask worker). Only what
# changed is recompiled; a stale file is recompiled in memory as before, never run stale.
bytecode: setup
	@$(BIN)/python -m compileall -q -j 0 flows tasks cluster trainflow tests bench examples > /dev/null

demo: bytecode
	$(BIN)/trainflow run --preset demo

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# mypy's incremental cache lives outside the checkout, shared by every clone on this machine
# (as uv's package cache is): most of a cold check is torch's, Prefect's and MLflow's stubs,
# the same for every clone. mypy re-checks whatever changed (by content hash): a fresh clone
# checks in ~9 instead of ~59 CPU s once any clone has run it. MYPY_CACHE=.mypy_cache: per clone.
MYPY_CACHE ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/trainflow/mypy
MYPY := $(BIN)/mypy --cache-dir "$(MYPY_CACHE)" trainflow tests bench examples

typecheck: setup
	$(MYPY)

unit: bytecode
	$(BIN)/python -m pytest tests/unit

integration: bytecode
	$(BIN)/python -m pytest tests/integration

bench: bytecode
	$(BIN)/python -m bench

gpu: bytecode
	$(BIN)/python -m pytest tests/gpu

# The suite waits on servers, Slurm and rank processes about half of its time: 4 workers keep
# both cores busy (each Slurm test file uses its worker's own 2-node dev cluster), the longest
# files go first (tests/group_seconds.json), and mypy runs beside the tests, not before them.
TEST_WORKERS ?= 4
test: lint bytecode
	@$(MYPY) > .mypy.log 2>&1 & mypy=$$!; \
	$(BIN)/python -m pytest tests -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder \
	  --durations=30; tests=$$?; \
	wait $$mypy; typed=$$?; echo "== mypy =="; cat .mypy.log; \
	test $$tests -eq 0 -a $$typed -eq 0


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
