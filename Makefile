# Two commands for a fresh machine: `make demo` and `make test`.
# Everything installs into .venv; torch is pinned to the local CPU build by constraints.txt.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
export RAY_AUTH_MODE ?= disabled

.PHONY: demo test setup bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q -c constraints.txt -e ".[dev,kernels]"
	touch $@

demo: setup
	$(PY) -m sparrow.services.cli demo

test: setup
	$(PY) -m pytest -q $(PYTEST_ARGS)

bench: setup
	$(PY) -m benchmarks.core --out BENCHMARKS.md

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
