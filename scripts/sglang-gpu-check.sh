#!/usr/bin/env bash
# GPU check of the `sglang` engine template (SGLang has no CPU build). Run on a GPU box as is:
#
#   scripts/sglang-gpu-check.sh [OUT_DIR]
#
# Installs SGLang into .venv-sglang (unless $HARNESS_SGLANG_PYTHON points at an existing one), then
#   1. tp1 on SGLang against the embedded reference (harness-serve on CPU): the dialect end to end;
#   2. with >= 2 GPUs: tp2 and tp2dcp2 (--dcp-size) against SGLang's own tp1 reference;
#   3. the hidden-state probe (tests/vllm_plugin/harness_sglang_probe, through SGLang's --forward-hooks, installed
#      here into SGLang's environment): every cell of step 2 has per-layer errors from captured hidden states
#      (with 1 GPU, nothing checks them).
# Exit status: 0 when every cell passes. Reports land in OUT_DIR (default reports/sglang-gpu-check).
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
out="${1:-reports/sglang-gpu-check}"
rm -rf "$out/tp1-vs-embedded" "$out/tp2"  # an earlier check's runs: --out never writes over results
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1

if [ -z "${HARNESS_SGLANG_PYTHON:-}" ]; then
    if [ ! -x .venv-sglang/bin/python ]; then
        python3 -m venv .venv-sglang
        .venv-sglang/bin/pip install --quiet --upgrade pip
        .venv-sglang/bin/pip install --quiet "sglang[all]"
    fi
    export HARNESS_SGLANG_PYTHON="$root/.venv-sglang/bin/python"
fi
"$HARNESS_SGLANG_PYTHON" -c "import importlib.metadata as m; print('sglang', m.version('sglang'))"
# the probe plugin (and its vLLM siblings, which do nothing here): --no-deps, into SGLang's own environment
rm -rf tests/vllm_plugin/build tests/vllm_plugin/*.egg-info
"$HARNESS_SGLANG_PYTHON" -m pip install --quiet --no-deps --force-reinstall tests/vllm_plugin
rm -rf tests/vllm_plugin/build tests/vllm_plugin/*.egg-info

gpus=$(nvidia-smi -L | wc -l)
status=0
harness run --suite dcp --model tiny-hd64 --topo tp1 --engine sglang --reference-engine harness-serve \
    --out "$out/tp1-vs-embedded" || status=$?
if [ "$gpus" -ge 2 ]; then
    harness run --suite dcp --model tiny-hd64 --topo tp2,tp2dcp2 --engine sglang --out "$out/tp2" || status=$?
else
    echo "only $gpus GPU: tp2 / tp2dcp2 cells need 2"
fi
# the probe's captures reached the runs: each cell run and referenced on SGLang has per-layer hidden-state errors
python3 - "$out" <<'PY' || status=$?
import json, sys
from pathlib import Path
bad = []
for results in sorted(Path(sys.argv[1]).glob("*/results.json")):
    for cell in json.loads(results.read_text())["cells"]:
        if cell.get("reference_engine") != "sglang" or cell["status"] == "SKIP":
            continue  # the embedded reference (harness-serve) captures no hidden states
        if not (cell.get("details") or {}).get("layer_errors"):
            bad.append(f"{results.parent.name}/{cell['topology']}")
        print(f"{results.parent.name}/{cell['topology']}: {cell['status']}, layer errors "
              f"{(cell.get('details') or {}).get('layer_errors', {}).get('error')}")
sys.exit(f"no hidden states captured in {', '.join(bad)}" if bad else 0)
PY
exit "$status"
