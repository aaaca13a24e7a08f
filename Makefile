# mxflux developer entry points. Everything is installed into .venv by `make setup`;
# nothing needs to be installed by hand.
#
#   make run    set up, then run the default job (`mxflux train`: tiny MXFP6 Flux on the demo dataset)
#   make test   set up, then run the test suite

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# Pinned and installed first on its own: pip then sees torch>=2.11 as satisfied and does not
# replace it with a multi-GB CUDA build when it resolves the package's dependencies.
TORCH  := torch==2.13.0

.PHONY: setup run test clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install $(TORCH)
	$(BIN)/pip install -e '.[test]'
	touch $@

run: setup
	$(BIN)/mxflux train

test: setup
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .hypothesis
