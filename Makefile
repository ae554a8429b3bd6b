# Entry points, all working on a fresh machine with only Python and pip:
#   make demo   -- create .venv if missing, install pdjax, run the quick start experiment
#   make test   -- same venv, run the test suite (2 workers, each with 8 simulated CPU devices)
#   make test-loaded -- the same suite while a busy loop per core competes for the CPU (must stay green)
#   make docs   -- regenerate docs/api.md, docs/reproductions.md and docs/figures/*.png
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test test-loaded bench docs clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

demo: $(VENV)/.installed
	$(PY) -m pdjax run quickstart

test: $(VENV)/.installed
	$(PY) -m pytest -q -n 2 --dist loadfile

test-loaded: $(VENV)/.installed
	$(PY) scripts/loaded.py -- $(PY) -m pytest -q -n 2 --dist loadfile

bench: $(VENV)/.installed
	for b in benchmarks/*.py; do $(PY) $$b || exit 1; done

docs: $(VENV)/.installed
	$(PY) docs/make_api.py
	$(PY) docs/make_reproductions.py
	$(PY) docs/figures/make_figures.py

clean:
	rm -rf runs .jax_cache
