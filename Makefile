# Each target makes the virtual environment it needs, so these work on a fresh machine.
#
#   make test             the suite, both twins, against kvqueue installed into .venv-<python>
#                         (the test extra: pytest, hypothesis); PYTHON=python3.13 make test runs
#                         3.13 in its own .venv-cpython-3.13.x (pyenv's 3.13 if it is not on PATH)
#   make lint             ruff, mypy, cython-lint, actionlint (the lint extra): .venv-lint-<python>
#   make bench            the microbenchmark (bench/run.py; BENCH_ARGS=--quick: under a minute)
#   make bench-screens    the guard's compiled screen against a baseline (bench/screens.py)
#   make bench-audit      the holder audit's screen by blocks listed, both twins (bench/audit.py),
#                         then kvqueue's cost on vLLM's scheduler by cache size (bench/scale.py)
#   make bench-scheduler  vLLM's own scheduler per queue and pool guard (bench/scheduler.py)
#   make bench-engine     a live vLLM engine's throughput per queue (bench/throughput.py)
#   make vllm-tests       vLLM's own suites three ways, then vllm_tests/ against the real vLLM
#                         (VLLM=0.31.0 or VLLM=0.31: another line of src/kvqueue/vllm/_lines.py)
#   make vllm-matrix      make vllm-tests for every line of that table (VLLM_MATRIX=--ci: CI's)
#   make vllm-line-check VLLM=0.35.0
#                         a release's wheel against the table: the row to add, or what differs;
#                         a row already: its suites three ways (vllm_tests/line_check.py)
#   make demo             a double free in a live vLLM engine: vLLM alone, kvqueue raise, repair
#                         (VLLM=0.31.0: on that vLLM line; examples/demo.py)
#   make memcheck         the compiled twin under AddressSanitizer and valgrind (7-17 min)
#   make py314            the wheel and the suite on Debian unstable's CPython 3.14 (root)
#   make clean
#
# bench-scheduler and vllm-tests always run $(PYTHON311) (default python3.11, whatever PYTHON
# says), in the vLLM venv of vllm_tests/venv.sh, for the vLLM release vllm_tests/vllm.env pins;
# another line's Python is laid over that venv (vllm_tests/lines.py).
# Downloads and that venv live under one cache root: $KVQUEUE_CI_CACHE, default
# ~/.cache/kvqueue (.ci/common.sh). .ci/run runs everything CI runs.
include vllm_tests/vllm.env

