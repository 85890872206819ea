# Two commands set everything up on a fresh machine: `make run` and `make test`.
PY ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test install bench clean testbed-deps

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

## testbed-deps: iproute2 (ip, tc) for `trainmaster testbed`; without root its tests skip
testbed-deps:
	@command -v ip >/dev/null 2>&1 && command -v tc >/dev/null 2>&1 || \
	  { [ "$$(id -u)" = 0 ] && apt-get install -y iproute2; } || \
	  echo "note: iproute2 is missing and cannot be installed (not root): testbed tests will skip"

## test: install with test extras and run the whole suite
test: $(STAMP) testbed-deps
	$(BIN)/python -m pytest -q

## bench: run every benchmark (writes bench/results/*.json and *.md)
bench: $(STAMP)
	$(BIN)/pip install --quiet -e '.[bench]'
	for b in bench/*.py; do $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
