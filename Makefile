# Two commands set everything up on a fresh machine:
#   make run    create .venv, install kvlm (and build its kernels for this CPU), fetch the default model, answer a chat message
#   make test   create .venv, install kvlm with its test extras, run the whole test suite
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
CHAT ?= What is a KV cache, in two sentences?
# kvlm runs on torch 2.11 or newer (a CUDA build where one is installed is kept); a fresh venv here gets this CPU
# build first, so that pip does not pull a newer, multi-GB CUDA one
TORCH ?= torch==2.13.0

.PHONY: run test bench-deps browser compiler

run: $(VENV)/.installed
	$(BIN)/kvlm generate --chat "$(CHAT)" --max-tokens 128

test: compiler $(VENV)/.installed-test browser
	$(BIN)/python -m pytest -q --durations=25

# kvlm's kernels are C++ built for this CPU (kvlm/kernels): g++ from Debian when missing and we are root. Without a
# compiler kvlm still runs (dense weights) and the kernel tests are skipped.
compiler:
	@command -v g++ >/dev/null || command -v c++ >/dev/null || command -v clang++ >/dev/null || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++ >/dev/null; } || \
	  echo "no C++ compiler could be installed: kvlm will run with dense weights, its kernel tests skipped"

# The live KV view is checked in headless Chromium: Debian's package, installed when missing and we are root.
browser:
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } || \
	  echo "no Chromium could be installed: the browser test of /kv/view will be skipped"

bench-deps: $(VENV)/.installed-test
	$(BIN)/pip install -q -e '.[bench]'

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e .
	$(BIN)/python -m kvlm.kernels.native || true
	touch $@

$(VENV)/.installed-test: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/python -m kvlm.kernels.native || true
	touch $@ $(VENV)/.installed
