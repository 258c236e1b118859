# Two commands set everything up on a fresh machine:
#   make run    create .venv, install kvlm, fetch the default model, answer a chat message
#   make test   create .venv, install kvlm with its test extras, run the whole test suite
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
CHAT ?= What is a KV cache, in two sentences?

.PHONY: run test bench-deps browser

run: $(VENV)/.installed
	$(BIN)/kvlm generate --chat "$(CHAT)" --max-tokens 128

test: $(VENV)/.installed-test browser
	$(BIN)/python -m pytest -q

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
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.installed-test: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -e '.[test]'
	touch $@ $(VENV)/.installed
