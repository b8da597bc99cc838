# Quick start: `make demo` (set up, then tune the built-in gpt workload) and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch; a machine that already has torch (a GPU runner) keeps its own.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.mbtune-installed
# Test workers: each test file runs whole on one worker (its module fixtures are built once).
TEST_WORKERS ?= 2

.PHONY: setup demo lint test test-fast test-not-slow bench clean docs

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/mbtune tune --workload gpt --device auto --memory-budget 512MiB --steps 2 --lr 3e-4 --reference-batch 256

lint: $(STAMP)
	$(BIN)/ruff check mbtune tests bench
	$(BIN)/mypy mbtune

test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# The inner loop: the unit tier alone (pure, in-process, under a minute); `make test` runs the whole suite.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests/unit

# Everything but the `slow` tests (two-node torchrun, hung ranks, the longest faults).
test-not-slow: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow"

bench: $(STAMP)
	$(BIN)/python bench/probe.py
	$(BIN)/python bench/command_probe.py
	$(BIN)/python bench/sweep.py
	$(BIN)/python bench/plan.py
	$(BIN)/python bench/qualify.py
	$(BIN)/python bench/faults.py
	$(BIN)/python bench/torchrun.py
	$(BIN)/python bench/serve.py

docs: $(STAMP)
	$(BIN)/python docs/generate_cli_reference.py

clean:
	rm -rf $(VENV) build *.egg-info
