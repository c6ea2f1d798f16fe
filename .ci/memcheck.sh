#!/usr/bin/env bash
# Memory checks of the compiled twin, both with PYTHONMALLOC=malloc so that
# every object is a malloc block the tools can see:
#   1. AddressSanitizer: the extension built with -fsanitize=address (gcc's
#      runtime, preloaded into the uninstrumented interpreter); the whole test
#      suite, fuzz programs included, under python -X dev. Then the fuzz
#      programs alone with LeakSanitizer on.
#   2. valgrind memcheck on the normal build: the fuzz programs, the hostile
#      cases and the invalid-operation tests under both misuse policies
#      (--full: the whole suite).
# Findings (.ci/memcheck_report.py): any invalid read/write/free, any leak
# whose allocation stack passes through kvqueue. Logs stay in build/memcheck/.
#
# Usage: make memcheck [MEMCHECK_ARGS=--full]   (default: the short run CI does; 16 min on
#        CPython 3.13, 14-17 on 3.12, 7 on 3.11, 13 on 3.10, on 2 cores busy with other work)
#        VENV=DIR bash .ci/memcheck.sh [--full]   (default VENV: .venv-memcheck)
set -euo pipefail
cd "$(dirname "$0")/.."

full=0
[[ "${1:-}" == "--full" ]] && full=1
VENV="${VENV:-.venv-memcheck}"
PY="$VENV/bin/python"
out="$PWD/build/memcheck"  # absolute paths: some steps run from tests/
supp="$PWD/.ci/valgrind.supp"
logs="$out/logs"

install() {  # Debian packages (CI runs as root)
    [[ -n "${apt_updated:-}" ]] || { apt-get update -qq; apt_updated=1; }
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}
command -v gcc >/dev/null || install gcc
command -v valgrind >/dev/null || install valgrind
libasan="$(gcc -print-file-name=libasan.so)"  # gcc's own runtime: no clang needed
if [[ ! -e "$libasan" ]]; then
    install libasan8
    libasan="$(ldconfig -p | awk '/libasan\.so/ {print $NF; exit}')"
fi

make -s "$VENV/.ready" PYTHON="${PYTHON:-python3}" VENV="$VENV"
# setup.py runs here outside pip's isolated build: give it the build requirements.
"$PY" -m pip install -q $("$PY" .ci/build_requires.py)
rm -rf "$out" && mkdir -p "$logs"
# A step that fails says so in one line, not only in make's "Error 1".
step="the build"
trap 'rc=$?; ((rc == 0)) || echo "memcheck: failed (exit $rc) in $step; logs: ${logs#"$PWD"/}" >&2' EXIT
build() {  # $1: the directory to build the extension into; CFLAGS etc. from the caller
    "$PY" setup.py -q build_ext --build-lib "$out/$1" --build-temp "$out/$1-tmp" \
        >"$out/$1-build.log" 2>&1 || { cat "$out/$1-build.log"; exit 1; }
    (cd src && find kvqueue \( -name '*.py' -o -name '*.pyi' -o -name py.typed \) \
        -exec cp --parents {} "$out/$1/" \;)
}

section() { step="$1"; printf '== %s (%s)\n' "$1" "$(date -u +%H:%M:%S)"; }

# The fuzz programs as the suite runs them, fewer operations under valgrind.
fuzz_runs() {  # $1: operations per program
    for twin in cython python; do
        echo "isolated.fuzz_chaos $twin 0 $1"
        echo "isolated.fuzz_reentrant $twin 0 $1"
        echo "isolated.fuzz_guard $twin 0 $1"
    done
    echo "isolated.fuzz_diff cython 0 $1"
    echo "isolated.guard_switch $1"
}

section "AddressSanitizer build"
CFLAGS="-fsanitize=address -fno-omit-frame-pointer -O1 -g" LDFLAGS="-fsanitize=address" \
    build asan
asan() {  # $1: extra ASAN_OPTIONS; the rest: a command, run against the sanitized build
    PYTHONPATH="$out/asan" PYTHONMALLOC=malloc LD_PRELOAD="$libasan" \
        ASAN_OPTIONS="log_path=$logs/asan.log:$1" "${@:2}"
}
# Leaks off: CPython 3.12 and 3.13 leak at exit on their own (python -c pass fails with them).
(cd tests && asan detect_leaks=0 "../$PY" -c 'import kvqueue._queue as q; assert "/asan/" in q.__file__')

section "the test suite under AddressSanitizer (python -X dev)"
asan detect_leaks=0 "$PY" -X dev -m pytest -q -p no:cacheprovider tests

section "fuzz programs under LeakSanitizer"
while read -r program args; do
    # Leaks fail no run here (the interpreter has its own at exit): the report
    # sorts them. Any other finding is in the log too.
    (cd tests && asan detect_leaks=1:exitcode=0 "../$PY" -m "$program" $args >/dev/null)
done < <(fuzz_runs $((full ? 20000 : 3000)))

section "valgrind memcheck"
build plain
vg() {  # subprocesses (the hostile cases) are followed too
    PYTHONPATH="$out/plain" PYTHONMALLOC=malloc valgrind --tool=memcheck --quiet \
        --suppressions="$supp" \
        --trace-children=yes --leak-check=full --show-leak-kinds=definite \
        --num-callers=40 --log-file="$logs/valgrind.%p.log" "$@"
}
while read -r program args; do
    (cd tests && vg "../$PY" -m "$program" $args >/dev/null)
done < <(fuzz_runs $((full ? 3000 : 400)))
if ((full)); then
    vg "$PY" -m pytest -q -p no:cacheprovider tests
else
    vg "$PY" -m pytest -q -p no:cacheprovider -m cython \
        tests/test_invalid.py tests/test_policy.py::test_invalid_operation_under_each_policy \
        tests/test_hostile.py tests/test_screen.py tests/test_pool_guard.py
fi

section "findings"
"$PY" .ci/memcheck_report.py "$logs"
