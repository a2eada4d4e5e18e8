# Every target builds .venv from scratch if missing, pinned by constraints.txt.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test demo bench lint install clean

$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -c constraints.txt -e '.[test,demo,lint]'
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

demo: $(STAMP)
	$(BIN)/python examples/demo.py $(DEMO)

lint: $(STAMP)
	$(BIN)/ruff check src tests bench examples
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/python bench/run_all.py $(BENCH)

clean:
	rm -rf $(VENV) build src/*.egg-info
