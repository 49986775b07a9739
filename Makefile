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

test: lint
	TRITON_INTERPRET=1 $(PY) -m pytest -q -p no:cacheprovider -m "not gpu"

# On a CUDA machine whose python3 already has torch and triton (no venv, no installs):
# every test that touches CUDA (tests/cli, tests/modules and tests/parallel are CPU-only
# and run in `make test`), in three pytest processes at once (the GPU has room; about
# 3.5 minutes instead of 8). `make bench` prints the tables of BENCHMARKS.md.
GPU_TEST_GROUPS := tests/gpu tests/kernels "tests/ops tests/test_recipes.py"
GPU_TEST_LOGS ?= /tmp/grouped_linear-test-gpu

test-gpu:
	@mkdir -p $(GPU_TEST_LOGS); rm -f $(GPU_TEST_LOGS)/*.log; status=0; pids=""; i=0; \
	for group in $(GPU_TEST_GROUPS); do \
		i=$$((i + 1)); \
		$(PYTHON) -m pytest -q -rf -p no:cacheprovider $$group > $(GPU_TEST_LOGS)/$$i.log 2>&1 & \
		pids="$$pids $$!"; \
	done; \
	for pid in $$pids; do wait $$pid || status=1; done; \
	for log in $(GPU_TEST_LOGS)/*.log; do echo "== $$log"; grep -E "^(FAILED|ERROR)|passed|failed" $$log | tail -n 20; done; \
	exit $$status

bench:
	$(PYTHON) -m grouped_linear bench
	$(PYTHON) -m grouped_linear bench --suite layouts

# The measurements behind benchmarks/NOTES.md (CUDA machine).
bench-details:
	PYTHONPATH=. $(PYTHON) benchmarks/backend_choice.py
	PYTHONPATH=. $(PYTHON) benchmarks/overhead.py
	PYTHONPATH=. $(PYTHON) benchmarks/autograd_floor.py
	PYTHONPATH=. $(PYTHON) benchmarks/bias_kernels.py
	PYTHONPATH=. $(PYTHON) benchmarks/bias_in_step.py
	PYTHONPATH=. $(PYTHON) benchmarks/triton_vs_grouped.py
	PYTHONPATH=. $(PYTHON) benchmarks/compile_vs_eager.py
	PYTHONPATH=. $(PYTHON) benchmarks/compile_overhead.py
	PYTHONPATH=. $(PYTHON) benchmarks/fp8_quantize.py
	PYTHONPATH=. $(PYTHON) benchmarks/fp8_vs_torchao.py
	PYTHONPATH=. $(PYTHON) benchmarks/fp8_blockwise_gemms.py
	PYTHONPATH=. $(PYTHON) benchmarks/fp8_block_quantize.py
	PYTHONPATH=. $(PYTHON) benchmarks/blockwise_variants.py
	PYTHONPATH=. $(PYTHON) benchmarks/fp8_launches.py

clean:
	rm -rf $(VENV) build *.egg-info
