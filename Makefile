# Set-up and checks. `make demo` and `make test` create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint test-gpu bench clean

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

# On a CUDA machine whose python3 already has torch and triton (no venv, no installs).
test-gpu:
	$(PYTHON) -m pytest -q -p no:cacheprovider tests
	$(PYTHON) -m grouped_linear bench

bench:
	$(PYTHON) -m grouped_linear bench

clean:
	rm -rf $(VENV) build *.egg-info
