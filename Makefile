# Two commands set everything up on a fresh machine: `make run` and `make test`.
PY ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# Debian packages features need (dashboard browser tests, PostgreSQL store tests, the gateway's
# executor sandbox, containers, MPIJobs with real OpenMPI); tests that cannot have them skip with a clear reason.
SYSTEM_PACKAGES ?= chromium chromium-driver postgresql bubblewrap iproute2 podman runc docker-registry openmpi-bin libopenmpi-dev

FLOWER_VENV ?= .venv-flower
FLOWER ?= flwr==1.42.0

.PHONY: run test install flower-env system-deps sandbox-deps testbed-deps k8s-deps k8s-deps-background lint typecheck bench screenshots clean

$(BIN)/python:
	@command -v $(PY) >/dev/null 2>&1 || { echo "error: $(PY) not found; install Python 3.11 or run 'make PY=/path/to/python3.11 ...'" >&2; exit 2; }
	@echo "==> [1/3] creating the virtualenv $(VENV)"
	@$(PY) -m venv $(VENV)
	@$(BIN)/pip install --quiet --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	@echo "==> [2/3] installing Trainmaster with every extra and the test tools into $(VENV) (a few minutes the first time)"
	@$(BIN)/pip install --progress-bar on -e '.[all,test]' 2>&1 | tee $(VENV)/install.log | grep -E --line-buffered '^(Collecting|Successfully installed)' | sed -u 's/^/    /' || true
	@$(BIN)/python -c "import trainmaster, torch, fastapi" || { echo "error: the install did not complete; pip's whole output is in $(VENV)/install.log" >&2; exit 1; }
	@touch $(STAMP)

install: $(STAMP)

