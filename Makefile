# Two commands do all the set-up: `make demo` and `make test` (see README.md).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# What `make demo` needs (torch, attnkit), then what the tests add (pytest, ruff, transformers,
# the browser, notebooks and docs tooling). Each is reinstalled when the requirements or pins change.
DEMO_STAMP := $(VENV)/.demo-stamp
TEST_STAMP := $(VENV)/.test-stamp

.PHONY: demo test test-fast test-build test-hf-oldest test-gpu kernels docs lint format clean browser

$(DEMO_STAMP): pyproject.toml setup.py constraints.txt
	@echo "make: creating $(VENV) with torch 2.13.0 (CPU) and attnkit"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --progress-bar off -c constraints.txt -e .
	touch $@

$(TEST_STAMP): $(DEMO_STAMP)
	@echo "make: installing the test tooling (pytest, ruff, transformers, playwright, jupyter, mkdocs)"
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $@

# The C++ kernels for this CPU, built once ahead of use (a no-op when they are built).
kernels: $(DEMO_STAMP)
	@$(BIN)/attnkit build || echo "make: attnkit runs PyTorch operations where a kernel is missing (slower)"

demo: kernels
	$(BIN)/attnkit explain

# The documentation site, from docs/ and the docstrings, into site/ (not committed).
docs: $(TEST_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

lint: $(TEST_STAMP)
	$(BIN)/ruff check src tests examples setup.py
	$(BIN)/ruff format --check src tests examples setup.py

# Debian's Chromium for the browser test (tests/test_browser.py), where this user can install it
# (root with apt-get); elsewhere that test skips and says why (CI makes the skip a failure).
browser:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
	  && { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null 2>&1 \
	  || { apt-get update -qq >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null 2>&1; }; }; } \
	  || echo "note: Chromium could not be installed here; the browser test will skip"

test: lint browser kernels
	$(BIN)/python -m pytest -m "not build" --durations=15 --junitxml=build/test-times.xml

# The inner loop: every test but the browser, the docs site and the notebooks (marked `outer`).
test-fast: $(TEST_STAMP) kernels
	$(BIN)/python -m pytest -m "not build and not outer" -q

# The tests that compile kernels from scratch and build a wheel (a few minutes; CI runs them).
test-build: $(TEST_STAMP) kernels
	$(BIN)/python -m pytest -m build --durations=5

# attnkit.hf on the oldest transformers it supports, in a venv of its own (CI runs it).
HF_OLDEST := .venv-hf-oldest
test-hf-oldest: kernels
	@echo "make: attnkit.hf's tests on transformers 5.17 (constraints-hf-oldest.txt), in $(HF_OLDEST)"
	test -x $(HF_OLDEST)/bin/python || $(PYTHON) -m venv $(HF_OLDEST)
	$(HF_OLDEST)/bin/python -m pip install --quiet -r constraints-hf-oldest.txt
	PYTHONPATH=src $(HF_OLDEST)/bin/python -m pytest tests/hf

# The tests of CUDA paths (the `gpu` marker), with the Python at hand and nothing installed: on a
# machine with a GPU (scripts/gpu-check.sh runs it on a lent one); without one they all skip.
# A worker per logical core; an idle worker takes tests queued on a busy one (`worksteal`, where
# pytest-xdist has it): by default each worker is handed runs of consecutive tests, and on a bare
# machine the compiled-flex cases, up to a minute each while they compile, queue on one worker.
GPU_WORKERS ?= $(shell $(PYTHON) -c 'import xdist.scheduler as s; \
  print("-n logical --dist", "worksteal" if hasattr(s, "WorkStealingScheduling") else "load")' \
  2>/dev/null)
test-gpu:
	PYTHONPATH=src$${PYTHONPATH:+:$$PYTHONPATH} $(PYTHON) -m pytest -m gpu -p no:cacheprovider \
	  $(GPU_WORKERS) --durations=10 $(PYTEST_ARGS) tests

format: $(TEST_STAMP)
	$(BIN)/ruff format src tests examples setup.py
	$(BIN)/ruff check --fix src tests examples setup.py

clean:
	rm -rf $(VENV) $(HF_OLDEST) site .pytest_cache .ruff_cache .hypothesis build dist src/*.egg-info