PYTHON ?= python3
PYTHON311 ?= python3.11
# Under pyenv, python3.13 is a shim that runs only where 3.13 is a selected version: a PYTHON
# that does not run is looked for among pyenv's versions (the newest 3.13.x has python3.13).
ifeq ($(shell $(PYTHON) -c pass 2>/dev/null && echo runs),)
PYENV_NAME := $(notdir $(PYTHON))
PYENV_GLOB := "$$(pyenv root 2>/dev/null)"/versions/$(PYENV_NAME:python%=%).*/bin/$(PYENV_NAME)
PYENV_PYTHON := $(shell ls -d $(PYENV_GLOB) 2>/dev/null | sort -V | tail -n 1)
ifneq ($(PYENV_PYTHON),)
override PYTHON := $(PYENV_PYTHON)
endif
endif
# One venv per interpreter: its implementation and full version name it.
PYTAG := $(or $(shell $(PYTHON) -c 'import sys; print(sys.implementation.name + "-" + ".".join(map(str, sys.version_info[:3])))' 2>/dev/null),no-python)
# A PYTHON that does not run stops the first venv, saying what to set.
NO_PYTHON := make: PYTHON=$(PYTHON) does not run (nor does pyenv have it): set PYTHON to
NO_PYTHON += an interpreter's path
CHECK_PYTHON := $(if $(filter no-python,$(PYTAG)),echo "$(NO_PYTHON)" >&2; exit 1,true)
VENV ?= .venv-$(PYTAG)
LINT_VENV ?= .venv-lint-$(PYTAG)
BENCH_VENV ?= .venv-bench-$(PYTAG)
PY := $(VENV)/bin/python
LINT_PY := $(LINT_VENV)/bin/python
BENCH_PY := $(BENCH_VENV)/bin/python
PIP := -m pip install -q
# What an install is built from. Not the C that every build writes into src/
# (_queue.c, vllm/_screen.c): with it, each install would make the next one stale.
SOURCES := pyproject.toml setup.py src/kvqueue/py.typed \
	$(wildcard $(foreach d,src/kvqueue src/kvqueue/vllm,$(d)/*.py $(d)/*.pyi $(d)/*.pyx $(d)/*.h))

.PHONY: test bench bench-screens bench-audit bench-scheduler bench-engine demo lint memcheck py314 vllm-tests vllm-matrix vllm-line-check clean

$(VENV)/.ready: $(SOURCES)
	@$(CHECK_PYTHON)
	$(PYTHON) -m venv --clear $(VENV)
	$(PY) $(PIP) --upgrade pip
	$(PY) $(PIP) ".[test]"
	touch $@

# mypy reads the tests too, so the lint venv has the test extra as well.
$(LINT_VENV)/.ready: $(SOURCES)
	@$(CHECK_PYTHON)
	$(PYTHON) -m venv --clear $(LINT_VENV)
	$(LINT_PY) $(PIP) --upgrade pip
	$(LINT_PY) $(PIP) ".[test,lint]"
	touch $@

# Built without isolation, with the build requirements installed in the venv: the Cython that
# compiled the timed module is then the one the results (and the chart) name.
$(BENCH_VENV)/.ready: $(SOURCES)
	@$(CHECK_PYTHON)
	$(PYTHON) -m venv --clear $(BENCH_VENV)
	$(BENCH_PY) $(PIP) --upgrade pip
	$(BENCH_PY) $(PIP) $$($(BENCH_PY) .ci/build_requires.py)
	$(BENCH_PY) $(PIP) --no-build-isolation ".[bench]"
	touch $@

# The suite runs against the installed package, never against src/.
test: $(VENV)/.ready
	$(PY) -c "import kvqueue, sys; print(sys.version.split()[0], kvqueue.IMPLEMENTATION)"
	$(PY) -m pytest $(PYTEST_ARGS)

lint: $(LINT_VENV)/.ready
	$(LINT_PY) -m ruff check src tests bench examples vllm_tests .ci
	$(LINT_PY) -m ruff format --check src tests bench examples vllm_tests .ci
	$(LINT_PY) -m mypy
	PATH="$(LINT_VENV)/bin:$$PATH" cython-lint src/kvqueue/_queue.pyx src/kvqueue/vllm/_screen.pyx
	$(LINT_VENV)/bin/actionlint .github/workflows/*.yml

# What bench/ takes from vllm_tests/ (sdist: the pin and the fetcher; live: the live engine) it
# imports by this path, which the benchmark's spawned processes inherit.
WITH_VLLM_TESTS := PYTHONPATH=$(CURDIR)/vllm_tests

bench: $(BENCH_VENV)/.ready
	$(WITH_VLLM_TESTS) $(BENCH_PY) bench/run.py $(BENCH_ARGS)

# The pool guard's compiled free-path screen (first_excess), against --baseline REV's build.
bench-screens: $(BENCH_VENV)/.ready
	$(WITH_VLLM_TESTS) $(BENCH_PY) bench/screens.py $(BENCH_ARGS)

# scale.py needs vLLM: it runs in the vLLM venv, as bench-scheduler does.
bench-audit: $(BENCH_VENV)/.ready
	$(WITH_VLLM_TESTS) $(BENCH_PY) bench/audit.py $(BENCH_ARGS)
	venv=$$(PYTHON311=$(PYTHON311) bash vllm_tests/venv.sh) \
	    && $(WITH_VLLM_TESTS) "$$venv/bin/python" bench/scale.py $(BENCH_ARGS)

# vLLM's own Scheduler on the CPU: vLLM's queue, each twin with the pool guard off and on.
bench-scheduler:
	@echo "bench-scheduler: vLLM $(VLLM_VERSION) on $(PYTHON311)"
	venv=$$(PYTHON311=$(PYTHON311) bash vllm_tests/venv.sh) \
	    && $(WITH_VLLM_TESTS) "$$venv/bin/python" bench/scheduler.py $(BENCH_ARGS)

# A live vLLM engine (vllm_tests/live/) serving rounds of requests, per queue: a table of
# medians (BENCH_ARGS="--repeats 1": one run each).
bench-engine:
	venv=$$(PYTHON311=$(PYTHON311) bash vllm_tests/venv.sh) \
	    && $(WITH_VLLM_TESTS) "$$venv/bin/python" bench/throughput.py $(BENCH_ARGS)

# vLLM's own tests three ways: its queue, kvqueue's twins, then kvqueue's tests against the
# real vLLM (vllm_tests/run.py; VLLM_TESTS_ARGS=--quick: three of vLLM's files, and kvqueue's
# tests but the live engines). An older line
# (VLLM=0.31.0) runs its tests/v1/core, then the double-free tests on it (the live engine is
# make demo's).
VLLM ?= $(VLLM_VERSION)
vllm-tests:
	@echo "vllm-tests: vLLM $(VLLM) on $(PYTHON311)"
	venv=$$(PYTHON311=$(PYTHON311) bash vllm_tests/venv.sh) \
	    && "$$venv/bin/python" vllm_tests/run.py --line $(VLLM) $(VLLM_TESTS_ARGS)

# A release on the index, read from its wheel against the lines' table (line_check.py): the row
# to add (exit 1) or what kvqueue's code must learn first (exit 2); once it is a row that its
# wheel agrees with, its suites three ways, as make vllm-tests runs them.
vllm-line-check:
	venv=$$(PYTHON311=$(PYTHON311) bash vllm_tests/venv.sh) \
	    && "$$venv/bin/python" vllm_tests/line_check.py $(VLLM) \
	    && $(MAKE) --no-print-directory vllm-tests VLLM=$(VLLM)

# Every line, each to its end even when one fails; then the table of their results.
VLLM_MATRIX ?= --list
vllm-matrix:
	venv=$$(PYTHON311=$(PYTHON311) bash vllm_tests/venv.sh) && failed= \
	    && for line in $$("$$venv/bin/python" vllm_tests/lines.py $(VLLM_MATRIX)); do \
	        $(MAKE) --no-print-directory vllm-tests VLLM=$$line || failed="$$failed $$line"; done \
	    ; "$$venv/bin/python" vllm_tests/run.py --table \
	    && if [ -n "$$failed" ]; then echo "vllm-matrix: failed on$$failed"; exit 1; fi

# A live vLLM engine on the CPU (vllm_tests/live/), a double free injected in its engine core,
# three ways side by side (DEMO_ARGS=--form B: a free block freed again; --form C: a held
# block in a full pool's free list). VLLM=0.31.0: that release's Python code laid over the
# venv's vLLM (vllm_tests/lines.py); any line of src/kvqueue/vllm/_lines.py.
demo:
	$(PYTHON311) examples/demo.py $(if $(VLLM),--vllm $(VLLM)) $(DEMO_ARGS)

# MEMCHECK_ARGS=--full: the whole suite under both tools.
memcheck: $(VENV)/.ready
	VENV=$(VENV) bash .ci/memcheck.sh $(MEMCHECK_ARGS)

py314:
	bash .ci/py314.sh

clean:
	rm -rf .venv* build dist src/*.egg-info src/kvqueue/*.so src/kvqueue/vllm/*.so src/kvqueue/_queue.c src/kvqueue/vllm/_screen.c
