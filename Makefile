# Two commands (README): `make demo` sets everything up and runs the main job on the CPU default;
# `make test` runs the tests. The environment and the offline assets live outside git, in
# $(CACHE) (override with CACHE=...), and are reused across clones.
SHELL := /bin/bash
PY ?= python3
CACHE ?= $(HOME)/.cache/qwen3-trainium-recipes
VENV ?= $(CACHE)/venv
PYTHON := $(VENV)/bin/python
REQ_HASH := $(shell sha256sum requirements.txt | cut -c1-16)
STAMP := $(VENV)/.installed-$(REQ_HASH)
export QWEN3_RECIPES_CACHE := $(CACHE)
# Nothing reaches a model hub at run time: every path the CPU presets use is local.
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export PYTHONUNBUFFERED := 1

.PHONY: setup env assets browser demo test test-extended test-all clean-runs

setup: env assets browser

env: $(STAMP)

# The stamp's name holds a hash of requirements.txt's content: a changed file is a new stamp, so make need not
# compare times (a fresh clone's requirements.txt is always newer than the environment it reuses).
$(STAMP):
	@echo "== creating $(VENV) and installing requirements.txt (a few minutes the first time)"
	@test -x $(PYTHON) || $(PY) -m venv $(VENV)
	$(PYTHON) -m pip install -q --upgrade pip
	$(PYTHON) -m pip install -q -r requirements.txt
	@rm -f $(VENV)/.installed-* && touch $@

assets: env
	@echo "== preparing offline assets in $(CACHE)/assets (tokenizer, corpus, models)"
	$(PYTHON) -m tools.prepare_assets prepare

# Headless Chromium (Debian's chromium + chromium-driver) for the lookup page's browser tests.
browser:
	bash tools/install_browser.sh

demo: setup
	$(PYTHON) examples/train_native_qwen3.py --preset tiny --steps 10 --out_dir runs/demo_native_qwen3
	@echo "== the README's commands start with python: first activate this environment (or use $(PYTHON))"
	@echo "   . $(VENV)/bin/activate"

# Three pytest workers on two cores, one test file each at a time (module fixtures run once): most
# tests wait on training processes (their own sleeps, collectives, file writes), and a third worker
# fills those waits. -rs prints why a test was skipped (the Trainium-only tests, on a machine without
# a NeuronCore); the run ends with the ten slowest tests and pytest's closing line, which gives the
# total wall time. How the suite stays short and load-independent: docs/testing.md.
# `make test` leaves out the tests marked `extended` (further end-to-end runs of promises it already runs
# end to end once); `make test-extended` runs those alone, `make test-all` both.
PYTEST := MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=17179869184 $(PYTHON) -m pytest -q -rs --durations=10 -n 3 --dist loadfile --no-loadscope-reorder

test: setup
	$(PYTEST) -m "not extended" tests

test-extended: setup
	$(PYTEST) -m extended tests

test-all: setup
	$(PYTEST) tests

clean-runs:
	rm -rf runs
