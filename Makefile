# Each target makes its own virtual environment, so these work on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
SOURCES := pyproject.toml setup.py $(wildcard src/kvqueue/*)

.PHONY: test bench bench-engine lint memcheck clean

$(VENV)/.ready: $(SOURCES)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q ".[test,lint]"
	touch $@

# The suite runs against the installed package, never against src/.
test: $(VENV)/.ready
	$(PY) -c "import kvqueue, sys; print(sys.version.split()[0], kvqueue.IMPLEMENTATION)"
	$(PY) -m pytest $(PYTEST_ARGS)

lint: $(VENV)/.ready
	$(PY) -m ruff check src tests bench
	$(PY) -m ruff format --check src tests bench
	$(PY) -m mypy
	PATH="$(VENV)/bin:$$PATH" cython-lint src/kvqueue/_queue.pyx

# The bench extra (matplotlib) draws the chart beside the table.
$(VENV)/.bench-ready: $(VENV)/.ready
	$(PY) -m pip install -q ".[bench]"
	touch $@

bench: $(VENV)/.bench-ready
	$(PY) bench/run.py $(BENCH_ARGS)

# vLLM's real block pool driven by a serving trace, once per queue.
bench-engine: $(VENV)/.ready
	$(PY) bench/engine.py $(BENCH_ARGS)

# The compiled twin under AddressSanitizer and valgrind (MEMCHECK_ARGS=--full: whole suite).
memcheck: $(VENV)/.ready
	bash tools/memcheck.sh $(MEMCHECK_ARGS)

clean:
	rm -rf .venv* build dist src/*.egg-info src/kvqueue/*.so src/kvqueue/*.c src/kvqueue/*.h
