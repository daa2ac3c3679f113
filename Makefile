# trainflow: `make demo` runs a whole pipeline on bundled real data; `make test` runs the tests.
# Both set everything up first (a virtualenv in .venv from requirements.lock).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# CPU machines of our kind carry a local torch +cpu wheel; elsewhere torch comes from the index.
FIND_LINKS := $(if $(wildcard /opt/wheels/torch-*),--find-links /opt/wheels)
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export PYTHONUNBUFFERED := 1

.PHONY: setup demo test lint typecheck unit integration gpu bench lock clean \
	stack-up stack-deploy stack-status stack-down

setup: $(VENV)/.installed

$(VENV)/.installed: requirements.lock pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	PIP_CONFIG_FILE=/dev/null $(BIN)/python -m pip install -q --disable-pip-version-check uv==0.13.9
	$(BIN)/uv pip sync --python $(BIN)/python --compile-bytecode $(FIND_LINKS) requirements.lock
	$(BIN)/uv pip install --python $(BIN)/python --no-deps --compile-bytecode -e .
	touch $@

demo: setup
	$(BIN)/trainflow run --preset demo

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: setup
	$(BIN)/mypy flows tasks cluster tests bench

unit: setup
	$(BIN)/python -m pytest tests/unit

integration: setup
	$(BIN)/python -m pytest tests/integration

bench: setup
	$(BIN)/python -m bench

gpu: setup
	$(BIN)/python -m pytest tests/gpu

test: lint typecheck
	$(BIN)/python -m pytest tests


# The local stack (Prefect server, a process worker, MLflow server): see deploy/README.md.
stack-up: setup
	deploy/stack.sh up

stack-deploy: setup
	deploy/stack.sh deploy

stack-status: setup
	deploy/stack.sh status

stack-down: setup
	deploy/stack.sh down

lock: setup
	$(BIN)/uv pip compile pyproject.toml --extra dev $(FIND_LINKS) --python-version 3.11 \
	  $(if $(FIND_LINKS),--override <(echo torch==2.13.0+cpu)) --no-header -q -o requirements.lock
	sed -i -e 's/^torch==\(.*\)+cpu/torch==\1/' -e '/#   --override/d' requirements.lock
	sed -i '1i # Locked dependency set (uv pip compile pyproject.toml --extra dev; torch local tag stripped so\n# CPU machines take the +cpu wheel from /opt/wheels and GPU nodes the CUDA build). Regenerate: make lock' requirements.lock

clean:
	rm -rf $(VENV) trainflow-work .mypy_cache .ruff_cache
