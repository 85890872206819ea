# Two commands set everything up on a fresh machine: `make run` and `make test`.
PY ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test install bench clean sandbox-deps

$(BIN)/python:
	@command -v $(PY) >/dev/null 2>&1 || { echo "error: $(PY) not found; install Python 3.11 or run 'make PY=/path/to/python3.11 ...'" >&2; exit 2; }
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet -e '.[test,ray]'
	@touch $(STAMP)

install: $(STAMP)

## run: create the venv, install, and run the main job (distributed PyTorch on the digits data)
run: $(STAMP)
	$(BIN)/trainmaster run examples/pytorch-digits.yaml

## sandbox-deps: bubblewrap for the gateway's sandboxed executors (Debian; needs root, else the sandbox tests skip)
sandbox-deps:
	@command -v bwrap >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
		{ apt-get install -y -q bubblewrap || { apt-get update -q && apt-get install -y -q bubblewrap; }; } || \
		echo "note: bubblewrap not installed; gateway sandbox tests will skip and parties need isolation: process" >&2; }

## test: install with test extras and run the whole suite
test: $(STAMP) sandbox-deps
	$(BIN)/python -m pytest -q

## bench: run every benchmark (writes bench/results/*.json and *.md)
bench: $(STAMP)
	$(BIN)/pip install --quiet -e '.[bench]'
	for b in bench/*.py; do $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
