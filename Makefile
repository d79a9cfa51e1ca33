# caliban-drain: `make demo` and `make test` from a fresh clone; everything else is optional.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
PYTEST_ARGS ?=
# The suite runs on this many pytest-xdist workers, one module per worker at a time
# (module fixtures start whole stacks); tests/conftest.py gives every worker but the first
# its own Redis, PostgreSQL database and temp dir. PYTEST_WORKERS=0 runs it in one process.
PYTEST_WORKERS ?= 2

.PHONY: env demo test check lint typecheck pytest services bench bench-quick clean

$(STAMP): pyproject.toml
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "caliban-drain needs Python 3.11+"'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev,test,lint]'
	touch $(STAMP)

env: $(STAMP)

demo: env
	$(VENV)/bin/drainctl demo

services:
	bash scripts/ensure-services.sh

lint: env
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: env
	$(VENV)/bin/mypy

pytest: env services
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile --durations=25 $(PYTEST_ARGS)

check: lint typecheck

# Everything CI runs, in order: check, pytest, compose-test, bench-test. The compose
# test's engine and images are made ready while the suite runs (scripts/test-all.sh).
test: env services
	MAKE="$(MAKE)" PY="$(PY)" bash scripts/test-all.sh

bench: env services
	$(PY) -m bench --write

bench-quick: env services
	$(PY) -m bench --quick

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache

# docker-compose.yml run for real (tests/compose): the engine installed and started by
# scripts/docker-engine.sh when missing (and stopped again if it started it), the images
# built from Debian's packages and cached by content hash. `make test` runs it after the
# suite.
.PHONY: compose-test
compose-test: env
	bash scripts/docker-engine.sh run -- $(PY) -m pytest -m compose --durations=0 tests/compose $(PYTEST_ARGS)

# tests/integration/test_bench_quick.py: the quick benchmark run, checked. Alone, after the
# suite: its scenarios measure, and beside the suite's load they took twice as long.
.PHONY: bench-test
bench-test: env services
	$(PY) -m pytest -m bench --durations=0 tests/integration/test_bench_quick.py $(PYTEST_ARGS)
