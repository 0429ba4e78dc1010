# Two entry points that work on a fresh machine: `make demo` and `make test`.
# The venv gets a CPU torch first (when none is importable) so that no package
# pulls a multi-GB CUDA build in as a dependency.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
DEMO_OUT ?= runs/demo

.PHONY: setup setup-dev demo test bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.torch: $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	touch $@

$(VENV)/.relayrl: $(VENV)/.torch pyproject.toml
	$(BIN)/python -m pip install -q -e ".[ray]" pytest ruff
	touch $@

setup: $(VENV)/.relayrl

setup-dev: setup
	$(BIN)/python -m pip install -q -e ".[dev]"

demo: setup
	$(BIN)/relayrl demo --out $(DEMO_OUT)

test: setup
	$(BIN)/ruff check relayrl tests benchmarks
	$(BIN)/python -m pytest -q -x --durations=15

bench: setup-dev
	$(BIN)/python -m pytest -q -m slow

clean:
	rm -rf $(VENV) runs
