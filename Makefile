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
# and run in `make test`), in eleven pytest processes at once (the GPU has room; Triton's
# compilations take most of the time, on the CPU cores, so all at once on a 16-core H200
# host ran past 9 minutes; GPU_TEST_GROUPS='...' on the command line runs some of them). The
# transformers tests need transformers importable (README, Development). `make bench`
# prints the tables of BENCHMARKS.md but the transformers suite's (that one needs transformers:
# `python -m grouped_linear bench --suite transformers`).
GPU_TEST_GROUPS := tests/gpu/test_bad_input_cuda.py \
	"tests/gpu/test_grouped_linear_cuda.py tests/gpu/test_fast_path_cuda.py" \
	"tests/gpu/test_fp8_cuda.py tests/gpu/test_fp8_gemm_cuda.py tests/gpu/test_fp8_fused_cuda.py tests/gpu/test_weight_grad_cuda.py tests/gpu/test_expert_parallel_nccl.py" \
	tests/gpu/test_transformers_cuda.py \
	"tests/gpu/test_module_attrs_cuda.py tests/gpu/test_routing_inputs_cuda.py tests/gpu/test_chunks_cuda.py tests/gpu/test_mlp_probs_cuda.py" \
	"tests/gpu/test_compile_cuda.py tests/gpu/test_cuda_graphs.py tests/gpu/test_launch_cuda.py tests/gpu/test_bench_cuda.py tests/gpu/test_moe_block_cuda.py tests/gpu/test_fp8_primary_cuda.py" \
	tests/kernels/gemm tests/kernels/quantize "tests/kernels --ignore=tests/kernels/gemm --ignore=tests/kernels/quantize" \
	"tests/ops/test_chunks.py tests/ops/test_padding.py tests/ops/test_dispatch.py tests/ops/test_routing_inputs.py tests/ops/test_permutation.py tests/ops/test_splits.py" \
	"tests/ops tests/test_recipes.py --ignore=tests/ops/test_chunks.py --ignore=tests/ops/test_padding.py --ignore=tests/ops/test_dispatch.py --ignore=tests/ops/test_routing_inputs.py --ignore=tests/ops/test_permutation.py --ignore=tests/ops/test_splits.py"
GPU_TEST_LOGS ?= /tmp/grouped_linear-test-gpu

test-gpu:
	@mkdir -p $(GPU_TEST_LOGS); rm -f $(GPU_TEST_LOGS)/*.log; status=0; pids=""; i=0; \
	for group in $(GPU_TEST_GROUPS); do \
		i=$$((i + 1)); \
		$(PYTHON) -m pytest -q -rf --durations=8 -p no:cacheprovider $$group > $(GPU_TEST_LOGS)/$$i.log 2>&1 & \
		pids="$$pids $$!"; \
	done; \
	for pid in $$pids; do wait $$pid || status=1; done; \
	for log in $(GPU_TEST_LOGS)/*.log; do echo "== $$log"; grep -E "^(FAILED|ERROR)|passed|failed" $$log | tail -n 20; done; \
	exit $$status

bench:
	$(PYTHON) -m grouped_linear bench
	$(PYTHON) -m grouped_linear bench --suite layouts
	$(PYTHON) -m grouped_linear bench --suite moe
	$(PYTHON) -m grouped_linear bench --suite fine

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
