#!/usr/bin/env bash
# The LLaMA-Factory frontend's own venv, .venv-llamafactory (idempotent: a finished venv is only re-checked).
#
# llamafactory 0.9.5 pins older packages than the TRL frontend wants (transformers<=5.6, trl<=0.24,
# datasets<=4.0, accelerate<=1.11), so it cannot share .venv. The recipe:
#   1. torch 2.9.1 + torchvision 0.24.1 + torchaudio 2.9.1 (llamafactory's data package imports torchaudio,
#      whose compiled part must match torch's build);
#   2. llamafactory 0.9.5 with --no-deps, and by hand the pins it needs plus light pure-Python deps;
#   3. peft 0.21 instead of llamafactory's peft 0.18.x: ktcore's routed-expert LoRA needs peft's LoRA factor
#      folding (>= 0.21). llamafactory's peft check is a soft one; the frontend sets DISABLE_VERSION_CHECK=1.
#   4. ktcore (editable, --no-deps) and frontends/llamafactory (editable, --no-deps), and the plugin packages
#      that do not link torch (native backends, adapter formats; scripts/plugin_packages.sh), so that kt_backend
#      amx_bf16 / llamafile and every adapter format work here as in .venv.
# Large downloads (torch is a CUDA build on PyPI, ~4 GB with its nvidia-* wheels) are kept in
# $KTCORE_WHEEL_CACHE (default ~/.cache/ktcore/wheels) and installed from there, so a second run or CI on the
# same machine downloads nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${KTCORE_LLAMAFACTORY_VENV:-.venv-llamafactory}
PY=${PYTHON:-python3}
WHEELS=${KTCORE_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ktcore/wheels}
STAMP=$VENV/.ktcore-setup-v2  # v2: gguf among the light packages
start=$(date +%s)

TORCH=(torch==2.9.1 torchvision==0.24.1 torchaudio==2.9.1)
PINNED=(llamafactory==0.9.5 transformers==5.6.0 peft==0.21.0 trl==0.24.0 datasets==4.0.0 accelerate==1.11.0
        torchdata==0.11.0)
LIGHT=(omegaconf pydantic fire "tyro<0.9" einops sentencepiece tiktoken pandas scipy matplotlib protobuf
       pluggy click pyyaml tqdm safetensors pytest gguf)

quiet_pip() {  # pip, without its warning for every package the machine's local mirrors do not carry
    local log rc=0
    log=$(mktemp)
    "$@" 2>"$log" || rc=$?
    grep -v "is ignored: it is neither a file nor a directory" "$log" >&2 || true
    rm -f "$log"
    return $rc
}

. scripts/plugin_packages.sh
plugin_packages() {  # the torch-free plugins; built with PyPI's build tools, none of their dependencies
    local pkg
    for pkg in "${TORCH_FREE_PLUGINS[@]}"; do
        install_plugin "$VENV" --no-deps "$pkg"
    done
}

if [ -f "$STAMP" ] && DISABLE_VERSION_CHECK=1 "$VENV/bin/python" -c "import llamafactory.train.tuner, ktcore, ktcore_llamafactory" 2>/dev/null; then
    quiet_pip "$VENV/bin/python" -m pip install -q --no-deps --no-build-isolation -e . -e frontends/llamafactory >/dev/null
    quiet_pip plugin_packages
    echo "setup_llamafactory: $VENV ready (checked in $(( $(date +%s) - start ))s)"
    exit 0
fi

twice() {  # a pip step, tried again once (a first run once died on a wheel of the cache it had just listed)
    "$@" && return
    echo "setup_llamafactory: that pip step failed (above); trying it once more" >&2
    "$@" && return
    echo "setup_llamafactory: it failed twice: check the network and the space under $WHEELS, then run this script" \
         "again (what finished is kept)" >&2
    return 1
}

mkdir -p "$WHEELS"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip=(quiet_pip "$VENV/bin/python" -m pip)
"${pip[@]}" install -q --upgrade "pip>=24" setuptools wheel

# torch's build decides everything else: pin it for every later step
cons=$VENV/ktcore-constraints.txt
printf '%s\n' "${TORCH[@]}" > "$cons"

echo "setup_llamafactory: fetching wheels into $WHEELS (only what is missing)"
twice "${pip[@]}" download -q -d "$WHEELS" --find-links "$WHEELS" "${TORCH[@]}"
twice "${pip[@]}" download -q -d "$WHEELS" --find-links "$WHEELS" -c "$cons" "${TORCH[@]}" "${PINNED[@]:1}" "${LIGHT[@]}"
twice "${pip[@]}" download -q -d "$WHEELS" --no-deps "${PINNED[0]}"

echo "setup_llamafactory: installing from $WHEELS"
inst=("${pip[@]}" install -q --no-index --find-links "$WHEELS" -c "$cons")
twice "${inst[@]}" "${TORCH[@]}"
twice "${inst[@]}" "${PINNED[@]:1}" "${LIGHT[@]}"
twice "${inst[@]}" --no-deps "${PINNED[0]}"
"${pip[@]}" install -q --no-deps --no-build-isolation -e . -e frontends/llamafactory
quiet_pip plugin_packages

DISABLE_VERSION_CHECK=1 "$VENV/bin/python" - <<'EOF'
import torch, torchaudio, transformers, peft, trl, datasets, accelerate
import llamafactory.train.tuner  # imports the data package (torchaudio) and every trainer
import ktcore, ktcore_llamafactory, ktcore_amx_bf16, ktcore_amx_int8._ext, ktcore_llamafile._ext, ktcore_adapter_peft, ktcore_adapter_gguf
import pathlib, sys  # frontends/llamafactory's llamafactory-cli wrapper, installed over llamafactory's own
assert "ktcore_llamafactory.cli" in (pathlib.Path(sys.executable).parent / "llamafactory-cli").read_text(), \
    "llamafactory-cli is not ktcore's wrapper (frontends/llamafactory must be installed after llamafactory)"
print("setup_llamafactory: torch", torch.__version__, "| torchaudio", torchaudio.__version__, "| transformers",
      transformers.__version__, "| peft", peft.__version__, "| trl", trl.__version__, "| datasets",
      datasets.__version__, "| accelerate", accelerate.__version__)
EOF
touch "$STAMP"
echo "setup_llamafactory: $VENV built in $(( $(date +%s) - start ))s"
