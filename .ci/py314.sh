#!/usr/bin/env bash
# CPython 3.14: the kvqueue wheel built from the sdist, installed into a fresh
# venv, the whole suite run against it from outside the source tree with the
# compiled twin loaded, then the benchmark's quick mode.
#
# The interpreter is Debian unstable's python3.14 (Debian's own build), in a
# minimal Debian unstable root made by debootstrap and entered with chroot.
# Why not a build from Debian's python3.14 source package: the archive reachable
# here lists that source but answers 404 for its files (binary packages download), and the
# binaries need a newer glibc than this Debian release's, hence a whole root.
# The root is made once (about 2 min, 650 MB) and kept under the cache root
# (.ci/common.sh), so a fresh clone on the same machine reuses it; delete it
# to take a newer python3.14. Nothing inside it reaches the network: the build
# requirements, pytest and hypothesis are downloaded by the host's pip (its own
# configuration) for the root's interpreter and installed from a local folder.
#
# Needs root (debootstrap, chroot, unshare); installs debootstrap if missing.
# Usage: bash .ci/py314.sh      Env: PYTEST_ARGS (extra pytest arguments)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
. "$ROOT/.ci/common.sh"
SID="$CACHE/debian-sid-python3.14"
TOOLS="$CACHE/venvs/sdist-tools"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 DEBIAN_FRONTEND=noninteractive
unset KVQUEUE_PURE

log() { printf '\n== py314: %s (%s)\n' "$*" "$(date -u +%H:%M:%S)" >&2; }
die() { printf 'py314: FAIL: %s\n' "$*" >&2; exit 1; }
[[ $(id -u) == 0 ]] || die "needs root: debootstrap and chroot"

# in_sid [--cd DIR] CMD...: CMD in the root, with a clean environment and pip
# kept off the network, in its own PID and mount namespaces: its /proc goes
# away, and whatever it leaves running is killed, when it ends.
in_sid() {
    local dir=/
    [[ $1 == --cd ]] && { dir=$2; shift 2; }
    unshare --pid --fork --mount-proc="$SID/proc" chroot "$SID" /usr/bin/env -i \
        HOME=/root LANG=C.UTF-8 PATH=/usr/bin:/bin PIP_NO_INDEX=1 PIP_FIND_LINKS=/opt/wheels \
        PIP_DISABLE_PIP_VERSION_CHECK=1 /bin/sh -c 'cd "$0" && exec "$@"' "$dir" "$@"
}

# ------------------------------------------------------------------- the root
if [[ ! -f "$SID/.ready" ]]; then
    if ! command -v debootstrap >/dev/null; then
        log "installing debootstrap"
        apt-get update -qq && apt-get install -y -qq --no-install-recommends debootstrap >/dev/null
    fi
    log "Debian unstable root with python3.14 (log: $SID.log)"
    mkdir -p "$CACHE" && rm -rf "$SID"
    debootstrap --variant=minbase --include=python3.14-dev,python3.14-venv,gcc,libc6-dev \
        unstable "$SID" >"$SID.log" 2>&1 || { tail -n 30 "$SID.log" >&2; die "debootstrap failed"; }
    touch "$SID/.ready"
fi
in_sid python3.14 -VV

# Inside the root this is /tmp/kvqueue-py314.
WORK="$SID/tmp/kvqueue-py314" W=/tmp/kvqueue-py314 VENV=/tmp/kvqueue-py314/venv
rm -rf "$WORK"
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK"
in_sid python3.14 -m venv "$VENV"

# ------------------------------------------- the sdist and the local wheels
cached_venv "$TOOLS" python3 build
log "sdist (the files git tracks or would track, as they are in the work tree)"
(cd "$ROOT" && git ls-files -z --cached --others --exclude-standard |
    tar --null -T - --ignore-failed-read -cf -) | tar -C "$WORK" --one-top-level=tree -xf -
"$TOOLS/bin/python" -m build --sdist -o "$WORK" "$WORK/tree" >"$WORK/sdist.log" 2>&1 \
    || { cat "$WORK/sdist.log" >&2; die "sdist build failed"; }
sdist=$(cd "$WORK" && ls kvqueue-*.tar.gz)

# Wheels for the root's interpreter, on every platform tag it accepts.
reqs=$("$TOOLS/bin/python" "$ROOT/.ci/build_requires.py")
tests=$("$TOOLS/bin/python" "$ROOT/.ci/build_requires.py" --test)
reqs+=" $tests"
key=$( (in_sid python3.14 -VV; echo "$reqs") | sha1sum | cut -c1-16)
if [[ ! -f "$SID/opt/wheels/.ok-$key" ]]; then
    log "wheels for 3.14: $reqs"
    mapfile -t platforms < <(in_sid "$VENV/bin/python" -c '
from pip._vendor.packaging.tags import sys_tags
print("\n".join(dict.fromkeys(t.platform for t in sys_tags() if t.platform != "any")))')
    ((${#platforms[@]})) || die "no platform tags from the root's pip"
    # shellcheck disable=SC2086
    "$TOOLS/bin/python" -m pip download -q --only-binary=:all: --python-version 3.14 \
        --implementation cp --abi cp314 "${platforms[@]/#/--platform=}" -d "$SID/opt/wheels" $reqs
    touch "$SID/opt/wheels/.ok-$key"
fi

# -------------------------------------------------- wheel, install, the suite
log "cp314 wheel from $sdist"
in_sid "$VENV/bin/python" -m pip wheel -q --no-deps -w "$W/dist" "$W/$sdist"
whl=$(cd "$WORK/dist" && ls kvqueue-*-cp314-cp314-linux_*.whl) || die "no cp314 wheel: $(ls "$WORK/dist")"
echo "py314: built $whl" >&2
# shellcheck disable=SC2086
in_sid "$VENV/bin/python" -m pip install -q $tests
in_sid "$VENV/bin/python" -m pip install -q --no-deps "$W/dist/$whl"

copy_suite "$WORK/suite"
log "the whole suite on CPython 3.14 against the installed wheel"
in_sid --cd "$W/suite" "$VENV/bin/python" -c '
import sys, kvqueue
print(sys.version.split()[0], kvqueue.IMPLEMENTATION, kvqueue.__file__)
assert sys.version_info[:2] == (3, 14), sys.version
assert kvqueue.__file__.startswith(sys.prefix), (kvqueue.__file__, sys.prefix)
assert kvqueue.IMPLEMENTATION == "cython", kvqueue.IMPLEMENTATION'
# shellcheck disable=SC2086
in_sid --cd "$W/suite" "$VENV/bin/python" -m pytest -p no:cacheprovider tests ${PYTEST_ARGS:-}

log "benchmark, quick mode, on CPython 3.14"
cp -r "$ROOT/bench" "$WORK/bench" && rm -rf "$WORK/bench/results"
mkdir -p "$WORK/vllm_tests" && cp "$ROOT/vllm_tests/sdist.py" "$ROOT/vllm_tests/vllm.env" "$WORK/vllm_tests/"
in_sid --cd "$W" /usr/bin/env PYTHONPATH="$W/vllm_tests" \
    "$VENV/bin/python" bench/run.py --quick --out "$W/bench-quick.json"
log "done"
