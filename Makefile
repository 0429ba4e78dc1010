# Two entry points that work on a fresh machine: `make demo` and `make test`.
# The venv gets a CPU torch first (when none is importable) so that no package
# pulls a multi-GB CUDA build in as a dependency.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
DEMO_OUT ?= runs/demo

.PHONY: setup setup-dev sandbox-tools demo test test-unit bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.torch: $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	touch $@

$(VENV)/.relayrl: $(VENV)/.torch pyproject.toml
	$(BIN)/python -m pip install -q -e ".[ray,loggers,docs,tasks,serve,agents]" pytest ruff
	touch $@

setup: $(VENV)/.relayrl sandbox-tools

# bubblewrap runs the code sandbox (relayrl.sandbox). It is installed where apt-get is there and we are
# root; this never fails the set-up: without it, configuring a sandboxed task is refused in one line.
sandbox-tools:
	@command -v bwrap >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing bubblewrap (the code sandbox)"; \
	    export DEBIAN_FRONTEND=noninteractive; \
	    apt-get install -y -q bubblewrap >/dev/null 2>&1 || \
	      { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q bubblewrap >/dev/null 2>&1; } || \
	      echo "note: could not install bubblewrap: the code sandbox is unavailable (apt-get install bubblewrap)"; \
	  else \
	    echo "note: bubblewrap (bwrap) is not installed: the code sandbox is unavailable (apt-get install bubblewrap)"; \
	  fi; \
	}; true

setup-dev: setup
	$(BIN)/python -m pip install -q -e ".[dev]"

demo: setup
	$(BIN)/relayrl demo --out $(DEMO_OUT)

test: setup
	$(BIN)/ruff check relayrl tests benchmarks
	$(BIN)/python -m pytest -q -x --durations=15

# the fast set (tests/README.md: the kinds of test)
test-unit: setup
	$(BIN)/python -m pytest -q -m unit

bench: setup-dev
	$(BIN)/python -m pytest -q -m slow

clean:
	rm -rf $(VENV) runs
