# Set-up and checks. `make demo` and `make test` create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint test-gpu bench bench-details clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# The CPU build of torch first (a bare `pip install torch` would fetch a CUDA build).
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,cli,dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m grouped_linear demo

lint: $(STAMP)
	$(VENV)/bin/ruff check grouped_linear tests

# Two pytest processes (CI has two cores): 5.9 against 9.8 minutes for one on such a machine.
test: lint
	TRITON_INTERPRET=1 $(PY) -m pytest -q -p no:cacheprovider -n 2 -m "not gpu"

# On a CUDA machine whose python3 already has torch, triton and pytest-xdist (no venv, no
# installs): every test that touches CUDA (the rest of tests/cli, tests/modules and
# tests/parallel are CPU-only and run in `make test`) in one pytest run spread over
# GPU_TEST_WORKERS processes, test by test: Triton's compilations take most of the time, on
# the CPU cores, and the processes share Triton's on-disk cache (a kernel compiled by one is
# loaded by the others). GPU_TEST_PATHS='...' on the command line runs some of them. The
# transformers tests need transformers importable (README, Development). `make bench`
# prints the tables of BENCHMARKS.md, the transformers suite's where transformers is importable;
# BENCH_JSON=DIR also writes each suite's numbers to DIR/<suite>.json. Where pytest-timeout
# is installed, a test that runs past GPU_TEST_TIMEOUT seconds fails with its stack, and the
# run goes on.
GPU_TEST_PATHS := tests/gpu tests/kernels tests/ops tests/test_recipes.py \
	tests/modules/test_grouped_linear.py tests/modules/test_nd_input.py
GPU_TEST_WORKERS ?= 12
GPU_TEST_LOGS ?= /tmp/grouped_linear-test-gpu
GPU_TEST_TIMEOUT ?= 240

test-gpu:
	@mkdir -p $(GPU_TEST_LOGS); \
	timeout=$$($(PYTHON) -c "import pytest_timeout" 2>/dev/null && echo --timeout=$(GPU_TEST_TIMEOUT)); \
	$(PYTHON) -m pytest -v -rf --durations=25 -p no:cacheprovider -n $(GPU_TEST_WORKERS) \
		$$timeout --dist load $(GPU_TEST_PATHS) > $(GPU_TEST_LOGS)/test-gpu.log 2>&1; status=$$?; \
	grep -E "^(FAILED|ERROR)|passed|failed" $(GPU_TEST_LOGS)/test-gpu.log | tail -n 40; \
	exit $$status

bench:
	@set -e; [ -z "$(BENCH_JSON)" ] || mkdir -p "$(BENCH_JSON)"; \
	for suite in gemm layouts moe fine transformers; do \
		if [ $$suite = transformers ] && ! $(PYTHON) -c "import transformers" 2>/dev/null; then \
			echo "== $$suite: skipped (transformers is not importable)"; continue; \
		fi; \
		echo "== $$suite"; \
		$(PYTHON) -m grouped_linear bench --suite $$suite $(if $(BENCH_JSON),--json $(BENCH_JSON)/$$suite.json); \
	done

# The scripts of benchmarks/ (benchmarks/README.md says what each measures), each once with
# its defaults, on a CUDA machine; EP_WORLD: GPUs for the expert-parallel run.
EP_WORLD ?= 2
BENCH_SCRIPTS := small_step backend_choice bias_cost compile_vs_eager bf16_gemms fp8_gemms \
	fp8_quantize layout_kernels profile_step

bench-details:
	@set -e; for script in $(BENCH_SCRIPTS); do \
		echo "== benchmarks/$$script.py"; PYTHONPATH=. $(PYTHON) benchmarks/$$script.py; \
	done
	PYTHONPATH=. $(PYTHON) benchmarks/profile_step.py launches
	PYTHONPATH=. $(PYTHON) benchmarks/expert_parallel.py --world $(EP_WORLD)
	PYTHONPATH=. $(PYTHON) benchmarks/fp8_primary.py --world 1

clean:
	rm -rf $(VENV) build *.egg-info
