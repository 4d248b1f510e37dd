#!/usr/bin/env bash
# Set everything up, then run the whole test suite (core + plugin packages).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The LLaMA-Factory frontend lives in its own venv (llamafactory pins older packages): built and tested when the
# venv exists already or KTCORE_LLAMAFACTORY=1 (a cold build downloads ~4 GB of wheels into ~/.cache/ktcore/wheels).
if [ -d .venv-llamafactory ] || [ "${KTCORE_LLAMAFACTORY:-0}" = 1 ]; then
    bash scripts/setup_llamafactory.sh
    .venv-llamafactory/bin/python -m pytest -q -p no:cacheprovider frontends/llamafactory/tests
fi
export KTCORE_STRICT_PLUGINS=${KTCORE_STRICT_PLUGINS:-1}
paths=(tests)
for pkg in frontends/trl backends/amx_bf16 backends/amx_int8 backends/llamafile; do
    [ -d "$pkg/tests" ] && paths+=("$pkg/tests")
done
exec .venv/bin/python -m pytest -q -p no:cacheprovider "${paths[@]}" "$@"
