#!/usr/bin/env bash
# Set everything up, then run the whole test suite (core + plugin packages).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export KTCORE_STRICT_PLUGINS=${KTCORE_STRICT_PLUGINS:-1}
paths=(tests)
for pkg in frontends/trl backends/amx_bf16 backends/llamafile examples/plugins/ktcore-example-backend; do
    [ -d "$pkg/tests" ] && paths+=("$pkg/tests")
done
exec .venv/bin/python -m pytest -q -p no:cacheprovider "${paths[@]}" "$@"
