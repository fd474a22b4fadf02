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
# Then P/D deployments: vLLM's NixlConnector at prefill tp2 -> decode tp1 and SGLang's disaggregation (below).
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

# Disaggregated prefill/decode on real connectors (docs/pd.md): each P/D deployment (a prefill and a decode server
# behind the engine's own proxy or router) is attached as the server of the tp2 cell (--attach tp2=URL), so the
# harness judges it by parity with a plain tp1 reference (the pd_* checks need the harness's own store: SKIPs).
# vLLM NixlConnector, heterogeneous TP (prefill tp2 -> decode tp1): the proxy is vLLM's
# tests/v1/kv_connector/nixl_integration/toy_proxy_server.py (from vLLM's repository: $VLLM_TOY_PROXY).
# SGLang: --disaggregation-mode prefill / decode with the NIXL transfer backend, sglang_router's --pd-disaggregation.
pd_deployment() {  # pd_deployment NAME PROXY_PORT START_CMDS... (each a quoted command line): starts, waits, leaves pids
    local name=$1 port=$2; shift 2
    PIDS=()
    for cmd in "$@"; do
        bash -c "exec $cmd" > "$OUT/$name-$((${#PIDS[@]})).server.log" 2>&1 &
        PIDS+=($!)
    done
    for _ in $(seq 1 120); do
        curl -sf "http://127.0.0.1:$port/v1/models" > /dev/null 2>&1 && return 0
        curl -sf "http://127.0.0.1:$port/health" > /dev/null 2>&1 && return 0
        sleep 5
    done
    echo "== $name: the P/D deployment did not answer on port $port" >&2
}
stop_deployment() { kill "${PIDS[@]}" 2> /dev/null; wait "${PIDS[@]}" 2> /dev/null; }
DSV2="$OUT/tiny-dsv2-hf"
[ -f "$DSV2/config.json" ] || harness export --model tiny-dsv2 --out "$DSV2" > /dev/null 2>&1 || DSV2=""
if [ -n "${HARNESS_VLLM_PYTHON:-}" ] && [ -x "$HARNESS_VLLM_PYTHON" ] && [ -n "${VLLM_TOY_PROXY:-}" ] && [ -n "$DSV2" ]; then
    NIXL='{"kv_connector":"NixlConnector","kv_role":"kv_both"}'
    pd_deployment pd-vllm-nixl 8300 \
        "CUDA_VISIBLE_DEVICES=0,1 VLLM_NIXL_SIDE_CHANNEL_PORT=5600 $HARNESS_VLLM_PYTHON -m vllm.entrypoints.openai.api_server --model $DSV2 --served-model-name tiny-dsv2 --host 127.0.0.1 --port 8301 --tensor-parallel-size 2 --enforce-eager --kv-transfer-config '$NIXL'" \
        "CUDA_VISIBLE_DEVICES=2 VLLM_NIXL_SIDE_CHANNEL_PORT=5700 $HARNESS_VLLM_PYTHON -m vllm.entrypoints.openai.api_server --model $DSV2 --served-model-name tiny-dsv2 --host 127.0.0.1 --port 8302 --tensor-parallel-size 1 --enforce-eager --kv-transfer-config '$NIXL'" \
        "$HARNESS_VLLM_PYTHON $VLLM_TOY_PROXY --host 127.0.0.1 --port 8300 --prefiller-hosts 127.0.0.1 --prefiller-ports 8301 --decoder-hosts 127.0.0.1 --decoder-ports 8302"
    step pd-vllm-nixl 0 harness run --suite tp --model tiny-dsv2 --engine vllm --topo tp2 --attach tp2=http://127.0.0.1:8300 --max-seq-len 256
    stop_deployment
fi
if [ -n "${HARNESS_SGLANG_PYTHON:-}" ] && [ -x "$HARNESS_SGLANG_PYTHON" ] && [ -n "$DSV2" ]; then
    pd_deployment pd-sglang 8400 \
        "CUDA_VISIBLE_DEVICES=0,1 $HARNESS_SGLANG_PYTHON -m sglang.launch_server --model-path $DSV2 --host 127.0.0.1 --port 8401 --tp 2 --disaggregation-mode prefill --disaggregation-transfer-backend nixl" \
        "CUDA_VISIBLE_DEVICES=2 $HARNESS_SGLANG_PYTHON -m sglang.launch_server --model-path $DSV2 --host 127.0.0.1 --port 8402 --tp 1 --disaggregation-mode decode --disaggregation-transfer-backend nixl" \
        "$HARNESS_SGLANG_PYTHON -m sglang_router.launch_router --pd-disaggregation --prefill http://127.0.0.1:8401 --decode http://127.0.0.1:8402 --host 127.0.0.1 --port 8400"
    step pd-sglang 0 harness run --suite tp --model tiny-dsv2 --engine sglang --topo tp2 --attach tp2=http://127.0.0.1:8400 --max-seq-len 256
    stop_deployment
fi

echo
echo "engines-gpu-check summary ($GPUS GPU(s); logs and reports in $OUT)"
ok=0
for i in "${!NAMES[@]}"; do
    verdict=OK; [ "${RCS[$i]}" = "${WANTS[$i]}" ] || { verdict=UNEXPECTED; ok=1; }
    printf '  %-15s exit %s (want %s) %5ss  %s\n' "${NAMES[$i]}" "${RCS[$i]}" "${WANTS[$i]}" "${SECS[$i]}" "$verdict"
done
exit $ok
