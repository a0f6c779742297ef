# Two commands do all the set-up: `make demo` and `make test` (see README.md).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp

.PHONY: demo test lint format clean

# The venv is rebuilt whenever the package's requirements or the pins change.
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/attnkit explain

lint: $(STAMP)
	$(BIN)/ruff check src tests examples
	$(BIN)/ruff format --check src tests examples

test: lint
	$(BIN)/python -m pytest

format: $(STAMP)
	$(BIN)/ruff format src tests examples
	$(BIN)/ruff check --fix src tests examples

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis build dist src/*.egg-info
