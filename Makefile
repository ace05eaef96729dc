# Two entry points: `make demo` (the shipped stdlib-k3 writes Python) and `make test` (lint, types, the whole suite);
# `make test-fast` is `make test` without the tests marked slow (over ~3 s each), for quick checks.
# Each creates .venv and installs what it needs. torch is pinned to the CPU build that this
# project's machines carry; set TORCH=torch to take whatever pip resolves (a CUDA build on Linux).
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
PY     := $(VENV)/bin/python
MOESWAP := $(VENV)/bin/moeswap
DEMO_MODEL ?= models/stdlib-k3

.PHONY: demo lint test test-fast install install-test clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[test]"
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

demo: install
	$(MOESWAP) inspect $(DEMO_MODEL)
	$(MOESWAP) generate $(DEMO_MODEL) --prompt "$$(printf 'class Stack:\n    \042\042\042A last-in, first-out stack.\042\042\042\n\n    def')" \
		--max-tokens 64 --temperature 0.7 --top-p 0.95 --seed 1 --stats

# ruff over src and tests, mypy over the core packages listed in pyproject.toml; both before any test runs
lint: install-test
	$(VENV)/bin/ruff check src tests
	$(PY) -m mypy

test: lint
	$(PY) -m pytest -q -n 2 --dist loadfile

test-fast: lint
	$(PY) -m pytest -q -n 2 --dist loadfile -m "not slow"

clean:
	rm -rf $(VENV)
