# Sourced by setup.sh and setup_llamafactory.sh: install this repository's plugin packages into a venv, each
# only when it is missing there or its files changed since it was installed (a source-hash stamp per package
# under VENV/ktcore-setup-stamps): editable installs follow Python edits by themselves, but pip recompiles a
# native backend on every run.

# The plugin packages that do not link torch (native backends, adapter formats): every environment gets them.
TORCH_FREE_PLUGINS=(backends/amx_bf16 backends/amx_int8 backends/llamafile adapters/peft adapters/fused_expert adapters/gguf)

sources_hash() {  # the files of the given paths, build outputs and tests aside
    find "$@" -type f ! -path '*/build/*' ! -path '*/tests/*' ! -path '*/__pycache__/*' ! -path '*.egg-info/*' \
        ! -name '*.so' -print0 | LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -c1-64
}

# install_if_changed VENV "PIP ARGS" PIP_TARGET SOURCE_PATH...
install_if_changed() {
    local venv=$1 pip_args=$2 target=$3 dist stamp hash
    shift 3
    dist=$(sed -n 's/^name = "\(.*\)"/\1/p' "${target%%[*}/pyproject.toml" | head -1 | tr - _)
    stamp=$venv/ktcore-setup-stamps/$dist
    hash=$(sources_hash "$@")
    if [ "$(cat "$stamp" 2>/dev/null)" = "$hash" ] &&
            compgen -G "$venv/lib/python*/site-packages/$dist-*.dist-info" >/dev/null; then
        return  # installed, and unchanged since
    fi
    # shellcheck disable=SC2086  # pip_args: several words
    "$venv/bin/python" -m pip install -q $pip_args -e "$target"
    mkdir -p "$venv/ktcore-setup-stamps"
    echo "$hash" > "$stamp"
}

# install_plugin VENV "PIP ARGS" PACKAGE: a native package's C++ includes ktcore's shared headers
install_plugin() {
    if [ -f "$3/CMakeLists.txt" ]; then
        install_if_changed "$1" "$2" "$3" "$3" ktcore/include
    elif [ -f "$3/pyproject.toml" ]; then
        install_if_changed "$1" "$2" "$3" "$3"
    fi
}
