#!/usr/bin/env bash
# Checks that cibuildwheel, with the [tool.cibuildwheel] configuration in
# pyproject.toml, would build exactly the wheels listed in
# .ci/wheel-identifiers.txt: a typo in the configuration fails here.
# Works offline once cibuildwheel is installed (cached in a venv under the
# cache root of .ci/common.sh).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
. "$ROOT/.ci/common.sh"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
CIBW_SPEC=${CIBW_SPEC:-"cibuildwheel>=4,<5"}

# cibuildwheel 4 needs Python >= 3.11: the newest pyenv CPython, else python3.
PY=$(ls -d "$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")"/versions/3.1[1-9].*/bin/python3.1[1-9] 2>/dev/null \
     | sort -V | tail -1 || true)
PY=${PY:-python3}
V="$CACHE/venvs/cibuildwheel"
if [[ ! -f "$V/.ready" ]] || ! cmp -s "$V/.ready" <(echo "$CIBW_SPEC"); then
    rm -rf "$V"
    "$PY" -m venv "$V"
    "$V/bin/python" -m pip install -q "$CIBW_SPEC"
    echo "$CIBW_SPEC" > "$V/.ready"
fi
CIBW="$V/bin/cibuildwheel"

expected=$(grep -v -e '^#' -e '^$' "$ROOT/.ci/wheel-identifiers.txt" | sort)
actual=$(
    cd "$ROOT"
    # Only the configuration file counts, not any CIBW_* set in this environment.
    for var in $(env | sed -n 's/^\(CIBW_[A-Z0-9_]*\)=.*/\1/p'); do unset "$var"; done
    for platform in linux macos windows; do
        "$CIBW" --print-build-identifiers --platform "$platform"
    done | sort
)
if [[ "$expected" != "$actual" ]]; then
    echo "cibuildwheel identifiers differ from .ci/wheel-identifiers.txt (< expected, > configured):" >&2
    diff <(echo "$expected") <(echo "$actual") >&2 || true
    exit 1
fi
echo "cibuildwheel: $(echo "$actual" | wc -l) build identifiers, as expected"
