#!/usr/bin/env bash
# Builds the release wheel into ${1:-target/wheels}: abi3 (CPython >= 3.10), manylinux_2_28, so it
# installs on glibc >= 2.28 (as torch's own wheels do). zig (PyPI package ziglang, in
# requirements/dev.txt) links against glibc 2.28 whatever the build machine's glibc; maturin then
# audits the symbols and refuses a wheel that needs newer ones.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-target/wheels}"
PY="${PYTHON:-.venv/bin/python}"
# maturin finds zig as `python -m ziglang` of the python on PATH: make that the venv's.
export PATH="$(cd "$(dirname "$PY")" && pwd):$PATH"
exec "$PY" -m maturin build --release --zig --compatibility manylinux_2_28 --interpreter "$PY" --out "$out"
