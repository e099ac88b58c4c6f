# Every target creates .venv when it is missing (or when pyproject.toml changed).
# `make demo` installs only what the demo needs (the daemon and its uploader); `make test` adds torch
# and the frameworks. The demo uses torch when it is there, a pure-Python model if not.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
SERVER := $(VENV)/.installed-server
ALL    := $(VENV)/.installed-all

.PHONY: demo test lint bench clean

$(SERVER): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[server,upload]"
	touch $(SERVER)

$(ALL): $(SERVER)
	# torch 2.13.0 first: on these machines pip takes its CPU build from local disk, so the
	# framework extras find torch installed and do not pull a CUDA build.
	$(BIN)/python -m pip install --quiet "torch==2.13.0"
	$(BIN)/python -m pip install --quiet -e ".[server,upload,test,frameworks,simulate,dev]"
	touch $(ALL)

demo: $(SERVER)
	$(BIN)/esi-sidecar demo

test: $(ALL)
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m pytest -q

lint: $(ALL)
	$(BIN)/ruff check sidecar tests benchmarks examples
	$(BIN)/mypy

bench: $(ALL)
	$(BIN)/python -m benchmarks

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
