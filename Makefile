# fulmen: common tasks. `make demo` and `make test` are the two set-up commands in the README; both install first.
#
# `make install` pins torch to the 2.13.0 CPU build through constraints.txt (the package itself accepts a range),
# so pip takes the local wheel instead of downloading a CUDA build.

PYTHON ?= python
PYTEST_ARGS ?=
# The `fulmen` command, run through this interpreter so that a fresh install needs no PATH (or pyenv shim) refresh.
FULMEN = $(PYTHON) -m fulmen.bench.cli

.PHONY: help install demo test lint bench

help:
	@echo "make demo     install, then trace a small built-in GPT and compare fulmen with eager PyTorch"
	@echo "make test     install, then run the test suite on 2 workers"
	@echo "make lint     ruff check"
	@echo "make bench    the speed benchmarks under benchmarks/ (call overhead, tracing time, import time)"
	@echo "make install  pip install -e \".[test]\" with torch pinned by constraints.txt"

install:
	$(PYTHON) -m pip install -e ".[test]" -c constraints.txt

demo: install
	$(FULMEN) demo

test: install
	$(PYTHON) -m pytest -n 2 -q $(PYTEST_ARGS)

lint:
	$(PYTHON) -m ruff --version >/dev/null 2>&1 || $(PYTHON) -m pip install ruff
	$(PYTHON) -m ruff check $(wildcard fulmen tests examples benchmarks)

bench:
	$(PYTHON) benchmarks/bench_overhead.py
	$(PYTHON) benchmarks/bench_tracing.py
	$(PYTHON) benchmarks/bench_import.py
