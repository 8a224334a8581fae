#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh) and runs every test: cargo test, then pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "[test] cargo test"
cargo test --workspace --exclude ferrokv-py -q
echo "[test] pytest"
.venv/bin/python -m pytest -q "$@"
