# Two commands do all the set-up: `make demo` and `make test` (see README.md).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp

.PHONY: demo test docs lint format clean browser

# The venv is rebuilt whenever the package's requirements or the pins change.
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/attnkit explain

# The documentation site, from docs/ and the docstrings, into site/ (not committed).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

lint: $(STAMP)
	$(BIN)/ruff check src tests examples
	$(BIN)/ruff format --check src tests examples

# Debian's Chromium for the browser test (tests/test_browser.py), where this user can install it
# (root with apt-get); elsewhere that test skips and says why (CI makes the skip a failure).
browser:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
	  && { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null 2>&1 \
	  || { apt-get update -qq >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null 2>&1; }; }; } \
	  || echo "note: Chromium could not be installed here; the browser test will skip"

test: lint browser
	$(BIN)/python -m pytest

format: $(STAMP)
	$(BIN)/ruff format src tests examples
	$(BIN)/ruff check --fix src tests examples

clean:
	rm -rf $(VENV) site .pytest_cache .ruff_cache .hypothesis build dist src/*.egg-info
