#!/usr/bin/env bash
# Set everything up, then run the built-in demo (tiny Qwen3-MoE, LoRA on a synthetic task, CPU experts).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ktcore demo "$@"
