# Two commands: `make up` starts the local stack, `make test` runs the whole suite.
# Both build .venv first (Python >= 3.11) and reinstall when pyproject.toml changes.
PYTHON ?= $(shell for p in python3.13 python3.12 python3.11 python3; do \
	command -v $$p >/dev/null && $$p -c 'import sys; sys.exit(sys.version_info < (3, 11))' && echo $$p && break; done)
VENV := .venv
BIN := $(VENV)/bin

.PHONY: up test

$(BIN)/.installed: pyproject.toml
	@test -n "$(PYTHON)" || { echo "ampd needs Python >= 3.11 (python3.11 or newer on PATH)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	@touch $@

up: $(BIN)/.installed
	$(BIN)/ampd up

test: $(BIN)/.installed
	$(BIN)/pytest
