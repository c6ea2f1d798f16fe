# Sourced by the CI scripts of .ci/ (which define ROOT and log) and by vllm_tests/venv.sh.

# The one cache root of everything kvqueue's checks download or build once: the vLLM venv and
# wheel, vLLM's sdists, CI's tool venvs and local wheels, the 3.14 root, the arm64 sysroot,
# the benchmark's baseline builds. bench/ and vllm_tests/ (Python) read it in
# vllm_tests/sdist.py's cache_dir().
CACHE=${KVQUEUE_CI_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvqueue}
# The old names of the CI variables: refused, not ignored (a venv or cache set under an old
# name would silently be the default one).
for old in KVQUEUE_CACHE KVQUEUE_VLLM_VENV KVQUEUE_WHEEL_PYTHONS KVQUEUE_AARCH64_PYTHONS; do
    if [[ -n ${!old:-} ]]; then
        echo "$old is now KVQUEUE_CI_${old#KVQUEUE_} (.ci/common.sh)" >&2
        exit 2
    fi
done
# VLLM_VERSION and TORCH_VERSION: the vLLM release the checks and benchmarks run against.
. "$(dirname "${BASH_SOURCE[0]}")/../vllm_tests/vllm.env"

# copy_suite DEST: the test suite, away from the source tree (tests/ and the
# pytest settings only), so that src/ cannot be imported and the installed
# kvqueue is what runs.
copy_suite() {
    local dest=$1
    mkdir -p "$dest"
    cp -r "$ROOT/tests" "$dest/tests"
    cp "$ROOT/pyproject.toml" "$dest/"
    rm -rf "$dest/tests/__pycache__" "$dest/tests/.hypothesis"
}

# cached_venv DIR PYTHON PACKAGE...: a venv with PACKAGEs, made once and kept
# (a marker file says it finished) so that a second run reuses it.
cached_venv() {
    local dir=$1 python=$2; shift 2
    [[ -f "$dir/.ready" ]] && return 0
    log "venv $(basename "$dir")"
    rm -rf "$dir"
    "$python" -m venv "$dir"
    "$dir/bin/python" -m pip install -q --upgrade pip
    "$dir/bin/python" -m pip install -q "$@"
    touch "$dir/.ready"
}
