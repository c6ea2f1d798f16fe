#!/usr/bin/env bash
# Build a free-threaded CPython 3.13 from Debian's own source package (Debian
# ships no free-threaded binary), build the compiled twin for it, and run the
# thread-misuse fuzz programs two ways:
#   as shipped (the import re-enables the GIL): must not crash;
#   with the GIL forced off (PYTHON_GIL=0): shows why the module must not yet
#   declare itself free-threading compatible.
# Everything lands in build/freethreading/; nothing is installed system-wide
# (apt runs with a private state directory). Takes ~8 min on 2 cores.
#
# Usage: .ci/freethreading.sh [OPS per thread, default 200000]
set -euo pipefail
cd "$(dirname "$0")/.."
ops="${1:-200000}"
root="$PWD/build/freethreading"
prefix="$root/python"
mkdir -p "$root/apt/lists/partial" "$root/apt/cache/archives/partial" "$root/apt/sources"
cat >"$root/apt/sources/trixie.sources" <<'EOF'
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: trixie
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
touch "$root/apt/status"
apt_private=(-o Dir::Etc::SourceList=/dev/null -o Dir::Etc::SourceParts="$root/apt/sources"
    -o Dir::State::Lists="$root/apt/lists" -o Dir::Cache="$root/apt/cache"
    -o Dir::State::Status="$root/apt/status")

if [[ ! -x "$prefix/bin/python3.13t" ]]; then
    apt-get "${apt_private[@]}" update -qq
    (cd "$root" && apt-get "${apt_private[@]}" source --download-only -qq python3.13)
    tar -C "$root" -xf "$root"/python3.13_*.orig.tar.xz
    (cd "$root"/Python-3.13.* && ./configure -q --disable-gil --prefix="$prefix" &&
        make -s -j"$(nproc)" && make -s install) >"$root/build.log" 2>&1
fi
py="$root/venv/bin/python"
[[ -x "$py" ]] || { "$prefix/bin/python3.13t" -m venv "$root/venv" &&
    "$py" -m pip install -q "Cython>=3.1" setuptools; }

rm -rf "$root/kvqueue" && mkdir -p "$root/kvqueue"
cp -r src setup.py pyproject.toml "$root/kvqueue/" && touch "$root/kvqueue/README.md"
(cd "$root/kvqueue" && "$py" setup.py -q build_ext --inplace) >/dev/null 2>&1
export PYTHONPATH="$root/kvqueue/src"

cd tests
"$py" -c 'import sys; print(sys.version); assert not sys._is_gil_enabled()'
run() {  # $1: label; the rest: environment assignments for the runs
    for seed in 0 1 2; do
        for program in isolated/fuzz_threads.py isolated/fuzz_race.py; do
            if env "${@:2}" "$py" -W ignore::RuntimeWarning "$program" c "$seed" "$ops" \
                >"$root/out" 2>&1; then
                echo "$1, $program seed $seed: survived $(tail -n 1 "$root/out")"
            else
                echo "$1, $program seed $seed: FAILED (exit $?): $(tail -n 1 "$root/out")"
            fi
        done
    done
}
run "as shipped (GIL re-enabled on import)"
run "GIL forced off" PYTHON_GIL=0
