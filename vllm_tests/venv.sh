#!/usr/bin/env bash
# vllm_tests/venv.sh: print the path of a venv holding the vLLM release vllm.env pins, on the
# CPU, with this checkout's kvqueue installed into it.
#
# The venv is made once and kept ($KVQUEUE_CI_VLLM_VENV, default
# <cache root>/vllm-<version>-venv, marker .ready), with ${PYTHON311:-python3.11}: the CPU build
# of torch (TORCH_VERSION in vllm.env) instead of the CUDA torch that vLLM pins, vLLM itself with
# --no-deps, from its wheel downloaded once into <cache root>/wheels, then vLLM's other
# requirements less the torch family and the CUDA-only packages (vllm_tests/requirements.py),
# then pytest. Older vLLM lines run in this same venv (vllm_tests/lines.py).
#
# Where torch comes from: wherever this machine's pip configuration finds it (index-url,
# extra-index-url, find-links, PIP_* variables), plus KVQUEUE_TORCH_INDEX when the user sets it
# (an extra index for torch, one that serves torch==TORCH_VERSION+cpu). Before installing,
# vllm_tests/torch_source.py asks pip which builds are offered (no wheel downloaded); when
# only the CUDA build is (PyPI's torch==TORCH_VERSION, with its NVIDIA packages), it says what
# to set and what each choice weighs, and stops, unless KVQUEUE_TORCH_CUDA=1 takes it. kvqueue is reinstalled from this checkout only when its sources changed since
# the last install (a hash kept in the venv). The cache root is .ci/common.sh's.
# Progress goes to stderr; stdout is the path alone.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
. "$root/.ci/common.sh"   # CACHE, VLLM_VERSION, TORCH_VERSION
cache=$CACHE
venv=${KVQUEUE_CI_VLLM_VENV:-$cache/vllm-$VLLM_VERSION-venv}
python=${PYTHON311:-python3.11}
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1

# What vLLM's conftest files and the suites we run import beyond vLLM's own requirements
# (a few names from vLLM's requirements/test; the rest of that list serves GPU and model tests),
# and pytest-xdist, which runs kvqueue's own live tests two files at a time (run.py).
VLLM_TEST_DEPS=(pytest pytest-asyncio pytest-xdist tblib msgpack)

log() { printf 'vllm_tests/venv.sh: %s\n' "$*" >&2; }

# The marker holds a hash of this recipe. A missing venv is built whole; a venv made by an
# older recipe gets the packages added since (a venv in use is never deleted).
recipe=$(cat "$0" "$here/requirements.py" "$here/vllm.env" | sha256sum | cut -d' ' -f1)
# Two targets (or checkouts) may share the venv: one builds or installs at a time.
mkdir -p "$(dirname "$venv")"
exec 9>"$venv.lock"
flock 9
pip=("$venv/bin/python" -m pip install -q)
if [[ ! -f $venv/.ready ]]; then
    log "building $venv (once)"
    start=$SECONDS
    rm -rf "$venv"
    "$python" -m venv "$venv"
    "${pip[@]}" --upgrade pip
    torch_index=(${KVQUEUE_TORCH_INDEX:+--extra-index-url "$KVQUEUE_TORCH_INDEX"})
    "$venv/bin/python" "$here/torch_source.py" "$TORCH_VERSION" "${torch_index[@]}" >&2
    # vLLM's wheel (about 340 MB) is downloaded once into $cache/wheels and installed from there.
    if ! compgen -G "$cache/wheels/vllm-$VLLM_VERSION-*.whl" >/dev/null; then
        "$venv/bin/python" -m pip download -q --no-deps --only-binary=:all: \
            -d "$cache/wheels" "vllm==$VLLM_VERSION"
    fi
    "${pip[@]}" --find-links "$cache/wheels" "${torch_index[@]}" "torch==$TORCH_VERSION" packaging
    "${pip[@]}" --no-deps --no-index --find-links "$cache/wheels" "vllm==$VLLM_VERSION"
    built=1
fi
if [[ $(cat "$venv/.ready" 2>/dev/null) != "$recipe" ]]; then
    "$venv/bin/python" "$here/requirements.py" > "$venv/vllm-requirements.txt"
    # pip's resolver warns that vLLM's CUDA requirements are missing: they are left out on purpose.
    "${pip[@]}" -r "$venv/vllm-requirements.txt" "torch==$TORCH_VERSION" \
        "${VLLM_TEST_DEPS[@]}" setuptools "Cython>=3.1" 2> >(grep -v "requires\|resolver" >&2)
    [[ -n ${built:-} ]] && log "built in $((SECONDS - start)) s, $(du -sh "$venv" | cut -f1)"
    echo "$recipe" > "$venv/.ready"
fi

# Cheap when nothing changed: the hash of kvqueue's build inputs decides.
stamp=$(cd "$root" && cat pyproject.toml setup.py src/kvqueue/*.py src/kvqueue/*.pyx src/kvqueue/*.pyi src/kvqueue/*.h \
    src/kvqueue/vllm/*.py src/kvqueue/vllm/*.pyx src/kvqueue/vllm/*.pyi src/kvqueue/vllm/*.h 2>/dev/null | sha256sum | cut -d' ' -f1)
if [[ $(cat "$venv/.kvqueue-src" 2>/dev/null) != "$stamp" ]]; then
    log "installing kvqueue from $root"
    "$venv/bin/python" -m pip install -q --force-reinstall --no-deps --no-build-isolation "$root"
    echo "$stamp" > "$venv/.kvqueue-src"
fi
echo "$venv"
