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
for pkg in frontends/trl backends/amx_bf16; do
    if [ -f "$pkg/pyproject.toml" ]; then
        python -m pip install -q -e "$pkg"
    fi
done
echo "ktcore installed in .venv ($(python -c 'import ktcore; print(ktcore.__version__)'))"
