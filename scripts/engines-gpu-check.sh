#!/usr/bin/env bash
# The seeds' architectures on real engines on a CUDA machine (4+ GPUs): the mla suite on the exported DeepSeek-V2
# model (tiny-dsv2: kv_lora_rank 512 + qk_rope_dim 64, what MLA kernels take) through vLLM and SGLang at every DCP
# axis the templates pass: DCP 2 and 4, interleave 1 / 16 / 64 (vLLM --dcp-kv-cache-interleave-size), Q replicated in
# the DCP group (vLLM --dcp-q-replicate, SGLang --dcp-replicate-q-proj), tp4 plain; then the plugin fault
# (HARNESS_VLLM_FAULT=mla-kv-b-shard) that must FAIL. An engine whose python is absent is skipped, saying so.
# A topology an engine refuses is a SKIP quoting its own line (the templates' `refuses`), never a fallback.
# Not here: EP with and without redundant experts and MTP need an exported MoE / MTP checkpoint (the exported
# DeepSeek-V2 model has a dense FFN and no MTP layer): `harness plan --model tests/data/configs/deepseek-v2-lite
# --topo tp4ep4` plans EP; these cells run once such an export exists.
# Time estimate (H100-class, 4 GPUs): ~60-90 s per server start, 8 server configurations per engine: ~12 min per
# engine, ~25 min for both. Usage, from the repository root with the harness environment active:
#   HARNESS_VLLM_PYTHON=/path/to/vllm/python HARNESS_SGLANG_PYTHON=/path/to/sglang/python scripts/engines-gpu-check.sh [OUT]
set -u
OUT=${1:-reports/engines-gpu-check}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 HARNESS_CACHE_DIR="$OUT/cache"
TOPOS=tp4,tp4dcp2,tp4dcp4,tp4dcp4i16,tp4dcp4i64,tp4dcp2q,tp4dcp4q
GPUS=$(python -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)')
if [ "$GPUS" -lt 4 ]; then
    echo "engines-gpu-check: needs 4 CUDA devices (tp4), found $GPUS; nothing run" >&2
    exit 2
fi

declare -a NAMES RCS WANTS SECS
step() {  # step NAME WANTED_EXIT CMD...
    local name=$1 want=$2; shift 2
    echo "== $name: $*"
    rm -rf "${OUT:?}/$name"
    local t0=$SECONDS
    "$@" --out "$OUT/$name" > "$OUT/$name.log" 2>&1
    local rc=$?
    NAMES+=("$name"); RCS+=("$rc"); WANTS+=("$want"); SECS+=("$((SECONDS - t0))")
    tail -n 12 "$OUT/$name.log"
}

for engine in vllm sglang; do
    var=HARNESS_$(echo "$engine" | tr a-z A-Z)_PYTHON
    if [ -z "${!var:-}" ] || [ ! -x "${!var}" ]; then
        echo "== $engine: skipped (\$$var is not an interpreter)"
        continue
    fi
    step "mla-$engine" 0 harness run --suite mla --model tiny-dsv2 --engine "$engine" --topo "$TOPOS" --max-seq-len 256
done
if [ -n "${HARNESS_VLLM_PYTHON:-}" ] && [ -x "$HARNESS_VLLM_PYTHON" ]; then
    step mla-vllm-fault 1 env HARNESS_VLLM_FAULT=mla-kv-b-shard harness run --suite mla --model tiny-dsv2 \
        --engine vllm --topo tp4 --max-seq-len 256
fi

echo
echo "engines-gpu-check summary ($GPUS GPU(s); logs and reports in $OUT)"
ok=0
for i in "${!NAMES[@]}"; do
    verdict=OK; [ "${RCS[$i]}" = "${WANTS[$i]}" ] || { verdict=UNEXPECTED; ok=1; }
    printf '  %-15s exit %s (want %s) %5ss  %s\n' "${NAMES[$i]}" "${RCS[$i]}" "${WANTS[$i]}" "${SECS[$i]}" "$verdict"
done
exit $ok
