# Two commands set everything up on a fresh machine:
#   make run    create .venv, install kvlm, fetch the default model, answer a chat message
#   make test   create .venv, install kvlm with its test extras, run the whole test suite
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
CHAT ?= What is a KV cache, in two sentences?

.PHONY: run test bench-deps

run: $(VENV)/.installed
	$(BIN)/kvlm generate --chat "$(CHAT)" --max-tokens 128

test: $(VENV)/.installed-test
	$(BIN)/python -m pytest -q

bench-deps: $(VENV)/.installed-test
	$(BIN)/pip install -q -e '.[bench]'

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.installed-test: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -e '.[test]'
	touch $@ $(VENV)/.installed
