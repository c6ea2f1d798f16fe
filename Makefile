# Each target makes its own virtual environment, so these work on a fresh machine:
# $(VENV) holds kvqueue with its test and lint extras (test, lint, memcheck), and
# $(BENCH_VENV) kvqueue with the bench extra only (bench, bench-engine, engine-check).
PYTHON ?= python3
VENV ?= .venv
BENCH_VENV ?= .venv-bench
PY := $(VENV)/bin/python
BENCH_PY := $(BENCH_VENV)/bin/python
# What an install is built from. Not the _queue.c that every build writes into
# src/: with it, each install would make the next one stale.
SOURCES := pyproject.toml setup.py src/kvqueue/py.typed \
	$(wildcard src/kvqueue/*.py src/kvqueue/*.pyi src/kvqueue/*.pyx src/kvqueue/*.pxd src/kvqueue/*.h)

.PHONY: test bench bench-engine bench-scheduler engine-check lint memcheck py314 vllm-tests clean

$(VENV)/.ready: $(SOURCES)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q ".[test,lint]"
	touch $@

# The bench extra (matplotlib) draws the chart beside the table.
$(BENCH_VENV)/.ready: $(SOURCES)
	$(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_PY) -m pip install -q --upgrade pip
	$(BENCH_PY) -m pip install -q ".[bench]"
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

bench: $(BENCH_VENV)/.ready
	$(BENCH_PY) bench/run.py $(BENCH_ARGS)

# vLLM's real block pool driven by a serving trace: the same steps with each twin
# as with vLLM's own queue (fetches the vLLM 0.33.0 and 0.30.0 wheels once, about
# 340 MB each; ENGINE_CHECK_ARGS="--versions 0.33.0" for one).
engine-check: $(BENCH_VENV)/.ready
	$(BENCH_PY) bench/engine_check.py $(ENGINE_CHECK_ARGS)

# The same pool timed, once per queue, after the check.
bench-engine: engine-check
	$(BENCH_PY) bench/engine.py $(BENCH_ARGS)

# vLLM 0.33.0's own Scheduler on the CPU, once per queue, in the vLLM venv of
# vllm_tests/venv.sh (built once, kvqueue reinstalled when its sources change).
bench-scheduler:
	venv=$$(bash vllm_tests/venv.sh) && "$$venv/bin/python" bench/scheduler.py $(BENCH_ARGS)

# vLLM 0.33.0's own tests three ways: its queue, kvqueue's twins (vllm_tests/run.py;
# VLLM_TESTS_ARGS=--quick: three suites), then kvqueue's tests against the real vLLM.
vllm-tests:
	venv=$$(bash vllm_tests/venv.sh) \
	    && "$$venv/bin/python" vllm_tests/run.py $(VLLM_TESTS_ARGS) \
	    && "$$venv/bin/python" -m pytest -p no:cacheprovider -p no:asyncio vllm_tests

# The compiled twin under AddressSanitizer and valgrind (MEMCHECK_ARGS=--full: whole suite).
memcheck: $(VENV)/.ready
	bash tools/memcheck.sh $(MEMCHECK_ARGS)

# The wheel, the whole suite and bench --quick on Debian unstable's CPython 3.14 (root only).
py314:
	bash .ci/py314.sh

clean:
	rm -rf .venv* build dist src/*.egg-info src/kvqueue/*.so src/kvqueue/_queue.c
