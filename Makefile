# Every target builds .venv from scratch if missing, pinned by constraints.txt.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test demo bench gpu-check lint docs install clean

$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -c constraints.txt -e '.[test,demo,lint,docs]'
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

demo: $(STAMP)
	$(BIN)/python examples/demo.py $(DEMO)

lint: $(STAMP)
	$(BIN)/ruff check src tests bench examples
	$(BIN)/mypy

# The documentation site (docs/, Sphinx + MyST) into docs/_build/html; any warning fails the build.
docs: $(STAMP)
	$(BIN)/sphinx-build -W --keep-going -q -b html docs docs/_build/html
	@echo "docs: docs/_build/html/index.html"

bench: $(STAMP)
	$(BIN)/python bench/run_all.py $(BENCH)

# Every CUDA-only test and the GPU step-time benchmark, one table and bench/out/gpu_check.json (docs/performance.md);
# without CUDA it lists what it would run and exits 0.
gpu-check: $(STAMP)
	$(BIN)/python bench/gpu_check.py $(GPU_CHECK)

clean:
	rm -rf $(VENV) build src/*.egg-info docs/_build docs/api
