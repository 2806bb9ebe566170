# fulmen: common tasks. `make demo` and `make test` are the two commands in the README; both install first.
#
# The installs pin torch to the 2.13.0 CPU build through constraints.txt (the package itself accepts a range),
# so pip takes the local wheel instead of downloading a CUDA build. `make demo` installs fulmen alone; the test
# targets add the test extras (pytest, pytest-xdist, transformers for the Hugging Face model tests, triton for the
# Triton kernels' tests, which run in Triton's CPU interpreter; constraints.txt pins the release torch 2.13 needs).

PYTHON ?= python
PYTEST_ARGS ?=
# The `fulmen` command, run through this interpreter so that a fresh install needs no PATH (or pyenv shim) refresh.
FULMEN = $(PYTHON) -m fulmen.bench.cli
PYTEST = $(PYTHON) -m pytest -n 2 -q

.PHONY: help install install-test demo test test-slow test-all lint bench

help:
	@echo "make demo          install, then trace a small built-in GPT and compare fulmen with eager PyTorch"
	@echo "make test          install with test extras, then run the default tests (not the slow ones) on 2 workers"
	@echo "make test-slow     only the tests marked slow (every OpInfo through Inductor, fresh-process C++ builds)"
	@echo "make test-all      every test, slow ones included (what .ci/run runs, in two steps)"
	@echo "make lint          ruff check"
	@echo "make bench         the speed benchmarks under benchmarks/ (call overhead, tracing time, import time)"
	@echo "make install       pip install -e . with torch pinned by constraints.txt"
	@echo "make install-test  the same with the test extras"

install:
	$(PYTHON) -m pip install -e . -c constraints.txt

install-test:
	$(PYTHON) -m pip install -e ".[test]" -c constraints.txt

demo: install
	$(FULMEN) demo

test: install-test
	$(PYTEST) -m "not slow" $(PYTEST_ARGS)

test-slow: install-test
	$(PYTEST) -m slow $(PYTEST_ARGS)

test-all: install-test
	$(PYTEST) $(PYTEST_ARGS)

lint:
	$(PYTHON) -m ruff --version >/dev/null 2>&1 || $(PYTHON) -m pip install ruff
	$(PYTHON) -m ruff check $(wildcard fulmen tests examples benchmarks)

bench:
	$(PYTHON) benchmarks/bench_overhead.py
	$(PYTHON) benchmarks/bench_tracing.py
	$(PYTHON) benchmarks/bench_import.py
