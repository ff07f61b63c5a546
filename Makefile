# `make fit` and `make test` set everything up on a fresh machine (a .venv on first use).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: fit test bench install clean

$(STAMP): pyproject.toml setup.cfg
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch pinned first: the CPU wheel on this machine; an unpinned torch pulls a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

fit: $(STAMP)
	$(PY) -m lit_minimind.fit $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q -n 2 tests $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) -m benchmarks.run_all

clean:
	rm -rf out checkpoints lightning_logs wandb
