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

.PHONY: demo lint test test-fast numerics install install-test clean

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

# The suites whose claims depend on the CPU's arithmetic (bit-exact batches and ranks, kernel = reference
# within a bound), again at each instruction-set level this CPU runs below its own (MOESWAP_KERNEL_ISA), the
# AVX2 level with MKL's AVX2 GEMM too (an Intel CPU's without AVX-512): docs/numerics.md
NUMERICS = tests/ops/test_batch_invariance.py tests/lora/test_serving.py tests/lora/test_grad.py \
           tests/lora/test_targets.py tests/experts/test_hybrid.py tests/engine/test_native_step.py \
           tests/distributed/test_data_parallel.py

test: lint
	$(PY) -m pytest -q -n 2 --dist loadfile
	$(MAKE) --no-print-directory numerics

numerics: install-test
	@for level in $$($(PY) -c "from moeswap.ops.cpu_kernels import supported_levels as s; \
	    print(' '.join(l for l in s() if l in ('x86-64-v4', 'x86-64-v3', 'x86-64')))"); do \
	  mkl=$$( [ $$level = x86-64-v3 ] && echo AVX2 || echo "" ); \
	  echo "numerics: MOESWAP_KERNEL_ISA=$$level $${mkl:+MKL_ENABLE_INSTRUCTIONS=$$mkl}"; \
	  env MOESWAP_KERNEL_ISA=$$level $${mkl:+MKL_ENABLE_INSTRUCTIONS=$$mkl} $(PY) -m pytest -q -n 2 --dist loadfile \
	    $(NUMERICS) || exit 1; \
	done

test-fast: lint
	$(PY) -m pytest -q -n 2 --dist loadfile -m "not slow"

clean:
	rm -rf $(VENV)