## system-deps: install the Debian packages listed in SYSTEM_PACKAGES (root with apt-get); else say what is missing
system-deps:
	@missing=$$(for p in $(SYSTEM_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing system packages: $$missing"; \
		(apt-get -o DPkg::Lock::Timeout=600 install -y -q $$missing >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get -o DPkg::Lock::Timeout=600 install -y -q $$missing >/dev/null; }) \
		|| echo "warning: could not install $$missing; the tests that need them will skip"; \
	else echo "note: not installing $$missing (needs root and apt-get); the tests that need them will skip"; fi

## run: create the venv, install, and run the main job (distributed PyTorch on the digits data)
run: $(STAMP)
	@echo "==> [3/3] running examples/pytorch-digits.yaml (distributed PyTorch: a master and 2 workers)"
	@$(BIN)/trainmaster run examples/pytorch-digits.yaml
	@echo ""
	@echo "Next:"
	@echo "  $(BIN)/trainmaster server                  # the controller service; dashboard at http://127.0.0.1:8642/"
	@echo "  $(BIN)/trainmaster job list                 # every job run here, with its state"
	@echo "  $(BIN)/trainmaster info                     # where outputs, logs and the store live"
	@echo "  docs/controller.md                          # the job file reference; docs/ has a page per capability"

## sandbox-deps: only bubblewrap, for the gateway's sandboxed executors (parties need it or isolation: process)
sandbox-deps:
	@$(MAKE) --no-print-directory system-deps SYSTEM_PACKAGES=bubblewrap

## testbed-deps: only iproute2 (ip, tc), for `trainmaster testbed` (needs root; without it its tests skip)
testbed-deps:
	@$(MAKE) --no-print-directory system-deps SYSTEM_PACKAGES=iproute2

## k8s-deps: build the Kubernetes binaries `trainmaster cluster up` runs, once, into $(K8S_CACHE) (Debian's
## source package; ~8 minutes on 2 cores; reused when built); says plainly why it could not (no deb-src, not root)
K8S_CACHE ?= /var/cache/trainmaster
K8S_BUILD_LOG ?= $(K8S_CACHE)/kubernetes-build.log
k8s-deps:
	@TM_K8S_CACHE=$(K8S_CACHE) bash trainmaster/cluster/build-kubernetes.sh || [ $$? = 3 ]

## k8s-deps-background: the same at the lowest priority, in the background (`make test` starts it first; the
## Kubernetes tests run last and wait for it: tests/kubernetes/conftest.py)
k8s-deps-background:
	@mkdir -p $(K8S_CACHE) 2>/dev/null; \
	if ls $(K8S_CACHE)/kubernetes-*/.built-r2 >/dev/null 2>&1; then exit 0; fi; \
	echo "==> building Kubernetes in the background (log: $(K8S_BUILD_LOG)); its tests run last"; \
	TM_K8S_CACHE=$(K8S_CACHE) nohup nice -n 19 bash trainmaster/cluster/build-kubernetes.sh >$(K8S_BUILD_LOG) 2>&1 </dev/null &

## test: install with test extras and run the whole suite (then the Flower tests in their own venv)
test: k8s-deps-background $(STAMP) system-deps lint typecheck flower-env
	$(BIN)/python tools/run_tests.py -q --durations=25
	@if [ -x $(FLOWER_VENV)/bin/python ]; then \
		echo "==> the Flower adapter's tests, in $(FLOWER_VENV) (flwr pins older fastapi/typer/ray than ours)"; \
		$(FLOWER_VENV)/bin/python tools/run_tests.py -q -p no:cacheprovider tests/flsched/test_flsched_flower.py; \
	else echo "note: $(FLOWER_VENV) is missing (no network?); the Flower adapter's tests were skipped"; fi

## flower-env: a venv for flwr beside ours: its own pinned packages first, then everything of .venv
## (torch, numpy, trainmaster, from any directory: the .pth adds .venv's site-packages as a site dir, so its
## editable-install hook runs too); flwr is not a dependency of trainmaster
flower-env: $(FLOWER_VENV)/.installed
$(FLOWER_VENV)/.installed: $(STAMP)
	@echo "==> creating $(FLOWER_VENV) with $(FLOWER) (once; a few minutes)"
	@rm -rf $(FLOWER_VENV) && $(PY) -m venv $(FLOWER_VENV)
	@$(FLOWER_VENV)/bin/python -c "import site, sys; open(site.getsitepackages()[0] + '/trainmaster-venv.pth', 'w').write('import site; site.addsitedir(%r)\\n' % sys.argv[1])" \
		"$$($(BIN)/python -c 'import site; print(site.getsitepackages()[0])')"
	@$(FLOWER_VENV)/bin/pip install --quiet '$(FLOWER)' pytest pytest-timeout \
		&& touch $@ || { echo "warning: could not install $(FLOWER); the Flower tests will skip"; rm -rf $(FLOWER_VENV); }

## lint: ruff (pyflakes rules: unused and undefined names) and ruff's formatter over the package, tests,
## benchmarks and tools (`$(BIN)/ruff format trainmaster tests bench tools` formats them), then the import
## layers (tools/layers.py: no import up a layer, no cycle; `$(BIN)/python tools/layers.py` prints them)
lint: $(STAMP)
	$(BIN)/ruff check trainmaster tests bench tools
	$(BIN)/ruff format --check trainmaster tests bench tools
	$(BIN)/python tools/layers.py --quiet

## typecheck: mypy over the controller's layers and the node agent (the files in pyproject's [tool.mypy])
typecheck: $(STAMP)
	$(BIN)/python -m mypy

## bench: run every benchmark (writes bench/results/*.json and *.md)
bench: $(STAMP)
	$(BIN)/pip install --quiet -e '.[bench]'
	$(BIN)/pip install --quiet --no-deps 'torchx>=0.7,<0.8'
	for b in bench/*.py; do $(BIN)/python $$b || exit 1; done

## screenshots: refresh the dashboard screenshots in docs/images/ (taken by the browser tests)
screenshots: $(STAMP) system-deps
	TM_DASHBOARD_SCREENSHOTS=docs/images $(BIN)/python -m pytest -q tests/service/test_dashboard_browser.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
