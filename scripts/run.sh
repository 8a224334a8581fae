#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh) and runs the main job: real generation with the embedded
# SmolLM2-135M-Instruct on a batch of example prompts, printing the answers, tokens/s, KV-cache
# usage and prefix-cache hits. Extra arguments go to `ferrokv generate` (e.g. your own prompts).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/ferrokv generate --max-tokens 64 "$@"
