# `make fit` and `make test` set everything up on a fresh machine (a .venv on first use).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: lint fit pipeline test test-slow test-matrix test-compat test-hf bench test-bench bench-gpu install clean docs

$(STAMP): pyproject.toml setup.cfg
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch pinned first: the CPU wheel on this machine; an unpinned torch pulls a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev,test-s3,docs]"
	touch $(STAMP)

install: $(STAMP)

fit: $(STAMP)
	$(PY) -m lit_minimind.fit $(ARGS)

# the whole pipeline as one resumable run (docs/pipeline.md): the embedded corpus to the report card in runs/pipeline
pipeline: $(STAMP)
	$(PY) -m lit_minimind.pipeline $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

test: $(STAMP) lint
	$(PY) -m pytest -q -n 2 -m "not slow and not bench and not matrix" tests $(PYTEST_ARGS)

# minutes-long checks (torch.compile on CPU, ...): CI runs them after `make test`
test-slow: $(STAMP)
	$(PY) -m pytest -q -n 2 -m "slow and not matrix" tests --ignore=tests/test_hf_transformers.py $(PYTEST_ARGS)

# more cases of behaviours CI already checks once (the other errno of each fault, seed 1 of the mid-epoch kill chain,
# 8 more seeded kill trials, the other start-up signal phases): not in CI (its 45-min budget); run it after changing
# the save or restore path (about 4.5 min on 2 cores)
test-matrix: $(STAMP)
	$(PY) -m pytest -q -n 2 -m matrix tests $(PYTEST_ARGS)

# deliberate breaks (tests/mutants/sitecustomize.py) the suite must catch: < 15 min on 2 cores; CI runs it after test-slow
test-mutants: $(STAMP)
	$(PY) scripts/mutants.py --json mutants.json $(ARGS)

bench: $(STAMP)
	$(PY) -m benchmarks.run_all

# the benchmarks' own smoke runs (every benchmark at toy size, about 6 min on 2 cores): after changing benchmarks/;
# not in CI, which tests the product (make bench would find a broken benchmark too, later)
test-bench: $(STAMP)
	$(PY) -m pytest -q -n 2 -m bench tests $(PYTEST_ARGS)

# on a CUDA machine, with a prepared Python whose torch is a CUDA build (no install step):
#   make bench-gpu PY=/path/to/python      (default .venv/bin/python)
# one overall deadline of 8 min on one H100/H200, each child process <= 120 s; ARGS=--quick: CPU smoke test
bench-gpu:
	$(PY) -m benchmarks.bench_gpu $(ARGS)

# the documentation (docs/, mkdocs.yml) as a site in site/: offline, strict (a broken link or anchor fails it)
docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict --site-dir site  # not --quiet: it hides the warnings strict fails on

clean:
	rm -rf out checkpoints lightning_logs wandb site

COMPAT_TESTS := tests/test_loop_state.py tests/test_kill_chains.py tests/test_resume_exact.py tests/test_ddp.py tests/test_preemption.py

# The oldest supported Lightning (pyproject: lightning>=2.5): the resume tests on it, in their own venv (make test's
# share of those files, and the DDP kill-and-resume marked compat; their slow variants run on the newest Lightning).
COMPAT_LIGHTNING ?= 2.5.0
COMPAT_VENV := .venv-compat
COMPAT_STAMP := $(COMPAT_VENV)/.installed-$(COMPAT_LIGHTNING)

$(COMPAT_STAMP): pyproject.toml setup.cfg
	$(PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/python -m pip install -q --upgrade pip
	$(COMPAT_VENV)/bin/python -m pip install -q torch==2.13.0 "lightning==$(COMPAT_LIGHTNING)" "pytorch-lightning==$(COMPAT_LIGHTNING)"
	$(COMPAT_VENV)/bin/python -m pip install -q -e ".[dev]" "lightning==$(COMPAT_LIGHTNING)"
	touch $(COMPAT_STAMP)

test-compat: $(COMPAT_STAMP)
	$(COMPAT_VENV)/bin/python -m pytest -q -n 2 -m "(not slow or compat) and not matrix" $(COMPAT_TESTS) $(PYTEST_ARGS)

# The Hugging Face export in transformers itself (tests/test_hf_transformers.py): transformers in its own
# venv (in the project's it breaks torchmetrics); the tests run it there and skip without it.
HF_TRANSFORMERS ?= 5.24.0
HF_VENV := .venv-hf
HF_STAMP := $(HF_VENV)/.installed-$(HF_TRANSFORMERS)

$(HF_STAMP):
	$(PYTHON) -m venv $(HF_VENV)
	$(HF_VENV)/bin/python -m pip install -q --upgrade pip
	$(HF_VENV)/bin/python -m pip install -q torch==2.13.0 "transformers==$(HF_TRANSFORMERS)" safetensors
	touch $(HF_STAMP)

test-hf: $(STAMP) $(HF_STAMP)
	$(PY) -m pytest -q -n 2 tests/test_hf_transformers.py $(PYTEST_ARGS)

# lm-evaluation-harness for `python -m lit_minimind.eval` (tests/test_eval.py) in its own venv, as test-hf's
# transformers: lm-eval brings datasets, evaluate, scikit-learn, ... (and its other models want transformers,
# which breaks the project's torchmetrics); torch pinned first (the CPU wheel), then lm-eval, then the project
# without extras. The tests run lm-eval there and skip without it.
LM_EVAL ?= 0.4.13
EVAL_VENV := .venv-eval
EVAL_STAMP := $(EVAL_VENV)/.installed-$(LM_EVAL)

.PHONY: install-eval test-eval

$(EVAL_STAMP): pyproject.toml setup.cfg
	$(PYTHON) -m venv $(EVAL_VENV)
	$(EVAL_VENV)/bin/python -m pip install -q --upgrade pip
	$(EVAL_VENV)/bin/python -m pip install -q torch==2.13.0
	$(EVAL_VENV)/bin/python -m pip install -q "lm-eval==$(LM_EVAL)"
	$(EVAL_VENV)/bin/python -m pip install -q -e .
	touch $(EVAL_STAMP)

install-eval: $(EVAL_STAMP)

test-eval: $(STAMP) $(EVAL_STAMP)
	$(PY) -m pytest -q tests/test_eval.py $(PYTEST_ARGS)
