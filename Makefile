# Two entry points, both working on a fresh machine with only Python and pip:
#   make demo   -- create .venv if missing, install pdjax, run the quick start experiment
#   make test   -- same venv, run the test suite (8 simulated CPU devices)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test bench clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

demo: $(VENV)/.installed
	$(PY) -m pdjax run experiments/quickstart.toml

test: $(VENV)/.installed
	$(PY) -m pytest -q

bench: $(VENV)/.installed
	for b in benchmarks/*.py; do $(PY) $$b || exit 1; done

clean:
	rm -rf runs .jax_cache
