#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh) and runs the main job: the scheduler demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m ferrokv.demo "$@"
